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
//   GRADSUM_RETURN_IF_ERROR(mesh.AttachDeviceView(std::move(nccl_world)));  // same groups
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<MoeLm> model, CreateCudaMoeLm(options, mesh));
//   ... then exactly the MoeLm protocol (train/moe_lm.h), or through Trainer with
//   RankComms::make_model (train/cuda/nccl_rank.h does this) ...
//
// The NCCL communicators should be timed (train/cuda/nccl_rank.h's AttachNcclView does) so
// that their collectives count in the step's comm metrics.
//
// Numerics: fp32 everywhere except what compute_dtype / reduce_dtype round to bf16. The
// embedding's backward adds repeated tokens with fp32 atomics (rounding-level run-to-run
// differences); the experts run once per EP source block, so their weight gradients add
// rows in a different order than the CPU path.

#include <memory>

#include "absl/status/statusor.h"
#include "collectives/mesh.h"
#include "train/moe_lm.h"

namespace gradsum::train {

// The GPU as a ComputeDevice for MoeLm::Create, over `mesh` (not owned; it must outlive the
// model) with its NCCL device view (Mesh::AttachDeviceView over the rank's NCCL world: the
// same groups as the host's, by construction). InvalidArgument for a mesh without an NCCL
// device view or one whose groups sit on different GPUs; Unimplemented for context
// parallelism (no CUDA ring kernel); FailedPrecondition without a usable GPU (the CUDA
// runtime's reason).
absl::StatusOr<ComputeDevice> MakeCudaCompute(const Mesh& mesh);

// MoeLm::Create(options, mesh, MakeCudaCompute(mesh)). Also Unimplemented for reproducible
// mode (exact gradients are host-only).
absl::StatusOr<std::unique_ptr<MoeLm>> CreateCudaMoeLm(const MoeLmOptions& options,
                                                       const Mesh& mesh);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_CUDA_CUDA_COMPUTE_H_
