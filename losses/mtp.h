#ifndef GRADSUM_LOSSES_MTP_H_
#define GRADSUM_LOSSES_MTP_H_

// Multi-token prediction, the loss side (SEMANTICS.md §15): depth j of k predicts the token
// j + 1 ahead. Its labels are the main labels rolled by j inside each document, its
// normaliser D_j is a world SUM of its own, and the total is mtp_scale / k * sum_j L_j.
//
//   // Before the step's first forward, every rank, its G micro-batches (whole sequences):
//   std::vector<MtpMicroBatch> mbs = {{labels0, doc_ids0, seq_len}, ...};
//   GRADSUM_ASSIGN_OR_RETURN(MtpStats mtp, ComputeMtpStats(world, mbs, /*depth=*/2));
//   // Micro-batch m, depth j (1-based), with the depth's logits z_j [T, V]:
//   GRADSUM_ASSIGN_OR_RETURN(CrossEntropyResult r,
//       MtpCrossEntropyForwardBackward(z_j, mtp, j, m, /*mtp_scale=*/0.1, dz_j));
//   GRADSUM_RETURN_IF_ERROR(AddMtpToDisplay(display, r, j));  // term "mtp_<j>"
//
// Under sequence parallelism (§12) the labels are rolled on whole sequences before the
// split (MtpLabels), so a rank's slice needs no communication; pass each rank its slice
// with the whole document's sample sizes as for CE. A caller whose labels come already
// rolled (the loader's label streams, data/streams.h) passes them to ComputeStepStats as
// MicroBatchTokens::extra_streams instead, so every D_j joins the step's one statistics
// all-reduce (losses/step_stats.h); the trainer does so, and the model's MTP block
// (model/mtp.h) reads each depth's D_j and weights from that StepStats (no MtpStats).

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/tensor.h"
#include "data/streams.h"
#include "losses/cross_entropy.h"
#include "losses/display.h"
#include "losses/token_weights.h"

namespace gradsum::losses {

// Depth `depth`'s labels (depth >= 1) of `labels` (the main next-token labels of §3, whole
// sequences of `seq_len` tokens back to back): out[t] = labels[t + depth] when t + depth is
// in t's sequence and document (equal doc_ids), else ignore_index.
// InvalidArgument: depth < 1, seq_len < 1 or not dividing the length, doc_ids of another
// length.
absl::StatusOr<std::vector<int64_t>> MtpLabels(absl::Span<const int64_t> labels,
                                               absl::Span<const int64_t> doc_ids, int64_t seq_len,
                                               int depth,
                                               int64_t ignore_index = data::kIgnoreIndex);

// One micro-batch of this rank: whole sequences (before any SP split).
struct MtpMicroBatch {
  absl::Span<const int64_t> labels;   // the main labels (§3)
  absl::Span<const int64_t> doc_ids;  // equal id = same document
  int64_t seq_len = 0;
};

struct MtpStats {
  int depth = 0;                          // k
  std::vector<double> global_weight_sum;  // [k]: D_j (index j - 1), world SUMs, detached
  std::vector<double> local_weight_sum;   // [k]: this rank's shares
  // [k][m]: depth j's labels and CE weights of micro-batch m.
  std::vector<std::vector<std::vector<int64_t>>> labels;
  std::vector<std::vector<std::vector<float>>> token_weights;
};

// Rolls every micro-batch's labels for depths 1..depth, computes their CE weights (`mode`,
// §3) and runs ONE SUM all-reduce of the k local weight sums over `world`. Collective.
// InvalidArgument (on the rank whose input is bad; the all-reduce still runs, so every rank
// returns): depth < 1, no micro-batch, bad labels / doc ids; OutOfRange if a D_j reaches
// 2^53. FailedPrecondition on the other ranks when one rank's input was bad.
absl::StatusOr<MtpStats> ComputeMtpStats(Communicator& world,
                                         absl::Span<const MtpMicroBatch> micro_batches, int depth,
                                         CeWeightMode mode = CeWeightMode::kToken,
                                         int64_t ignore_index = data::kIgnoreIndex);

// Depth `depth_index`'s (1-based) local component of micro-batch `micro_index`:
// mtp_scale / k * sum_t w_j[t] CE_t / D_j, and its gradient into `grad_logits` (the CE
// kernel run with the normaliser D_j * k / mtp_scale). `logits` [T, V] are the depth's
// logits over this micro-batch's tokens. InvalidArgument: an index out of range, mtp_scale
// not in (0, k], logits of another row count; and the CE kernel's errors.
absl::StatusOr<CrossEntropyResult> MtpCrossEntropyForwardBackward(
    const TensorView& logits, const MtpStats& stats, int depth_index, int micro_index,
    double mtp_scale, const TensorView& grad_logits, const CrossEntropyOptions& options = {});

// Adds the result's local_loss as backward term "mtp_<depth_index>" (register it first).
absl::Status AddMtpToDisplay(StepDisplay& display, const CrossEntropyResult& r, int depth_index);

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_MTP_H_
