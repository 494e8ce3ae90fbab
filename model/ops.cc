#include "model/ops.h"

#include "absl/strings/str_cat.h"

namespace gradsum::model {

absl::Status CheckMtpInputs(const MicroBatchInputs& in, int depth) {
  const int k = depth;
  if (static_cast<int>(in.mtp_tokens.size()) != k || static_cast<int>(in.mtp_labels.size()) != k ||
      static_cast<int>(in.mtp_ce_normaliser.size()) != k ||
      (!in.mtp_ce_weights.empty() && static_cast<int>(in.mtp_ce_weights.size()) != k)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "micro-batch: MTP inputs for ", in.mtp_tokens.size(), " depths, the model has ", k));
  }
  for (int j = 0; j < k; ++j) {
    if (static_cast<int64_t>(in.mtp_tokens[j].size()) != in.rows ||
        static_cast<int64_t>(in.mtp_labels[j].size()) != in.rows ||
        (!in.mtp_ce_weights.empty() && !in.mtp_ce_weights[j].empty() &&
         static_cast<int64_t>(in.mtp_ce_weights[j].size()) != in.rows)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "micro-batch: MTP depth ", j + 1, "'s tokens, labels or weights are not ", in.rows));
    }
  }
  return absl::OkStatus();
}

}  // namespace gradsum::model
