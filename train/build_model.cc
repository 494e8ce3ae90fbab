#include "train/build_model.h"

#include <algorithm>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "parallel/parallel_options.h"
#include "sharding/flat_param.h"

namespace gradsum::train {

absl::StatusOr<std::unique_ptr<MoeLm>> BuildModel(const TrainConfig& config,
                                                  const RankComms& comms) {
  const ParallelismConfig& parallelism = config.parallelism();
  MoeLmOptions options = ToMoeLmOptions(config);
  // The ranks of a thread run share the cores; the kernels use what is left per rank.
  options.num_threads = config.comm().backend() == TrainConfig::thread
                            ? std::max(1, AvailableCores() / comms.mesh->world_size())
                            : 1;
  MoeLmGroups groups{&comms.mesh->world(), &comms.mesh->ep_group(), &comms.mesh->edp_group(),
                     comms.sp_group, comms.cp_group};
  if (parallelism.sharding() == TrainConfig::hsdp) {
    if (comms.mesh->shard_size() == 0) {
      return absl::InvalidArgumentError(
          "parallelism.sharding=hsdp: the rank's mesh has no HSDP groups (MakeRankMesh builds "
          "them)");
    }
    groups.dense_shard = comms.mesh->dense_shard_group();
    groups.dense_replica = comms.mesh->dense_replica_group();
    groups.expert_shard = comms.mesh->expert_shard_group();
    groups.expert_replica = comms.mesh->expert_replica_group();
  }
  return comms.make_model ? comms.make_model(options, groups) : MoeLm::Create(options, groups);
}

}  // namespace gradsum::train
