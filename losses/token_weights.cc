#include "losses/token_weights.h"

#include <cmath>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace gradsum::losses {

const char* CeWeightModeName(CeWeightMode mode) {
  switch (mode) {
    case CeWeightMode::kToken:
      return "token";
    case CeWeightMode::kSample:
      return "sample";
    case CeWeightMode::kSquare:
      return "square";
  }
  return "invalid";
}

absl::StatusOr<std::vector<float>> ComputeTokenWeights(absl::Span<const int64_t> labels,
                                                       absl::Span<const int64_t> sample_ids,
                                                       CeWeightMode mode, int64_t ignore_index,
                                                       absl::Span<const int64_t> sample_sizes) {
  std::vector<float> weights(labels.size(), 0.0f);
  if (mode == CeWeightMode::kToken) {
    for (size_t t = 0; t < labels.size(); ++t) weights[t] = labels[t] == ignore_index ? 0.f : 1.f;
    return weights;
  }
  if (mode != CeWeightMode::kSample && mode != CeWeightMode::kSquare) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown cross-entropy weight mode ", static_cast<int>(mode)));
  }
  if (!sample_sizes.empty()) {
    if (sample_sizes.size() != labels.size()) {
      return absl::InvalidArgumentError(absl::StrCat(CeWeightModeName(mode), " mode: got ",
                                                     sample_sizes.size(), " sample sizes for ",
                                                     labels.size(), " labels"));
    }
    for (size_t t = 0; t < labels.size(); ++t) {
      if (labels[t] == ignore_index) continue;
      if (sample_sizes[t] < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sample size ", sample_sizes[t], " of the valid token at position ", t, " is below 1"));
      }
      const double n_s = static_cast<double>(sample_sizes[t]);
      weights[t] =
          static_cast<float>(mode == CeWeightMode::kSample ? 1.0 / n_s : 1.0 / std::sqrt(n_s));
    }
    return weights;
  }
  if (sample_ids.size() != labels.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(CeWeightModeName(mode), " mode needs one sample id per token: got ",
                     sample_ids.size(), " sample ids for ", labels.size(), " labels"));
  }
  absl::flat_hash_map<int64_t, int64_t> valid_per_sample;  // n_s
  for (size_t t = 0; t < labels.size(); ++t) {
    if (labels[t] != ignore_index) ++valid_per_sample[sample_ids[t]];
  }
  for (size_t t = 0; t < labels.size(); ++t) {
    if (labels[t] == ignore_index) continue;
    const double n_s = static_cast<double>(valid_per_sample[sample_ids[t]]);
    weights[t] =
        static_cast<float>(mode == CeWeightMode::kSample ? 1.0 / n_s : 1.0 / std::sqrt(n_s));
  }
  return weights;
}

}  // namespace gradsum::losses
