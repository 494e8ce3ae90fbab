#ifndef GRADSUM_MODEL_CUDA_CUDA_OPS_H_
#define GRADSUM_MODEL_CUDA_CUDA_OPS_H_

// A GPU's ops (model/ops.h): the model's layers on one CUDA device, fp32 activations with
// TF32 off. Embedding, residual add: model/cuda/model_kernels.h; RMSNorm:
// moe/cuda/layers_cuda.h; the MoE layer's steps: moe/cuda/moe_layer_cuda.h (its EP
// all-to-all-v over NCCL), ordered by moe/moe_block.h as on the host (model/moe_block_ops.h); the
// head: a cuBLAS GEMM into a [T, V] logits buffer, the fused CE in place (losses/cuda), and the two
// backward GEMMs. Loss values accumulate on the device and come to the host once, in End().
//
// Limits: one row block per micro-batch (Begin refuses row_block > 0: the exact gradient
// precision is host-only), fp32 gradient targets in device memory.
//
//   GRADSUM_RETURN_IF_ERROR(mesh.AttachDeviceView(std::move(nccl_world)));
//   GRADSUM_ASSIGN_OR_RETURN(auto ops, MakeCudaOps(spec, context, mesh));

#include <memory>

#include "absl/status/statusor.h"
#include "collectives/mesh.h"
#include "core/cuda/compute_context.h"
#include "model/moe_lm_spec.h"
#include "model/ops.h"

namespace gradsum::model {

// Over the rank's mesh (not owned; it must outlive the ops) with its NCCL device view
// (Mesh::AttachDeviceView): the expert counts' SUM over device_group(kWorld), the MoE
// all-to-all-v over device_group(kEp) sized by the host group(kEp), and the all-to-alls
// ModelOps::AllToAll runs over the device group of the axis the caller names (the attention
// block's, model/parallel_attention.h). InvalidArgument for a mesh without an NCCL device
// view, or experts the EP group does not divide. Every option of the model runs on the GPU as on
// the CPU: the CE options of SEMANTICS.md §3.2 (label_smoothing, logit_softcap, alpha_lse) in the
// CUDA CE kernel, with the output z-loss reported as its own term (MicroBatchLossTerms::z_out), and
// the aux-loss-free balancing of §5.1 (sigmoid router scores; the expert bias of
// MoeWeights::expert_bias, uploaded per forward) in the CUDA router.
absl::StatusOr<std::unique_ptr<ModelOps>> MakeCudaOps(const MoeLmSpec& spec,
                                                      std::shared_ptr<cuda::ComputeContext> context,
                                                      const Mesh& mesh);

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_CUDA_CUDA_OPS_H_
