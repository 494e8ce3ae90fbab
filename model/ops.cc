#include "model/ops.h"

#include "absl/strings/str_cat.h"

namespace gradsum::model {

absl::Status CheckStreamIndex(const MicroBatchInputs& in, int stream) {
  if (stream < 0 || stream > static_cast<int>(in.extra_streams.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("label stream ", stream, " is not in [0, ", in.extra_streams.size(), "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckStreamInputs(const MicroBatchInputs& in, int count) {
  if (static_cast<int>(in.extra_streams.size()) != count) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch: ", in.extra_streams.size(),
                                                   " extra label streams, the model has ", count));
  }
  for (int j = 0; j < count; ++j) {
    const MicroBatchInputs::Stream& s = in.extra_streams[j];
    if (static_cast<int64_t>(s.tokens.size()) != in.rows ||
        static_cast<int64_t>(s.labels.size()) != in.rows ||
        (!s.ce_weights.empty() && static_cast<int64_t>(s.ce_weights.size()) != in.rows)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "micro-batch: label stream ", j + 1, "'s tokens, labels or weights are not ", in.rows));
    }
  }
  return absl::OkStatus();
}

}  // namespace gradsum::model
