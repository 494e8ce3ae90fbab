#ifndef GRADSUM_TRAIN_CUDA_CUDA_COMPUTE_H_
#define GRADSUM_TRAIN_CUDA_CUDA_COMPUTE_H_

// moe_lm on this rank's GPU, the `--backend=nccl` model: the same model (model/moe_lm.h),
// the same parallelism (parallel/parallelize.h) and the same schedule as on the host, on
// the GPU's device (train/moe_lm.h's ComputeDevice): the device unit store
// (parallel/cuda/device_unit_store.h: NCCL-reduced fp32 gradients, masters and AdamW on
// the host) and the device ops (model/cuda/cuda_ops.h: CUDA kernels, cuBLAS, the MoE
// all-to-all-v over NCCL). The host communicators (MPI) keep the step statistics, the
// display, the grad norm, checkpoints and the parity check, exactly as on the CPU path.
//
//   MoeLmDeviceGroups dev{nccl_world, nccl_ep, nccl_edp};     // same mesh as the host groups
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<MoeLm> model, CreateCudaMoeLm(options, host, dev));
//   ... then exactly the MoeLm protocol (train/moe_lm.h), or through Trainer with
//   RankComms::make_model (train/cuda/nccl_rank.h does this) ...
//
// The NCCL communicators should be timed (train/cuda/nccl_rank.h's MakeNcclMesh does) so
// that their collectives count in the step's comm metrics.
//
// Numerics: fp32 everywhere except what compute_dtype / reduce_dtype round to bf16. The
// embedding's backward adds repeated tokens with fp32 atomics (rounding-level run-to-run
// differences); the experts run once per EP source block, so their weight gradients add
// rows in a different order than the CPU path.

#include <memory>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "train/moe_lm.h"

namespace gradsum::train {

// The rank's NCCL communicators (decorated or not: each reaches its NCCL stream through
// device_stream(), collectives/device_stream.h), one GPU per rank, forming the same (F, P)
// mesh as the host groups (collectives/mesh.h over the NCCL world). Not owned.
struct MoeLmDeviceGroups {
  Communicator* world = nullptr;
  Communicator* ep_group = nullptr;
  Communicator* edp_group = nullptr;
  // The SP group (SEMANTICS.md §12) when the host groups have one; else null.
  Communicator* sp_group = nullptr;
  // HSDP (SEMANTICS.md §7) when the host groups have it, else null: the NCCL shard groups
  // the units' shards are gathered and reduce-scattered over (the cross-replica SUM of the
  // step's shard runs on the host replica groups, FlatParam::FoldReducedGrad).
  Communicator* dense_shard = nullptr;
  Communicator* expert_shard = nullptr;
};

// The GPU as a ComputeDevice for MoeLm::Create. InvalidArgument for missing device groups
// or ones whose rank/size differ from the host groups' or that sit on different GPUs;
// FailedPrecondition without a usable GPU (the CUDA runtime's reason).
absl::StatusOr<ComputeDevice> MakeCudaCompute(const MoeLmGroups& host,
                                              const MoeLmDeviceGroups& device);

// MoeLm::Create(options, host, MakeCudaCompute(host, device)). Also Unimplemented for
// reproducible mode (exact gradients are host-only).
absl::StatusOr<std::unique_ptr<MoeLm>> CreateCudaMoeLm(const MoeLmOptions& options,
                                                       const MoeLmGroups& host,
                                                       const MoeLmDeviceGroups& device);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_CUDA_CUDA_COMPUTE_H_
