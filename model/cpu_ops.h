#ifndef GRADSUM_MODEL_CPU_OPS_H_
#define GRADSUM_MODEL_CPU_OPS_H_

// The host's ops (model/ops.h): fp32 kernels on the CPU through the BLAS and the shared
// compute pool. Embedding and RMSNorm are model/layers.h, the MoE layer moe/moe_layer.h
// (router, dropless all-to-all dispatch over the EP group overlapped with the experts),
// the head losses/linear_cross_entropy.h, the router losses losses/router_losses.h,
// attention model/attention.h, its sequence-parallel exchanges host all-to-alls over the SP
// group.
//
// Row blocks (ops.h): with row_block > 0 every kernel runs per block (a packed sequence),
// the router per block and the experts per (block, expert) row group (moe/moe_layer.h),
// and each block's weight-gradient contribution is computed alone into scratch and handed
// to the target: added exactly to an ExactGradSink, or, for an fp32 target, in block order.
//
//   CpuOpsComms comms{world, ep_group};
//   GRADSUM_ASSIGN_OR_RETURN(auto ops, MakeCpuOps(spec, comms, /*num_threads=*/4));

#include <memory>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "model/moe_lm_spec.h"
#include "model/ops.h"
#include "model/ring_attention.h"

namespace gradsum::model {

// Not owned; they must outlive the ops.
struct CpuOpsComms {
  Communicator* world = nullptr;     // the expert-count SUM (§5)
  Communicator* ep_group = nullptr;  // the MoE dispatch
  // The SP group (§12: the ranks sharing this rank's sequences); null means no sequence
  // parallelism (a group of one).
  Communicator* sp_group = nullptr;
  // The CP group (§16: the ranks holding the other zigzag chunks of this rank's
  // sequences); null means none. Attention runs over it by `cp_schedule`
  // (model/ring_attention.h: the ring, or gathered in reproducible mode).
  Communicator* cp_group = nullptr;
  RingSchedule cp_schedule = RingSchedule::kRing;
};

// `num_threads`: threads for the head's fused CE (the rank's compute budget).
// InvalidArgument for missing communicators or experts that the EP group does not divide.
absl::StatusOr<std::unique_ptr<ModelOps>> MakeCpuOps(const MoeLmSpec& spec,
                                                     const CpuOpsComms& comms, int num_threads);

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_CPU_OPS_H_
