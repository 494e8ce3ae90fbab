#include "train/config_flags.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"  // WasPresentOnCommandLine: absl has no public API
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "train/config_flags_list.h"

// One flag per `(flag)` field of train/config.proto, in the generated list
// (train/config_flags_gen.cc). The list is expanded here, so that absl records this file as
// the flags' home and `moe_lm --help` lists them under train/config_flags.cc. Value flags
// are optional: unset (std::nullopt) unless given, so the defaults live only in config.proto
// and a flag never overrides a config file's value by its own default. Switches are false
// unless given; given, they set the field to true.
#define GRADSUM_DEFINE_CONFIG_FLAG(type, default_value, name, path, help) \
  ABSL_FLAG(type, name, default_value, help);
GRADSUM_TRAIN_CONFIG_FLAGS(GRADSUM_DEFINE_CONFIG_FLAG)
#undef GRADSUM_DEFINE_CONFIG_FLAG

// The one flag of no field.
ABSL_FLAG(std::string, config, "", "textproto TrainConfig file (train/config.proto)");

namespace gradsum::train {

const std::vector<FlagField>& OverridableFlags() {
#define GRADSUM_CONFIG_FLAG_ROW(type, default_value, name, path, help) {#name, path},
  static const auto* flags =
      new std::vector<FlagField>{GRADSUM_TRAIN_CONFIG_FLAGS(GRADSUM_CONFIG_FLAG_ROW)};
#undef GRADSUM_CONFIG_FLAG_ROW
  return *flags;
}

namespace {

// A value flag given with an empty value (`--data=`, typically an unset shell variable)
// parses as "not given", and the run would silently use the file's or the default value:
// it is an error naming the flag instead (issue 50, item 5).
absl::Status CheckNotGivenEmpty(absl::string_view flag, absl::string_view value) {
  if (!value.empty() || !absl::flags_internal::WasPresentOnCommandLine(flag)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "= was given an empty value; give it a value or leave it out"));
}

}  // namespace

absl::StatusOr<TrainConfig> ConfigFromFlags() {
  TrainConfig config;
  const std::string path = absl::GetFlag(FLAGS_config);
  GRADSUM_RETURN_IF_ERROR(CheckNotGivenEmpty("config", path));
  if (!path.empty()) {
    GRADSUM_ASSIGN_OR_RETURN(config, LoadConfigFile(path));
  }
  std::vector<FieldOverride> overrides;
  std::vector<std::string> override_flags;  // the flag of each override, for the messages
  for (const FlagField& ff : OverridableFlags()) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(ff.flag);
    if (flag == nullptr) {
      return absl::InternalError(absl::StrCat("flag --", ff.flag, " is not defined"));
    }
    // An unset optional flag prints as ""; a switch that was not given prints "false".
    const std::string value = flag->CurrentValue();
    const bool is_switch = flag->IsOfType<bool>();
    if (!is_switch) GRADSUM_RETURN_IF_ERROR(CheckNotGivenEmpty(ff.flag, value));
    if (is_switch ? value == "true" : !value.empty()) {
      overrides.push_back({ff.field_path, value});
      override_flags.push_back(ff.flag);
    }
  }
  GRADSUM_RETURN_IF_ERROR(ApplyOverrides(overrides, &config));
  if (absl::Status valid = ValidateConfig(config); !valid.ok()) {
    // ValidateConfig names the field by its path ("loss.logit_softcap=1e+300: ..."); when the
    // value came from a flag, the message starts with the flag the user typed.
    for (size_t i = 0; i < overrides.size(); ++i) {
      if (absl::StartsWith(valid.message(), absl::StrCat(overrides[i].path, "="))) {
        return absl::Status(valid.code(),
                            absl::StrCat("--", override_flags[i], ": ", valid.message()));
      }
    }
    return valid;
  }
  return ResolvedConfig(config);
}

}  // namespace gradsum::train
