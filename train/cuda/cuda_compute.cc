#include "train/cuda/cuda_compute.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "collectives/device_stream.h"
#include "core/cuda/compute_context.h"
#include "core/status.h"
#include "model/cuda/cuda_ops.h"
#include "parallel/cuda/device_unit_store.h"

namespace gradsum::train {

absl::StatusOr<ComputeDevice> MakeCudaCompute(const Mesh& mesh) {
  if (!mesh.has_device_view()) {
    return absl::InvalidArgumentError(
        "the GPU model needs the mesh's NCCL device view (Mesh::AttachDeviceView)");
  }
  // Every group the GPU model runs collectives on is NCCL on this rank's GPU.
  DeviceStream* world_stream = mesh.device_group(MeshAxis::kWorld).device_stream();
  if (world_stream == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU model: the device world is a ", mesh.device_group(MeshAxis::kWorld).backend(),
        " communicator without a device stream; it must be NCCL"));
  }
  const int gpu = world_stream->device();
  for (MeshAxis axis :
       {MeshAxis::kEp, MeshAxis::kEdp, MeshAxis::kSp, MeshAxis::kDpShard, MeshAxis::kEdpShard}) {
    Communicator& d = mesh.device_group(axis);
    if (d.size() == 1 && axis == MeshAxis::kSp) continue;  // off: no collective runs on it
    if (d.device_stream() == nullptr || d.device_stream()->device() != gpu) {
      return absl::InvalidArgumentError(absl::StrCat("GPU model: the device ", MeshAxisName(axis),
                                                     " group (", d.backend(),
                                                     ") is not NCCL on GPU ", gpu));
    }
  }
  GRADSUM_ASSIGN_OR_RETURN(std::shared_ptr<cuda::ComputeContext> ctx,
                           cuda::ComputeContext::Create(gpu));
  ComputeDevice out;
  out.units = std::make_shared<parallel::CudaUnitDevice>(ctx, mesh);
  const Mesh* m = &mesh;
  out.ops = [ctx, m](const model::MoeLmSpec& spec) { return model::MakeCudaOps(spec, ctx, *m); };
  return out;
}

absl::StatusOr<std::unique_ptr<MoeLm>> CreateCudaMoeLm(const MoeLmOptions& options,
                                                       const Mesh& mesh) {
  GRADSUM_ASSIGN_OR_RETURN(ComputeDevice compute, MakeCudaCompute(mesh));
  return MoeLm::Create(options, mesh, std::move(compute));
}

}  // namespace gradsum::train
