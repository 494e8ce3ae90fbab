#ifndef GRADSUM_LOSSES_LINEAR_CROSS_ENTROPY_H_
#define GRADSUM_LOSSES_LINEAR_CROSS_ENTROPY_H_

// Fused LM-head matmul + cross-entropy forward/backward that never materialises the full
// [N, V] logits (SEMANTICS.md §3 for the loss; §10 for where it sits in `moe_lm`).
//
// For each chunk of C token rows:
//   logits_c      = hidden_c @ head                     [C, V] fp32 scratch (the only big buffer)
//   dlogits_c     = fused CE forward+backward in place   (cross_entropy.h)
//   grad_head    += hidden_c^T @ dlogits_c               accumulated in fp32
//   grad_hidden_c = dlogits_c @ head^T
// Peak extra memory is one chunk of logits (C * V * 4 bytes) plus O(C + V) scratch,
// reported in LinearCrossEntropyResult::peak_scratch_bytes. GEMMs are BLAS calls
// (core/gemm.h), split over `num_threads` threads of the shared pool.
// Chunks whose rows all have weight 0 skip the matmuls (their grad_hidden rows are 0).
//
//   LinearCrossEntropyOptions opt;                    // automatic chunk size
//   absl::StatusOr<LinearCrossEntropyResult> r = LinearCrossEntropyForwardBackward(
//       hidden, head, labels, /*token_weights=*/{}, stats.global_ce_weight_sum,
//       grad_hidden, grad_head, opt);
//   // r->ce.local_loss is L_ce[r, m]; grad_head has had dL/dhead added to it.

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tensor.h"
#include "data/streams.h"
#include "losses/ce_options.h"
#include "losses/cross_entropy.h"

namespace gradsum::losses {

struct LinearCrossEntropyOptions {
  // Labels equal to this are not valid (weight 0, zero gradient).
  int64_t ignore_index = data::kIgnoreIndex;
  // Threads for the GEMMs and the CE rows (caller's thread included).
  int num_threads = 2;
  // Token rows per chunk. 0 = automatic: min(rows whose fp32 logits fit in 4 MiB, N / 8),
  // but at least 32 rows, and at most N.
  int64_t chunk_rows = 0;
  // false: head and grad_head are [Dm, V]. true: both are [V, Dm], the layout of a
  // torch.nn.Linear(Dm, V) weight, so a caller holding that layout passes it without a
  // transposed copy (the GEMMs read it transposed; same math, another summation order).
  bool head_transposed = false;
  // The CE options of SEMANTICS.md §3.2 (losses/ce_options.h; 0 = off, the defaults, which
  // leave the results bit-identical to the plain CE).
  CeOptions ce;
};

struct LinearCrossEntropyResult {
  // Loss, weight sum and valid count of these rows, as from CrossEntropyForwardBackward.
  CrossEntropyResult ce;
  // The most bytes this call held allocated at once: the logits chunk, 9 bytes per chunk
  // row and one fp32 row of V per thread (the CE kernel's). The BLAS's internal GEMM packing
  // buffers (cache-sized) are not included; bench/losses_bench measures the true heap peak.
  int64_t peak_scratch_bytes = 0;
  // Chunk size used.
  int64_t chunk_rows = 0;
};

// hidden:        [N, Dm] f32 on the CPU (the final-norm output).
// head:          [Dm, V] f32 (the LM head, `Wo` of SEMANTICS §10); [V, Dm] with
//                options.head_transposed (then grad_head is [V, Dm] too).
// labels, token_weights, global_weight_sum: as for CrossEntropyForwardBackward.
// grad_hidden:   [N, Dm] f32, overwritten with dL/dhidden. May be the same memory as
//                `hidden` (each chunk's rows are read for grad_head before being overwritten).
// grad_head:     [Dm, V] f32, dL/dhead is ADDED to it (accumulation over micro-batches).
//                Must not overlap hidden, head or grad_hidden.
//
// Errors: InvalidArgument for dtypes other than f32, non-CPU views, mismatched shapes,
// chunk_rows < 0, a bad CE option (named with its value), and every CE error (bad labels, weights
// or D, FailedPrecondition for a local D, non-finite logits rows named by their row in [0, N)).
// Label, weight and D checks run before anything is written; after a non-finite-row error the
// outputs are partly written and must not be used.
absl::StatusOr<LinearCrossEntropyResult> LinearCrossEntropyForwardBackward(
    const TensorView& hidden, const TensorView& head, absl::Span<const int64_t> labels,
    absl::Span<const float> token_weights, double global_weight_sum, const TensorView& grad_hidden,
    const TensorView& grad_head, const LinearCrossEntropyOptions& options = {});

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_LINEAR_CROSS_ENTROPY_H_
