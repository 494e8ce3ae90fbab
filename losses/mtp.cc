#include "losses/mtp.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum::losses {

absl::StatusOr<std::vector<int64_t>> MtpLabels(absl::Span<const int64_t> labels,
                                               absl::Span<const int64_t> doc_ids, int64_t seq_len,
                                               int depth, int64_t ignore_index) {
  const int64_t n = static_cast<int64_t>(labels.size());
  if (depth < 1) {
    return absl::InvalidArgumentError(absl::StrCat("MTP depth must be >= 1, got ", depth));
  }
  if (seq_len < 1 || n % seq_len != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MTP labels: seq_len ", seq_len, " does not divide the ", n, " labels"));
  }
  if (static_cast<int64_t>(doc_ids.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("MTP labels: ", doc_ids.size(), " doc ids for ", n, " labels"));
  }
  std::vector<int64_t> out(n, ignore_index);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t u = t + depth;
    if (u / seq_len == t / seq_len && u < n && doc_ids[u] == doc_ids[t]) out[t] = labels[u];
  }
  return out;
}

absl::StatusOr<MtpStats> ComputeMtpStats(Communicator& world,
                                         absl::Span<const MtpMicroBatch> micro_batches, int depth,
                                         CeWeightMode mode, int64_t ignore_index) {
  MtpStats stats;
  stats.depth = depth;
  absl::Status local =
      depth < 1 ? absl::InvalidArgumentError(absl::StrCat("MTP depth must be >= 1, got ", depth))
      : micro_batches.empty() ? absl::InvalidArgumentError("MTP stats: no micro-batches (G >= 1)")
                              : absl::OkStatus();
  const int k = std::max(depth, 0);
  stats.global_weight_sum.assign(k, 0.0);
  stats.local_weight_sum.assign(k, 0.0);
  stats.labels.assign(k, {});
  stats.token_weights.assign(k, {});
  std::vector<double> packed(2 * k + 1, 0.0);  // weight sums, valid counts, failed ranks
  for (int j = 1; j <= k && local.ok(); ++j) {
    for (size_t m = 0; m < micro_batches.size() && local.ok(); ++m) {
      const MtpMicroBatch& mb = micro_batches[m];
      absl::StatusOr<std::vector<int64_t>> y =
          MtpLabels(mb.labels, mb.doc_ids, mb.seq_len, j, ignore_index);
      absl::StatusOr<std::vector<float>> w =
          y.ok() ? ComputeTokenWeights(*y, mb.doc_ids, mode, ignore_index) : y.status();
      if (!w.ok()) {
        local = Annotate(w.status(), absl::StrCat("MTP stats: micro-batch ", m, ", depth ", j));
        break;
      }
      for (size_t t = 0; t < y->size(); ++t) {
        packed[j - 1] += static_cast<double>((*w)[t]);
        if ((*y)[t] != ignore_index) packed[k + j - 1] += 1.0;
      }
      stats.labels[j - 1].push_back(*std::move(y));
      stats.token_weights[j - 1].push_back(*std::move(w));
    }
  }
  if (!local.ok()) {
    std::fill(packed.begin(), packed.end(), 0.0);
    packed[2 * k] = 1.0;
  }
  for (int j = 0; j < k; ++j) stats.local_weight_sum[j] = packed[j];
  // SEMANTICS §15: the k normalisers in ONE SUM all-reduce (fp64). Every rank calls it, a
  // rank with bad input too, so that nobody waits.
  absl::Status reduce =
      world.AllReduce(packed.data(), packed.data(), packed.size(), DType::kF64, ReduceOp::kSum);
  if (!reduce.ok()) return Annotate(reduce, "MTP stats all-reduce");
  if (!local.ok()) return local;
  if (packed[2 * k] > 0.0) {
    return absl::FailedPreconditionError(
        absl::StrCat("MTP stats: ", packed[2 * k], " other rank(s) rejected their micro-batches"));
  }
  constexpr double kTwoTo53 = 9007199254740992.0;
  for (int j = 0; j < k; ++j) {
    if (packed[k + j] >= kTwoTo53) {
      return absl::OutOfRangeError(absl::StrCat("MTP stats: depth ", j + 1, "'s ", packed[k + j],
                                                " valid labels reach 2^53 and would not be exact"));
    }
    stats.global_weight_sum[j] = packed[j];
  }
  return stats;
}

absl::StatusOr<CrossEntropyResult> MtpCrossEntropyForwardBackward(
    const TensorView& logits, const MtpStats& stats, int depth_index, int micro_index,
    double mtp_scale, const TensorView& grad_logits, const CrossEntropyOptions& options) {
  const int k = stats.depth;
  if (depth_index < 1 || depth_index > k) {
    return absl::InvalidArgumentError(
        absl::StrCat("MTP depth index ", depth_index, " is not in [1, ", k, "]"));
  }
  const auto& labels = stats.labels[depth_index - 1];
  if (micro_index < 0 || micro_index >= static_cast<int>(labels.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("MTP micro-batch index ", micro_index, " is not in [0, ", labels.size(), ")"));
  }
  if (!(mtp_scale > 0.0 && mtp_scale <= k)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mtp_scale ", mtp_scale, " must be in (0, k = ", k, "]"));
  }
  // One division: w CE / (D_j k / mtp_scale) = mtp_scale / k * w CE / D_j. D_j = 0 stays 0
  // (loss 0, zero gradient), and the kernel's D >= local check still holds (k / s >= 1).
  const double d = stats.global_weight_sum[depth_index - 1] * k / mtp_scale;
  return CrossEntropyForwardBackward(logits, labels[micro_index],
                                     stats.token_weights[depth_index - 1][micro_index], d,
                                     grad_logits, options);
}

absl::Status AddMtpToDisplay(StepDisplay& display, const CrossEntropyResult& r, int depth_index) {
  return display.AddBackwardTerm(absl::StrCat("mtp_", depth_index), r.local_loss);
}

}  // namespace gradsum::losses
