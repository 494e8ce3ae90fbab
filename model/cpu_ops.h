#ifndef GRADSUM_MODEL_CPU_OPS_H_
#define GRADSUM_MODEL_CPU_OPS_H_

// The host's ops (model/ops.h): fp32 kernels on the CPU through the BLAS and the shared
// compute pool. Embedding and RMSNorm are model/layers.h, the MoE layer's steps
// moe/moe_layer.h (router, dropless all-to-all dispatch over the EP group overlapped with
// the experts), ordered by moe/moe_block.h as on every device (model/moe_block_ops.h),
// the head losses/linear_cross_entropy.h, the router losses losses/router_losses.h,
// attention model/attention.h, the attention layouts' packing host copies (the exchanges
// themselves are model/parallel_attention.h's).
//
// Row blocks (ops.h): with row_block > 0 every kernel runs per block (a packed sequence),
// the router per block and the experts per (block, expert) row group (moe/moe_layer.h),
// and each block's weight-gradient contribution is computed alone into scratch and handed
// to the target: added exactly to an ExactGradSink, or, for an fp32 target, in block order.
//
//   GRADSUM_ASSIGN_OR_RETURN(auto ops, MakeCpuOps(spec, mesh, {.num_threads = 4}));

#include <memory>

#include "absl/status/statusor.h"
#include "collectives/mesh.h"
#include "model/moe_lm_spec.h"
#include "model/ops.h"

namespace gradsum::model {

struct CpuOpsOptions {
  int num_threads = 1;  // threads for the head's fused CE (the rank's compute budget)
};

// The host's ops over the rank's mesh (not owned; it must outlive the ops): the expert
// counts' SUM over the world (§5), the MoE dispatch over the EP axis, and the host
// all-to-alls ModelOps::AllToAll runs on the axis the caller names. InvalidArgument for
// experts that the EP group does not divide.
absl::StatusOr<std::unique_ptr<ModelOps>> MakeCpuOps(const MoeLmSpec& spec, const Mesh& mesh,
                                                     const CpuOpsOptions& options);

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_CPU_OPS_H_
