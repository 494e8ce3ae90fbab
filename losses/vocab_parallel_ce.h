#ifndef GRADSUM_LOSSES_VOCAB_PARALLEL_CE_H_
#define GRADSUM_LOSSES_VOCAB_PARALLEL_CE_H_

// Vocab-parallel cross-entropy on the CPU (SEMANTICS.md §3.1): the logits' vocabulary
// dimension is split over a group of ranks that hold the same tokens (a tensor-parallel
// group), and the loss of each token is computed exactly without any rank holding its whole
// row. Megatron's tensor_parallel/cross_entropy.py and torchtitan's loss parallel, with
// label smoothing and the output z-loss kept exact under the split.
//
// Forward: one MAX all-reduce of the row maxes, one SUM all-reduce (coalesced) of the
// rescaled exp sums, the target logits and (with label smoothing) the row sums of the
// logits. Backward needs no collective: each rank writes the gradient of its own columns.
// With a gradient the rows may go in several exchanges of `rows_per_exchange` rows (two
// collectives each), so that each exchange's exp values are still in cache when its
// gradient is written; VocabParallelCrossEntropyResult::collectives says how many ran.
//
//   // Rank r of `tp` holds columns [v0, v0 + vr) of the [n, V] logits.
//   TensorView z = *TensorView::Create(shard.data(), DType::kF32, {n, vr});
//   TensorView dz = *TensorView::Create(grad.data(), DType::kF32, {n, vr});
//   absl::StatusOr<VocabParallelCrossEntropyResult> r = VocabParallelCrossEntropy(
//       tp, z, labels, /*vocab_start=*/v0, /*global_vocab=*/V, /*token_weights=*/{},
//       stats.global_ce_weight_sum, dz);
//   // r->local_loss is the same on every rank of `tp`: one component L_ce[r, m] for the
//   // tokens, not one per rank (count it from one rank of the group in a display).
//
// Every rank of the group must call it with the same N, labels, weights, D, V and
// options, and the shards must partition [0, V). All of that is checked without an extra
// collective (it rides on the MAX all-reduce), and a bad argument on ONE rank makes every
// rank return an error (its message agreed over the group) instead of leaving the others
// waiting in a collective.
//
// f32 logits only (bf16 shards, the logit softcap and the GPU are not done).

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/tensor.h"
#include "data/streams.h"

