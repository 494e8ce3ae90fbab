#ifndef GRADSUM_LOSSES_CROSS_ENTROPY_H_
#define GRADSUM_LOSSES_CROSS_ENTROPY_H_

// Fused cross-entropy forward + backward on the CPU (SEMANTICS.md §3).
//
// One call computes this rank's local component of the token-mean cross-entropy of one
// micro-batch,
//
//   L_ce[r, m] = sum over rows t of  w_t * (logsumexp(z_t) - z_t[y_t]) / D,
//
// and its gradient with respect to the logits, dL/dz_t = (w_t / D) * (softmax(z_t) - onehot(y_t)).
// `D` is the GLOBAL weight sum of the step (StepStats::global_ce_weight_sum, one SUM
// all-reduce over all ranks and micro-batches), a detached constant. Each rank
// back-propagates only its own component; summed over ranks and micro-batches they give
// the global loss and, after a SUM gradient reduction, its exact gradient (SEMANTICS.md §2).
//
//   std::vector<float> logits(n * v), grad(n * v);
//   TensorView z = *TensorView::Create(logits.data(), DType::kF32, {n, v});
//   TensorView dz = *TensorView::Create(grad.data(), DType::kF32, {n, v});
//   absl::StatusOr<CrossEntropyResult> r = CrossEntropyForwardBackward(
//       z, labels, /*token_weights=*/{}, stats.global_ce_weight_sum, dz);
//   // In place (dz aliases z; the logits are overwritten by their gradient):
//   r = CrossEntropyForwardBackward(z, labels, {}, stats.global_ce_weight_sum, z);
//
// Implementation: rows are split into blocks over `num_threads` threads. Each row is read
// from memory once: an online logsumexp over L1-sized tiles (a tile's max, the running sum
// rescaled once per tile when the max grows, then the tile's exp values) computes max and
// sum together and keeps the exp values in a per-thread fp32 buffer of two rows (2 * V * 4
// bytes, thread_local, reused), from which the gradient is written with one multiply per
// element, one tile at a time while the next row of the block is read.
// All arithmetic is fp32 (exp, softmax) with per-row sums and the loss in fp64, whatever
// the logits dtype (f32 or bf16). Results do not depend on the thread count.

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tensor.h"
#include "data/streams.h"
#include "losses/ce_options.h"

namespace gradsum::losses {

struct CrossEntropyOptions {
  // Labels equal to this are not valid: weight 0, zero gradient, rows never read.
  int64_t ignore_index = data::kIgnoreIndex;
  // Threads used for the row blocks (the caller's thread included). <= 1: single-threaded.
  int num_threads = 2;
  // The CE options of SEMANTICS.md §3.2 (losses/ce_options.h), each global in scope and
  // 0 = off. With all three 0 the kernel runs exactly as without them (same code, same bits).
  CeOptions ce;
};

struct CrossEntropyResult {
  // sum_t w_t * (CE_t + alpha_lse * lse_t^2) / D over this call's rows: the local component
  // L_ce[r, m] (§3, §3.2; without options sum_t w_t * CE_t / D).
  double local_loss = 0.0;
  // sum_t w_t * CE_t over this call's rows, undivided (for display or debugging). CE_t is the
  // smoothed CE of the capped logits when those options are on (§3.2).
  double local_weighted_ce_sum = 0.0;
  // sum_t w_t * lse_t^2, undivided: the output z-loss's display term is alpha_lse times it
  // over D. Computed only when an option of §3.2 is on (0 otherwise).
  double local_weighted_lse_sq_sum = 0.0;
  // sum_t w_t over the rows with a valid label: this call's share of D.
  double local_weight_sum = 0.0;
  // Rows whose label is not ignore_index.
  int64_t local_valid_tokens = 0;
};

// Computes the local CE component and writes dL/dlogits into `grad_logits`.
//
// logits:            [N, V] f32 or bf16 on the CPU, V >= 1.
// labels:            N labels; ignore_index or a class in [0, V).
// token_weights:     N weights w_t >= 0 (finite), or empty for token mode (w_t = 1 for
//                    valid rows). Rows with label == ignore_index have weight 0 whatever
//                    is given. ComputeTokenWeights() (token_weights.h) makes sample and
//                    square mode weights.
// global_weight_sum: D, finite and >= 0. D == 0 (every label of the step ignored) gives
//                    loss 0 and an exactly zero gradient, never NaN.
// grad_logits:       [N, V], same dtype as logits; may be the same memory as `logits`
//                    (in place). Fully overwritten on success: rows of weight 0 get zeros.
//
// Errors (nothing is written for the first four, which are checked before any work):
// - InvalidArgument: bad shapes or dtypes; a label outside [0, V) that is not
//   ignore_index (the message names the row and label); a negative or non-finite weight
//   or D; a bad option of §3.2 (label_smoothing outside [0, 1) or NaN, logit_softcap or
//   alpha_lse negative or non-finite), the message naming the option and its value.
// - FailedPrecondition: D smaller than this call's own weight sum (D must be the global
//   sum over ranks and micro-batches, not a local one).
// - InvalidArgument naming the first offending row: a row of non-zero weight that contains
//   NaN or +inf, is all -inf, or whose target logit is -inf (the loss would be NaN or
//   infinite). `grad_logits` is then partly written and must not be used. With
//   label_smoothing > 0 a -inf anywhere in such a row is an error too; with logit_softcap
//   > 0 only NaN is (the cap maps +-inf to +-c).
absl::StatusOr<CrossEntropyResult> CrossEntropyForwardBackward(
    const TensorView& logits, absl::Span<const int64_t> labels,
    absl::Span<const float> token_weights, double global_weight_sum, const TensorView& grad_logits,
    const CrossEntropyOptions& options = {});

// Forward only (no gradient written; `logits` is only read). Same checks and result.
absl::StatusOr<CrossEntropyResult> CrossEntropyForward(const TensorView& logits,
                                                       absl::Span<const int64_t> labels,
                                                       absl::Span<const float> token_weights,
                                                       double global_weight_sum,
                                                       const CrossEntropyOptions& options = {});

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_CROSS_ENTROPY_H_
