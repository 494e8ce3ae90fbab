#include "train/build_model.h"

#include <algorithm>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "parallel/parallel_options.h"
#include "sharding/flat_param.h"

namespace gradsum::train {
namespace {

// The config's choices as the types of the code that implements them.
DType ToDType(TrainConfig::FloatDType d) {
  return d == TrainConfig::bf16 ? DType::kBF16 : DType::kF32;
}
ShardingMode ToShardingMode(TrainConfig::Sharding s) {
  // hsdp is sharded mode with replica groups (SEMANTICS.md §7: the mesh's HSDP groups).
  return s == TrainConfig::replicated ? ShardingMode::kReplicated : ShardingMode::kSharded;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MoeLm>> BuildModel(const TrainConfig& config,
                                                  const RankComms& comms) {
  const ParallelismConfig& parallelism = config.parallelism();
  MoeLmOptions options;
  options.model = config.model();
  options.alpha_b = config.loss().alpha_b();
  options.alpha_z = config.loss().alpha_z();
  options.label_smoothing = config.loss().label_smoothing();
  options.logit_softcap = config.loss().logit_softcap();
  options.alpha_lse = config.loss().alpha_lse();
  options.mtp_scale = config.loss().mtp_scale();
  options.expert_bias_speed = config.loss().expert_bias_speed();
  parallel::ParallelOptions& p = options.parallel;
  p.sharding = ToShardingMode(parallelism.sharding());
  p.compute_dtype = ToDType(config.precision().compute_dtype());
  // The gradient precision, chosen once (core/grad_precision.h); the config's validation
  // refused reproducible with a bf16 reduce dtype.
  const PrecisionConfig& precision = config.precision();
  p.precision = precision.reproducible()                        ? GradPrecision::kExact
                : precision.reduce_dtype() == TrainConfig::bf16 ? GradPrecision::kBF16Wire
                                                                : GradPrecision::kF32;
  options.recompute = parallelism.recompute() == ParallelismConfig::full ? model::Recompute::kFull
                      : parallelism.recompute() == ParallelismConfig::selective
                          ? model::Recompute::kSelective
                          : model::Recompute::kNone;
  p.layers_per_unit = parallelism.layers_per_unit();
  p.reshard_after_forward = parallelism.reshard_after_forward();
  p.reduce_every_micro_batch = parallelism.reduce_every_micro_batch();
  p.bucket_cap_bytes = static_cast<size_t>(config.comm().bucket_cap_mb() * (1 << 20));
  p.first_bucket_cap_bytes = static_cast<size_t>(config.comm().first_bucket_mb() * (1 << 20));
  // The ranks of a thread run share the cores; the kernels use what is left per rank.
  options.num_threads = config.comm().backend() == TrainConfig::thread
                            ? std::max(1, AvailableCores() / comms.mesh->world_size())
                            : 1;
  p.repro_block = config.precision().repro_block();
  if (parallelism.sharding() == TrainConfig::hsdp && !comms.mesh->hsdp()) {
    return absl::InvalidArgumentError(
        "parallelism.sharding=hsdp: the rank's mesh has no HSDP groups (MakeRankMesh builds "
        "them)");
  }
  return comms.make_model ? comms.make_model(options, *comms.mesh)
                          : MoeLm::Create(options, *comms.mesh);
}

}  // namespace gradsum::train
