#include "train/build_model.h"

#include <algorithm>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "parallel/flat_param.h"
#include "parallel/parallel_options.h"

namespace gradsum::train {

absl::StatusOr<std::unique_ptr<MoeLm>> BuildModel(const TrainConfig& config,
                                                  const RankComms& comms) {
  const ParallelismConfig& parallelism = config.parallelism();
  MoeLmOptions options = ToMoeLmOptions(config);
  // The ranks of a thread run share the cores; the kernels use what is left per rank.
  options.num_threads = config.comm().backend() == TrainConfig::thread
                            ? std::max(1, AvailableCores() / comms.mesh->world_size())
                            : 1;
  if (parallelism.sharding() == TrainConfig::hsdp && !comms.mesh->hsdp()) {
    return absl::InvalidArgumentError(
        "parallelism.sharding=hsdp: the rank's mesh has no HSDP groups (MakeRankMesh builds "
        "them)");
  }
  return comms.make_model ? comms.make_model(options, *comms.mesh)
                          : MoeLm::Create(options, *comms.mesh);
}

}  // namespace gradsum::train
