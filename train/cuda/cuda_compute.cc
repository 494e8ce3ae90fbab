#include "train/cuda/cuda_compute.h"

#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "collectives/device_stream.h"
#include "core/cuda/compute_context.h"
#include "core/status.h"
#include "model/cuda/cuda_ops.h"
#include "parallel/cuda/device_unit_store.h"

namespace gradsum::train {

absl::StatusOr<ComputeDevice> MakeCudaCompute(const MoeLmGroups& host,
                                              const MoeLmDeviceGroups& device) {
  if (device.world == nullptr || device.ep_group == nullptr || device.edp_group == nullptr) {
    return absl::InvalidArgumentError(
        "the GPU model needs the NCCL world, EP and EDP communicators");
  }
  const std::pair<Communicator*, Communicator*> pairs[] = {{host.world, device.world},
                                                           {host.ep_group, device.ep_group},
                                                           {host.edp_group, device.edp_group}};
  const char* names[] = {"world", "ep_group", "edp_group"};
  for (int i = 0; i < 3; ++i) {
    auto [h, d] = pairs[i];
    if (h == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("the GPU model needs the host ", names[i]));
    }
    if (d->device_stream() == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPU model: the ", names[i], " device group is a ", d->backend(),
                       " communicator without a device stream; it must be NCCL"));
    }
    if (h->rank() != d->rank() || h->size() != d->size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPU model: NCCL ", names[i], " is rank ", d->rank(), " of ", d->size(),
                       " but the host ", names[i], " is rank ", h->rank(), " of ", h->size()));
    }
  }
  const int gpu = device.world->device_stream()->device();
  if (device.ep_group->device_stream()->device() != gpu ||
      device.edp_group->device_stream()->device() != gpu) {
    return absl::InvalidArgumentError("GPU model: the NCCL communicators are on different GPUs");
  }
  GRADSUM_ASSIGN_OR_RETURN(std::shared_ptr<cuda::ComputeContext> ctx,
                           cuda::ComputeContext::Create(gpu));
  ComputeDevice out;
  // HSDP: the NCCL shard groups beside the host ones (same ranks, same order).
  if ((host.dense_shard == nullptr) != (device.dense_shard == nullptr) ||
      (host.expert_shard == nullptr) != (device.expert_shard == nullptr)) {
    return absl::InvalidArgumentError(
        "GPU model: the NCCL HSDP shard groups do not match the host's (sharding=hsdp)");
  }
  for (const auto& [name, h, d] : {std::tuple<const char*, Communicator*, Communicator*>{
                                       "dense_shard", host.dense_shard, device.dense_shard},
                                   {"expert_shard", host.expert_shard, device.expert_shard}}) {
    if (h == nullptr) continue;
    if (d->device_stream() == nullptr || d->device_stream()->device() != gpu ||
        h->rank() != d->rank() || h->size() != d->size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "GPU model: the NCCL ", name, " group (rank ", d->rank(), " of ", d->size(),
          ") is not the host's (rank ", h->rank(), " of ", h->size(), ") on this GPU"));
    }
  }
  out.units = std::make_shared<parallel::CudaUnitDevice>(ctx, device.world, device.edp_group,
                                                         device.dense_shard, device.expert_shard);
  if (host.cp_group != nullptr && host.cp_group->size() > 1) {
    return absl::UnimplementedError(absl::StrCat(
        "GPU model: context parallelism (cp=", host.cp_group->size(),
        ", SEMANTICS.md §16) has no CUDA ring attention kernel yet; use a CPU backend"));
  }
  if ((host.sp_group == nullptr) != (device.sp_group == nullptr) ||
      (host.sp_group != nullptr && (host.sp_group->size() != device.sp_group->size() ||
                                    host.sp_group->rank() != device.sp_group->rank()))) {
    return absl::InvalidArgumentError(
        "GPU model: the NCCL SP group does not match the host's (sequence parallelism)");
  }
  const model::CudaOpsComms comms{device.world, device.ep_group, host.ep_group, device.sp_group};
  out.ops = [ctx, comms](const model::MoeLmSpec& spec) {
    return model::MakeCudaOps(spec, ctx, comms);
  };
  return out;
}

absl::StatusOr<std::unique_ptr<MoeLm>> CreateCudaMoeLm(const MoeLmOptions& options,
                                                       const MoeLmGroups& host,
                                                       const MoeLmDeviceGroups& device) {
  GRADSUM_ASSIGN_OR_RETURN(ComputeDevice compute, MakeCudaCompute(host, device));
  return MoeLm::Create(options, host, std::move(compute));
}

}  // namespace gradsum::train
