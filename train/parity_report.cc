#include "train/parity_report.h"

#include "absl/strings/str_format.h"

namespace gradsum::train {

std::string ParityReport::ToString() const {
  std::string out;
  for (const ParamParity& p : params) {
    absl::StrAppendFormat(&out, "parity %-28s norm_ratio %.9f  max_rel_err %.3e\n", p.name,
                          p.norm_ratio, p.max_rel_err);
  }
  for (const LossParity& l : losses) {
    absl::StrAppendFormat(&out, "parity loss %-5s %.10g vs reference %.10g  rel_err %.3e\n", l.name,
                          l.value, l.reference, l.rel_err);
  }
  absl::StrAppendFormat(&out, "parity %s: worst error %.3e, tolerance %.1e\n",
                        ok ? "PASSED" : "FAILED", worst, tolerance);
  return out;
}

}  // namespace gradsum::train