namespace gradsum::losses {

struct VocabParallelCrossEntropyOptions {
  // Labels equal to this are not valid: weight 0, zero gradient, rows never read.
  int64_t ignore_index = data::kIgnoreIndex;
  // eps in [0, 1): the target is (1 - eps) onehot + eps / V over the WHOLE vocabulary.
  double label_smoothing = 0.0;
  // >= 0: adds alpha_lse * logsumexp(z_t)^2 per token, with the CE's weights and D.
  double alpha_lse = 0.0;
  // Threads for the row blocks on this rank (the caller's included). <= 1: one thread.
  int num_threads = 1;
  // Rows per MAX + SUM exchange (the plain variant; the linear variant exchanges once per
  // chunk). 0 = automatic: forward only, all rows (two collectives per call); with a
  // gradient, rows whose shard takes about 2 MiB (at least 1), so that their exp values,
  // kept in the gradient buffer, are still in cache when the gradient is written. The
  // automatic value depends only on N, V and the group size, so every rank picks the same.
  int64_t rows_per_exchange = 0;
};

struct VocabParallelCrossEntropyResult {
  // sum_t w_t * (CE_t + alpha_lse * lse_t^2) / D over the call's rows. The same on every
  // rank of the group (each token's term is computed from the reduced row values).
  double local_loss = 0.0;
  // Its two parts: sum_t w_t * CE_t / D (the smoothed CE when eps > 0), and
  // alpha_lse * sum_t w_t * lse_t^2 / D.
  double local_ce_loss = 0.0;
  double local_z_loss = 0.0;
  // sum_t w_t * CE_t and sum_t w_t * lse_t^2, undivided (for display or debugging).
  double local_weighted_ce_sum = 0.0;
  double local_weighted_lse_sq_sum = 0.0;
  // sum_t w_t over rows with a valid label (this call's share of D), and their count.
  double local_weight_sum = 0.0;
  int64_t local_valid_tokens = 0;
  // Collectives this call made: 2 per exchange.
  int collectives = 0;
};

// Computes the loss and writes dL/dlogits of this rank's shard into `grad_logits_shard`.
//
// group:             the vocab group; every rank calls this collectively.
// logits_shard:      [N, Vr] f32 on the CPU, Vr >= 0: columns [vocab_start, vocab_start + Vr)
//                    of the [N, global_vocab] logits.
// labels:            N global class ids in [0, global_vocab), or ignore_index.
// token_weights:     N weights >= 0, or empty (token mode), as CrossEntropyForwardBackward.
// global_weight_sum: D, finite and >= 0 (StepStats::global_ce_weight_sum). D == 0 gives
//                    loss 0 and an exactly zero gradient.
// grad_logits_shard: [N, Vr] f32; may be the same memory as logits_shard (in place).
//                    Fully overwritten on success (rows of weight 0 get zeros).
//
// Errors, on EVERY rank of the group (InvalidArgument naming the value unless said):
// - this rank's own arguments: bad shapes or dtypes; a label outside [0, V) that is not
//   ignore_index; a negative or non-finite weight, D, label_smoothing or alpha_lse;
//   label_smoothing >= 1; rows_per_exchange < 0; a shard outside [0, V);
//   FailedPrecondition for D below the call's own weight sum (a local D). Every rank returns
//   the failing ranks' messages (AgreeOnStatus, collectives/status_agreement.h).
// - ranks that disagree on N (the MAX all-reduce's count check), V, D, ignore_index,
//   label_smoothing, alpha_lse, rows_per_exchange, the labels or the weights; shards that
//   do not partition [0, V).
// - a row of non-zero weight with NaN or +inf in any shard, -inf everywhere, a -inf target
//   logit, or (with label smoothing) a -inf anywhere. The gradient is then partly written.
// - a failing collective: its status, annotated.
absl::StatusOr<VocabParallelCrossEntropyResult> VocabParallelCrossEntropy(
    Communicator& group, const TensorView& logits_shard, absl::Span<const int64_t> labels,
    int64_t vocab_start, int64_t global_vocab, absl::Span<const float> token_weights,
    double global_weight_sum, const TensorView& grad_logits_shard,
    const VocabParallelCrossEntropyOptions& options = {});

// Forward only (`logits_shard` is only read; all rows in one exchange unless
// rows_per_exchange says otherwise). Same checks and result.
absl::StatusOr<VocabParallelCrossEntropyResult> VocabParallelCrossEntropyForward(
    Communicator& group, const TensorView& logits_shard, absl::Span<const int64_t> labels,
    int64_t vocab_start, int64_t global_vocab, absl::Span<const float> token_weights,
    double global_weight_sum, const VocabParallelCrossEntropyOptions& options = {});

struct VocabParallelLinearCrossEntropyOptions {
  int64_t ignore_index = data::kIgnoreIndex;
  double label_smoothing = 0.0;
  double alpha_lse = 0.0;
  // Threads for the GEMMs and the CE rows on this rank (the caller's included).
  int num_threads = 1;
  // Token rows per chunk (and per exchange). 0 = automatic: LinearCrossEntropy's rule
  // (linear_cross_entropy.h) for a shard of ceil(V / group size) columns, so every rank
  // picks the same.
  int64_t chunk_rows = 0;
};

struct VocabParallelLinearCrossEntropyResult {
  VocabParallelCrossEntropyResult ce;
  int64_t chunk_rows = 0;
  // The most bytes this call held at once: the [chunk, Vr] logits chunk and its row
  // scratch (the BLAS's packing buffers not included).
  int64_t peak_scratch_bytes = 0;
};

// The fused LM head + vocab-parallel CE: rank r holds Wo_r, the rows [vocab_start,
// vocab_start + Vr) of the [V, H] head (torch.nn.Linear(H, V)'s weight layout), and the
// replicated hidden states; the [N, Vr] logits shard is computed chunk by chunk and never
// held whole.
//
// hidden:              [N, H] f32, the same on every rank of the group.
// head_shard:          [Vr, H] f32.
// grad_hidden_partial: [N, H] f32, overwritten with THIS RANK'S PART of dL/dhidden,
//                      dlogits_r @ Wo_r. The gradient of hidden is the SUM of the parts
//                      over the group: the caller (the tensor-parallel layer that
//                      replicated hidden) all-reduces it; this function does not. May be the
//                      same memory as hidden.
// grad_head_shard:     [Vr, H] f32; dL/dWo_r is ADDED (accumulation over micro-batches).
//                      Exact for this slice: no reduction over the group.
// Errors: as VocabParallelCrossEntropy, plus bad shapes or overlapping buffers.
absl::StatusOr<VocabParallelLinearCrossEntropyResult> VocabParallelLinearCrossEntropy(
    Communicator& group, const TensorView& hidden, const TensorView& head_shard,
    absl::Span<const int64_t> labels, int64_t vocab_start, int64_t global_vocab,
    absl::Span<const float> token_weights, double global_weight_sum,
    const TensorView& grad_hidden_partial, const TensorView& grad_head_shard,
    const VocabParallelLinearCrossEntropyOptions& options = {});

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_VOCAB_PARALLEL_CE_H_
