#ifndef GRADSUM_TRAIN_CONFIG_FLAGS_H_
#define GRADSUM_TRAIN_CONFIG_FLAGS_H_

// The command-line face of train/config.h: `--config=FILE` plus one absl flag per
// overridable field. A flag overrides its field only when given on the command line
// (value flags are std::optional, unset by default), so a config file's value survives.
// --resume, --overwrite_checkpoints, --parity_check and --reproducible are switches (given: true);
// --norm_topk_prob takes a value (--norm_topk_prob=false).
//
//   int main(int argc, char** argv) {
//     absl::ParseCommandLine(argc, argv);
//     absl::StatusOr<TrainConfig> config = ConfigFromFlags();  // loads, overrides, validates
//
// Flags: --config --world --ep --grad_acc --steps --backend --sharding --reduce_dtype
// --compute_dtype --seed --data --seq_len --max_doc_len --micro_batch --dump_dir --metrics
// --checkpoint_dir --checkpoint_every --resume --overwrite_checkpoints --export --init_from
// --parity_check --reproducible --alpha_b
// --alpha_z --lr --warmup_steps --lr_decay --min_lr --decay_steps --weight_decay --grad_clip
// and the model sizes --vocab (V) --dim (D)
// --layers (L) --experts (E) --top_k (K) --expert_dim (H) --norm_topk_prob --router_scale
// --timeout_s.

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
// ValidateConfig (the message names the field and the value).
absl::StatusOr<TrainConfig> ConfigFromFlags();

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_CONFIG_FLAGS_H_
