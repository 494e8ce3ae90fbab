#ifndef GRADSUM_LOSSES_STEP_STATS_H_
#define GRADSUM_LOSSES_STEP_STATS_H_

// Global, detached statistics of one optimizer step (SEMANTICS.md §3, §4, §5).
//
// Before the step's first forward, each rank passes all G of its micro-batches to
// ComputeStepStats(); one SUM all-reduce (a single packed f64 call) gives every rank
//   D = sum of CE weights w_t over all ranks and micro-batches (§3),
//   N = number of routed tokens over all ranks and micro-batches (§4),
// plus the per-token weights w_t the CE kernels take. Counts travel as f64, which is
// exact below 2^53 (checked).
//
//   std::vector<MicroBatchTokens> mbs = {{labels0, sample_ids0, mask0}, {labels1, ...}};
//   GRADSUM_ASSIGN_OR_RETURN(StepStats stats, ComputeStepStats(world, mbs,
//   {CeWeightMode::kSample}));
//   // micro-batch m: CrossEntropyForwardBackward(z, labels_m, stats.token_weights[m],
//   //                                           stats.global_ce_weight_sum, dz);
//
// A micro-batch may carry label streams beyond the main one (data/streams.h: stream j
// predicts the token j + 1 ahead; MicroBatchTokens::extra_streams, stream j at index j - 1,
// StepStatsOptions::extra_streams of them), and the same all-reduce gives every stream's
// normaliser D_j beside D.
//
// During forward, per micro-batch and MoE layer, the global expert-count vector c[l, m, :]
// (§5) is all-reduced asynchronously: start it right after the router, wait before the
// balancing loss needs it.
//
//   GRADSUM_ASSIGN_OR_RETURN(std::vector<int64_t> local,
//       CountLocalExpertAssignments(topk_idx, /*top_k=*/2, mask, /*num_experts=*/E));
//   GRADSUM_ASSIGN_OR_RETURN(ExpertCountReduction counts, ExpertCountReduction::Start(world, local,
//   /*top_k=*/2));
//   ... experts run ...
//   GRADSUM_ASSIGN_OR_RETURN(absl::Span<const int64_t> c, counts.Wait());
//   int64_t n_lm = counts.global_routed_tokens();     // sum_e c_e / K

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "data/streams.h"
#include "losses/token_weights.h"

