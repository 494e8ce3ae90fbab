#ifndef GRADSUM_TRAIN_CONFIG_FLAGS_H_
#define GRADSUM_TRAIN_CONFIG_FLAGS_H_

// The command-line face of train/config.h: `--config=FILE` plus one absl flag per
// overridable field. Each flag is declared once, in train/config.proto, by its field's
// `(flag)` and `(help)` options; train/config_flags_gen.cc generates the flag definitions
// and the table below from them, and the README's flag table (see README.md, "Flags").
//
// A flag overrides its field only when given on the command line (value flags are
// std::optional, unset by default), so a config file's value survives. Fields marked
// `(switch_flag)` (--resume, --overwrite_checkpoints, --parity_check, --reproducible ...)
// take no value (given: true); other bool flags take one (--norm_topk_prob=false).
//
//   int main(int argc, char** argv) {
//     absl::ParseCommandLine(argc, argv);
//     absl::StatusOr<TrainConfig> config = ConfigFromFlags();  // loads, overrides, validates

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "train/config.h"
#include "train/config.pb.h"

namespace gradsum::train {

// The (flag name, config field path) pairs that ConfigFromFlags honours.
struct FlagField {
  const char* flag;
  const char* field_path;
};
const std::vector<FlagField>& OverridableFlags();

// Reads --config (or starts from defaults when it is empty), applies every flag that was
// given on the command line, validates. Errors as in LoadConfigFile, ApplyOverrides and
// ValidateConfig (the message names the field and the value); a validation error about a
// value a flag gave starts with that flag ("--logit_softcap: loss.logit_softcap=1e+300: ...").
absl::StatusOr<TrainConfig> ConfigFromFlags();

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_CONFIG_FLAGS_H_
