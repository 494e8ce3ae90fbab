#ifndef GRADSUM_TRAIN_DEBUGGING_H_
#define GRADSUM_TRAIN_DEBUGGING_H_

// What a run writes besides training: step 1's dump (debug.dump_dir) and the consolidated
// parameter files (checkpoint.export_path, checkpoint.init_from). Step 1's parity check
// against the single-process reference is train/parity.h's (linked only into moe_lm_parity
// and the tests).
//
// A dump directory holds, after step 1 of a fresh run:
//   batch.r{rank}.m{m}.safetensors   every rank's micro-batches: tokens, labels, mask,
//                                    sample_ids [batch, seq_len] and sequence_ids [batch]
//   weights.safetensors              the step's parameters (rank 0), MoeLmParamShapes
//   grads.safetensors                the SUM-reduced gradients, before clipping (rank 0)
//   losses.json                      DumpedLosses (train/metrics.proto), with the config;
//                                    64-bit integers as JSON numbers, like --metrics

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "data/loader.h"
#include "train/config.pb.h"
#include "train/metrics.pb.h"
#include "train/moe_lm.h"

namespace gradsum::train {

// Writes every parameter of `model` (MoeLmParamShapes names and shapes) from `params` as one
// fp32 safetensors file with metadata "step" (the dumps' weights, --export), and, unless
// `expert_bias` is empty, the model's expert bias (SEMANTICS.md §5.1: state, not a
// parameter) as tensors "layers.{l}.expert_bias" f32[E] after them. Without a bias the
// file is the same bytes as before the bias existed.
absl::Status WriteParamsFile(const std::string& path, const ModelConfig& model,
                             const NamedParams& params, int64_t step,
                             const model::ExpertBias& expert_bias = {});

// The name of layer l's expert bias tensor in such a file.
std::string ExpertBiasTensorName(int layer);

// Reads such a file (--init_from): exactly the parameters of `model`, f32, their shapes,
// finite. A missing, extra or misshapen tensor is InvalidArgument naming it; a tensor
// holding NaN or an infinity is DataLoss naming the file, the tensor, the count and the
// first such element; a path that is not a regular file is InvalidArgument (checked
// before any open); read errors name `path`. The expert bias tensors, when the file has
// them (every layer's, f32[E], finite; some layers only is InvalidArgument), go to
// `expert_bias` ([L][E]; left empty for a file without them); with `expert_bias` null
// they are refused as tensors that are not parameters.
absl::StatusOr<NamedParams> ReadParamsFile(const std::string& path, const ModelConfig& model,
                                           model::ExpertBias* expert_bias = nullptr);

// Writes step 1's dump into config.debug().dump_dir() (created if missing): this rank's
// `batches`; on rank 0 also `weights` (with the `expert_bias` step 1 routed with, unless
// empty), `grads` and `record`'s losses. Rank-local: the caller agrees on the outcome.
// Errors name the path.
absl::Status WriteDump(const TrainConfig& config, int rank, const NamedParams& weights,
                       const NamedParams& grads, const std::vector<data::MicroBatch>& batches,
                       const StepMetrics& record, const model::ExpertBias& expert_bias = {});

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_DEBUGGING_H_