namespace gradsum::losses {

// A further label stream of a micro-batch: multi-token prediction's depth j (SEMANTICS.md
// §15.1, the loader's stream j, data/streams.h), whose normaliser D_j is a world sum of its
// own. Views; the caller owns the memory.
struct LabelStreamTokens {
  // T labels (int32, as the loader gives them); ignore_index where t + j + 1 leaves t's
  // document.
  absl::Span<const int32_t> labels;
  // Optional, T entries: each token's depth-j sample size (its whole document's valid depth-j
  // labels). Empty: counted here from the micro-batch's sample_ids.
  absl::Span<const int64_t> sample_sizes;
};

// The tokens of one micro-batch on this rank (views; the caller owns the memory).
struct MicroBatchTokens {
  // T labels; ignore_index marks a token that is not valid for CE.
  absl::Span<const int64_t> labels;
  // T sample ids (equal id = same sample). Required for kSample/kSquare, else may be empty.
  absl::Span<const int64_t> sample_ids;
  // T entries, 1 = routed, 0 = padding (SEMANTICS §1). Empty = every token is routed.
  absl::Span<const uint8_t> input_mask;
  // Optional, T entries: each token's sample size n_s (its whole document's valid count,
  // also where the document spans the ranks of a sequence-parallel group, §12). Empty: n_s
  // is counted here from sample_ids.
  absl::Span<const int64_t> sample_sizes;
  // Label streams 1 .. StepStatsOptions::extra_streams, stream j at index j - 1, weighted
  // with this micro-batch's sample_ids in the options' mode.
  std::vector<LabelStreamTokens> extra_streams;
};

struct StepStatsOptions {
  CeWeightMode mode = CeWeightMode::kToken;
  int64_t ignore_index = data::kIgnoreIndex;
  // The label streams beyond the main one that each micro-batch holds (0: none). The same on
  // every rank, since it sizes the all-reduce.
  int extra_streams = 0;
};

struct StepStats {
  CeWeightMode mode = CeWeightMode::kToken;
  // G: micro-batches per step (the same on every rank; checked).
  int num_micro_batches = 0;
  // D of §3: sum of w_t over all ranks and micro-batches. 0 when every label is ignored.
  double global_ce_weight_sum = 0.0;
  // N of §4: routed tokens over all ranks and micro-batches.
  int64_t global_routed_tokens = 0;
  // Valid (non-ignored) tokens over all ranks and micro-batches (for display).
  int64_t global_valid_tokens = 0;
  // This rank's shares of the three sums above.
  double local_ce_weight_sum = 0.0;
  int64_t local_routed_tokens = 0;
  int64_t local_valid_tokens = 0;
  // token_weights[m][t] = w_t of token t of micro-batch m (fp32; D sums exactly these).
  std::vector<std::vector<float>> token_weights;
  // Per extra label stream j at index j - 1: D_j over all ranks and micro-batches, this
  // rank's share, and stream_token_weights[j - 1][m][t], the weights D_j sums.
  std::vector<double> global_stream_weight_sums;
  std::vector<double> local_stream_weight_sums;
  std::vector<std::vector<std::vector<float>>> stream_token_weights;
};

// Computes this rank's weights and counts and runs ONE SUM all-reduce over `world` (a
// packed f64 vector). Collective: every rank of `world` must call it.
//
// Errors, returned on every rank together (the all-reduce still runs, so no rank is left
// waiting): InvalidArgument on the rank whose input is bad (no micro-batches; label/mask/
// sample-id sizes differ; a mask value other than 0/1; a padding token whose label is not
// ignore_index; sample ids missing for sample/square mode; extra_streams < 0 or a micro-batch
// with another number of extra streams, or a stream of another length), FailedPrecondition on the
// others; FailedPrecondition on all ranks if they disagree on G; OutOfRange if a global
// count reaches 2^53; the communicator's error if the all-reduce fails.
absl::StatusOr<StepStats> ComputeStepStats(Communicator& world,
                                           absl::Span<const MicroBatchTokens> micro_batches,
                                           const StepStatsOptions& options = {});

// Counts (token, slot) assignments per expert on this rank for one layer and micro-batch.
// topk_indices: T * top_k expert ids, row-major ([T, K]); input_mask: T entries (0 rows are
// padding and not counted) or empty (all routed). Errors: InvalidArgument for sizes that do
// not match, top_k < 1, num_experts < 1, mask values other than 0/1, an expert id outside
// [0, num_experts) in a routed row (naming token, slot and id).
absl::StatusOr<std::vector<int64_t>> CountLocalExpertAssignments(
    absl::Span<const int32_t> topk_indices, int top_k, absl::Span<const uint8_t> input_mask,
    int num_experts);

// The asynchronous SUM all-reduce of one layer's expert-count vector for one micro-batch
// (the c[l, m, :] of §5). Owns its buffer; move-only. Destroying an unfinished reduction
// waits for it (the collective's buffer must outlive it).
class ExpertCountReduction {
 public:
  // Issues the all-reduce of `local_counts` (E entries >= 0) over `world` (all ranks) and
  // returns at once. Collective, in issue order with the other collectives on `world`.
  // Errors: InvalidArgument for an empty vector or a negative count; the communicator's.
  static absl::StatusOr<ExpertCountReduction> Start(Communicator& world,
                                                    absl::Span<const int64_t> local_counts,
                                                    int top_k);

  ExpertCountReduction(ExpertCountReduction&&) = default;
  // Not assignable: assigning over an in-flight reduction would free its buffer.
  ExpertCountReduction& operator=(ExpertCountReduction&&) = delete;
  ~ExpertCountReduction();

  // Waits for the all-reduce (default: the communicator's timeout plus a margin) and
  // returns c, valid while this object lives. Later calls return the same result.
  // Errors: the collective's (DeadlineExceeded if a rank never arrives); InvalidArgument
  // if the global sum is not a multiple of top_k (ranks used different K).
  absl::StatusOr<absl::Span<const int64_t>> Wait();
  absl::StatusOr<absl::Span<const int64_t>> Wait(absl::Duration timeout);

  // True once the all-reduce has finished (then Wait() does not block).
  bool IsCompleted();

  // N[l, m] = sum_e c_e / K; only after a successful Wait() (else -1).
  int64_t global_routed_tokens() const { return global_routed_tokens_; }

 private:
  ExpertCountReduction() = default;

  std::vector<int64_t> counts_;  // local counts in, global counts out (in place)
  std::unique_ptr<Work> work_;
  absl::Duration default_timeout_ = absl::InfiniteDuration();
  int top_k_ = 1;
  bool done_ = false;
  absl::Status status_;
  int64_t global_routed_tokens_ = -1;
};

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_STEP_STATS_H_
