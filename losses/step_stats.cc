#include "losses/step_stats.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/status.h"

namespace gradsum::losses {
namespace {

constexpr double kTwoTo53 = 9007199254740992.0;  // f64 counts are exact below this

// Packed layout of the one step-statistics all-reduce.
enum Slot : int {
  kWeightSum = 0,   // D
  kRouted,          // N
  kValid,           // valid tokens
  kMicroBatches,    // G
  kMicroBatchesSq,  // G^2: with G's sum, tells whether every rank has the same G
  kFailedRanks,     // ranks whose input was rejected before the all-reduce
  kNumSlots,
};

absl::Status CheckMicroBatch(const MicroBatchTokens& mb, size_t m, const StepStatsOptions& opt) {
  const size_t t = mb.labels.size();
  if (!mb.input_mask.empty() && mb.input_mask.size() != t) {
    return absl::InvalidArgumentError(absl::StrCat("step stats: micro-batch ", m, " has ",
                                                   mb.input_mask.size(), " mask entries for ", t,
                                                   " labels"));
  }
  for (size_t i = 0; i < mb.input_mask.size(); ++i) {
    if (mb.input_mask[i] > 1) {
      return absl::InvalidArgumentError(absl::StrCat("step stats: micro-batch ", m, " input_mask[",
                                                     i, "] = ", static_cast<int>(mb.input_mask[i]),
                                                     " must be 0 or 1"));
    }
    if (mb.input_mask[i] == 0 && mb.labels[i] != opt.ignore_index) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step stats: micro-batch ", m, " token ", i, " is padding (input_mask 0) but has label ",
          mb.labels[i], "; padding must carry ignore_index ", opt.ignore_index,
          " (SEMANTICS.md §1)"));
    }
  }
  if (static_cast<int>(mb.extra_streams.size()) != opt.extra_streams) {
    return absl::InvalidArgumentError(
        absl::StrCat("step stats: micro-batch ", m, " holds ", mb.extra_streams.size(),
                     " extra label streams, not extra_streams ", opt.extra_streams));
  }
  for (size_t j = 0; j < mb.extra_streams.size(); ++j) {
    if (mb.extra_streams[j].labels.size() != t) {
      return absl::InvalidArgumentError(
          absl::StrCat("step stats: micro-batch ", m, " label stream ", j + 1, " has ",
                       mb.extra_streams[j].labels.size(), " labels for ", t, " tokens"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StepStats> ComputeStepStats(Communicator& world,
                                           absl::Span<const MicroBatchTokens> micro_batches,
                                           const StepStatsOptions& options) {
  StepStats stats;
  stats.mode = options.mode;
  stats.num_micro_batches = static_cast<int>(micro_batches.size());
  const int k = std::max(options.extra_streams, 0);
  stats.global_stream_weight_sums.assign(k, 0.0);
  stats.local_stream_weight_sums.assign(k, 0.0);
  stats.stream_token_weights.assign(k, {});
  // Local work first; a local error still joins the all-reduce (as a failed-rank count)
  // so that the other ranks fail with it instead of waiting for a rank that left.
  absl::Status local_status =
      micro_batches.empty()
          ? absl::InvalidArgumentError("step stats: no micro-batches (G must be >= 1)")
      : options.extra_streams < 0
          ? absl::InvalidArgumentError(
                absl::StrCat("step stats: extra_streams ", options.extra_streams, " must be >= 0"))
          : absl::OkStatus();
  for (size_t m = 0; m < micro_batches.size() && local_status.ok(); ++m) {
    const MicroBatchTokens& mb = micro_batches[m];
    local_status = CheckMicroBatch(mb, m, options);
    if (!local_status.ok()) break;
    absl::StatusOr<std::vector<float>> w = ComputeTokenWeights(
        mb.labels, mb.sample_ids, options.mode, options.ignore_index, mb.sample_sizes);
    if (!w.ok()) {
      local_status = Annotate(w.status(), absl::StrCat("step stats: micro-batch ", m));
      break;
    }
    for (size_t t = 0; t < mb.labels.size(); ++t) {
      stats.local_ce_weight_sum += static_cast<double>((*w)[t]);
      if (mb.labels[t] != options.ignore_index) ++stats.local_valid_tokens;
      if (mb.input_mask.empty() || mb.input_mask[t] == 1) ++stats.local_routed_tokens;
    }
    stats.token_weights.push_back(*std::move(w));
    // Label stream j: its own weights and D_j, summed token by token in micro-batch order
    // like D.
    for (int j = 0; j < k && local_status.ok(); ++j) {
      const LabelStreamTokens& stream = mb.extra_streams[j];
      const std::vector<int64_t> y(stream.labels.begin(), stream.labels.end());
      absl::StatusOr<std::vector<float>> wj = ComputeTokenWeights(
          y, mb.sample_ids, options.mode, options.ignore_index, stream.sample_sizes);
      if (!wj.ok()) {
        local_status = Annotate(
            wj.status(), absl::StrCat("step stats: micro-batch ", m, ", label stream ", j + 1));
        break;
      }
      for (float v : *wj) stats.local_stream_weight_sums[j] += static_cast<double>(v);
      stats.stream_token_weights[j].push_back(*std::move(wj));
    }
  }

  // D, N, ..., then D_1 .. D_k: one vector, so that the step has one statistics all-reduce.
  std::vector<double> packed(kNumSlots + k, 0.0);
  if (local_status.ok()) {
    const double g = static_cast<double>(stats.num_micro_batches);
    packed[kWeightSum] = stats.local_ce_weight_sum;
    packed[kRouted] = static_cast<double>(stats.local_routed_tokens);
    packed[kValid] = static_cast<double>(stats.local_valid_tokens);
    packed[kMicroBatches] = g;
    packed[kMicroBatchesSq] = g * g;
    for (int j = 0; j < k; ++j) packed[kNumSlots + j] = stats.local_stream_weight_sums[j];
  } else {
    packed[kFailedRanks] = 1.0;
  }
  // SEMANTICS §3/§4: one SUM all-reduce (fp64) of the step's statistics.
  absl::Status reduce =
      world.AllReduce(packed.data(), packed.data(), packed.size(), DType::kF64, ReduceOp::kSum);
  if (!reduce.ok()) return Annotate(reduce, "step stats all-reduce");
  if (!local_status.ok()) return local_status;
  if (packed[kFailedRanks] > 0.0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step stats: ", packed[kFailedRanks], " other rank(s) rejected their micro-batches"));
  }
  // Every rank holds the same G iff the variance over ranks is 0: W * sum(G^2) == sum(G)^2
  // (all terms are small integers, exact in f64).
  const double w = static_cast<double>(world.size());
  if (w * packed[kMicroBatchesSq] != packed[kMicroBatches] * packed[kMicroBatches]) {
    return absl::FailedPreconditionError(
        absl::StrCat("step stats: ranks disagree on the number of micro-batches G (this rank has ",
                     stats.num_micro_batches, ", the mean over ", world.size(), " ranks is ",
                     packed[kMicroBatches] / w, ")"));
  }
  if (packed[kRouted] >= kTwoTo53 || packed[kValid] >= kTwoTo53) {
    return absl::OutOfRangeError(absl::StrCat("step stats: global token counts (", packed[kRouted],
                                              " routed, ", packed[kValid],
                                              " valid) reach 2^53 and would not be exact"));
  }
  stats.global_ce_weight_sum = packed[kWeightSum];
  stats.global_routed_tokens = static_cast<int64_t>(packed[kRouted]);
  stats.global_valid_tokens = static_cast<int64_t>(packed[kValid]);
  for (int j = 0; j < k; ++j) stats.global_stream_weight_sums[j] = packed[kNumSlots + j];
  return stats;
}

absl::StatusOr<std::vector<int64_t>> CountLocalExpertAssignments(
    absl::Span<const int32_t> topk_indices, int top_k, absl::Span<const uint8_t> input_mask,
    int num_experts) {
  if (top_k < 1 || num_experts < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert counts: top_k ", top_k, " and num_experts ", num_experts, " must be >= 1"));
  }
  if (topk_indices.size() % static_cast<size_t>(top_k) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("expert counts: ", topk_indices.size(),
                                                   " indices is not a multiple of top_k ", top_k));
  }
  const size_t tokens = topk_indices.size() / static_cast<size_t>(top_k);
  if (!input_mask.empty() && input_mask.size() != tokens) {
    return absl::InvalidArgumentError(absl::StrCat("expert counts: ", input_mask.size(),
                                                   " mask entries for ", tokens, " tokens"));
  }
  std::vector<int64_t> counts(static_cast<size_t>(num_experts), 0);
  for (size_t t = 0; t < tokens; ++t) {
    if (!input_mask.empty()) {
      if (input_mask[t] > 1) {
        return absl::InvalidArgumentError(absl::StrCat("expert counts: input_mask[", t,
                                                       "] = ", static_cast<int>(input_mask[t]),
                                                       " must be 0 or 1"));
      }
      if (input_mask[t] == 0) continue;  // padding is not routed
    }
    for (int k = 0; k < top_k; ++k) {
      const int32_t e = topk_indices[t * top_k + k];
      if (e < 0 || e >= num_experts) {
        return absl::InvalidArgumentError(absl::StrCat("expert counts: token ", t, " slot ", k,
                                                       " routes to expert ", e, ", outside [0, ",
                                                       num_experts, ")"));
      }
      ++counts[e];
    }
  }
  return counts;
}

absl::StatusOr<ExpertCountReduction> ExpertCountReduction::Start(
    Communicator& world, absl::Span<const int64_t> local_counts, int top_k) {
  if (local_counts.empty()) {
    return absl::InvalidArgumentError("expert-count all-reduce: empty count vector");
  }
  if (top_k < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert-count all-reduce: top_k ", top_k, " must be >= 1"));
  }
  for (size_t e = 0; e < local_counts.size(); ++e) {
    if (local_counts[e] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("expert-count all-reduce: count[", e,
                                                     "] = ", local_counts[e], " is negative"));
    }
  }
  ExpertCountReduction r;
  r.counts_.assign(local_counts.begin(), local_counts.end());
  r.top_k_ = top_k;
  r.default_timeout_ = world.OperationWaitLimit();
  // SEMANTICS §5: one SUM all-reduce of the length-E count vector, async during forward.
  absl::StatusOr<std::unique_ptr<Work>> work = world.AllReduceAsync(
      r.counts_.data(), r.counts_.data(), r.counts_.size(), DType::kI64, ReduceOp::kSum);
  if (!work.ok()) return Annotate(work.status(), "expert-count all-reduce");
  r.work_ = *std::move(work);
  return r;
}

ExpertCountReduction::~ExpertCountReduction() {
  if (work_ != nullptr && !done_) work_->Wait(default_timeout_).IgnoreError();
}

absl::StatusOr<absl::Span<const int64_t>> ExpertCountReduction::Wait() {
  return Wait(default_timeout_);
}

absl::StatusOr<absl::Span<const int64_t>> ExpertCountReduction::Wait(absl::Duration timeout) {
  if (work_ == nullptr) {
    return absl::FailedPreconditionError("expert-count all-reduce: moved-from reduction");
  }
  if (!done_) {
    absl::Status s = work_->Wait(timeout);
    if (absl::IsDeadlineExceeded(s) && !work_->IsCompleted()) {
      return Annotate(s, "expert-count all-reduce");  // still in flight; may wait again
    }
    done_ = true;
    status_ = Annotate(s, "expert-count all-reduce");
    if (status_.ok()) {
      int64_t assignments = 0;
      for (int64_t c : counts_) assignments += c;
      if (assignments % top_k_ != 0) {
        status_ = absl::InvalidArgumentError(
            absl::StrCat("expert-count all-reduce: global counts sum to ", assignments,
                         ", not a multiple of top_k ", top_k_, " (do all ranks use the same K?)"));
      } else {
        global_routed_tokens_ = assignments / top_k_;
      }
    }
  }
  if (!status_.ok()) return status_;
  return absl::Span<const int64_t>(counts_);
}

bool ExpertCountReduction::IsCompleted() {
  return work_ != nullptr && (done_ || work_->IsCompleted());
}

}  // namespace gradsum::losses
