#ifndef GRADSUM_MOE_CUDA_MOE_LAYER_CUDA_H_
#define GRADSUM_MOE_CUDA_MOE_LAYER_CUDA_H_

// One MoE block of SEMANTICS.md §10 on a CUDA device, the GPU counterpart of
// moe/moe_layer.h, assembled once from the CUDA pieces: router GEMM and top-K
// (moe/cuda/router_cuda.h), the global SUM of the expert counts (§5) over NCCL, the
// permutation and the EP all-to-all-v over NCCL (moe/cuda/permute_cuda.h, sized by a count
// exchange over the host EP group, moe/ep_exchange.h), grouped SwiGLU experts through
// cuBLAS (moe/cuda/experts_cuda.h), the weighted combine; and their backward with the
// router z-loss (§4) and balancing loss (§5). fp32 activations, TF32 off.
//
//   MoeLayerCuda layer;                      // one per layer: keeps what backward reads
//   GRADSUM_RETURN_IF_ERROR(layer.Forward(exec, mesh, config, &scratch, T, a, weights,
//                                         mask, y));
//   ... layer.global_counts() (device [E]) ...
//   GRADSUM_RETURN_IF_ERROR(layer.Backward(exec, mesh, config, &scratch, a, weights, mask,
//                                          losses, dy, da, grads));
//
// Host syncs: one per forward for the routed counts that size the all-to-all-v (NCCL needs
// them on the host), and the collectives' own waits.
//
// Full activation recomputation (model/ops.h MoeRecomputeForward): TakeActivations hands
// the layer's dispatch and expert buffers to another layer (its routing, counts and plans
// stay); RecomputeForward re-runs the dispatch, experts and combine from the kept routing
// into buffers given back with GiveActivations (or fresh ones), with the same kernels on
// the same inputs as Forward, so what Backward reads and y are the first forward's.

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "collectives/communicator.h"
#include "collectives/mesh.h"
#include "core/cuda/device_buffer.h"
#include "core/cuda/gemm.h"
#include "moe/cuda/permute_cuda.h"
#include "moe/ep_exchange.h"

namespace gradsum::moe {

struct MoeLayerCudaConfig {
  int64_t d_model = 0;  // D
  int64_t hidden = 0;   // H
  int num_experts = 0;  // E, E % P == 0
  int top_k = 0;        // K
  bool norm_topk_prob = false;
  float router_scale = 1.0f;
  bool sigmoid_scores = false;  // §5.1: router scores sigmoid(u) (alpha_b must be 0)
};

// Where the layer runs (not owned): the compute stream, its cuBLAS handle, an event for
// ordering the NCCL streams after it.
struct CudaExec {
  const cuda::CublasHandle* blas = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t fence = nullptr;
};

// The layer's communicators come from the rank's mesh (collectives/mesh.h): the expert
// counts' SUM over device_group(kWorld) (§5), the dispatch's all-to-all-v over
// device_group(kEp) (NCCL, their streams reached through device_stream()), and the
// per-expert row counts that size it over the host group(kEp).

// Device buffers the layers of one rank share (one layer runs at a time).
struct MoeLayerCudaScratch {
  cuda::DeviceBuffer send, expert_out, d_back, d_recv, dx_recv, d_send;  // rows x D
  cuda::DeviceBuffer du, dw;                                             // [T, E], [T, K]
  int64_t bytes() const;                                                 // the buffers' capacities
};

// A layer's dispatch and expert activations (device): what full recomputation drops and
// re-creates. recv [R, D]; gate, up, hidden [R, H]; back [T K, D] (the expert outputs, in
// send order). Movable between layers; buffers keep their capacity.
struct MoeLayerCudaActivations {
  cuda::DeviceBuffer recv, gate, up, hidden, back;
  int64_t bytes() const;  // the buffers' capacities
};

// Weights as the compute reads them (device): the router [D, E] and this EP rank's
// E / P experts stacked as all Wg [., D, H], then all Wu, then all Wd [., H, D].
struct MoeLayerCudaWeights {
  const float* router = nullptr;
  const float* local_experts = nullptr;
  // The layer's expert bias [E] (SEMANTICS.md §5.1), device, or null: added to the router
  // scores for the top-K selection only (moe/cuda/router_cuda.h).
  const float* expert_bias = nullptr;
};

// Accumulated (+=) weight gradients, device, in the layouts above.
struct MoeLayerCudaGrads {
  float* router = nullptr;
  float* local_experts = nullptr;
};

// The router losses backward adds (device scalars).
struct MoeRouterLossCudaArgs {
  float alpha_z = 0.0f;                          // §4
  float alpha_b = 0.0f;                          // §5
  int num_micro_batches = 1;                     // G
  const double* global_routed_tokens = nullptr;  // N of §4
  double* z_loss = nullptr;                      // += this layer's L_z[r, m]
  double* balance_loss = nullptr;                // += this layer's L_bal[r, m]
};

class MoeLayerCuda {
 public:
  // T tokens: a [T, D], mask [T] (1 routed, 0 padding), y [T, D] written; all device.
  // Collective over the communicators. Errors: the pieces' (InvalidArgument for a
  // non-finite router logit, naming the token), the communicators'.
  absl::Status Forward(const CudaExec& exec, const Mesh& mesh, const MoeLayerCudaConfig& config,
                       MoeLayerCudaScratch* scratch, int64_t T, const float* a,
                       const MoeLayerCudaWeights& w, const uint8_t* mask, float* y);
  // dy = dL/dy [T, D]; da = dL/da [T, D] written; weight gradients added into `grads`; the
  // router losses' values added into `losses`. Collective over the mesh's EP groups.
  absl::Status Backward(const CudaExec& exec, const Mesh& mesh, const MoeLayerCudaConfig& config,
                        MoeLayerCudaScratch* scratch, const float* a, const MoeLayerCudaWeights& w,
                        const uint8_t* mask, const MoeRouterLossCudaArgs& losses, const float* dy,
                        float* da, const MoeLayerCudaGrads& grads);

  // Re-runs the dispatch, experts and combine of this micro-batch's Forward on the same
  // `a` and weights, from the routing that Forward kept: no router pass, no count SUM.
  // FailedPrecondition before a Forward. Collective over the mesh's EP groups.
  absl::Status RecomputeForward(const CudaExec& exec, const Mesh& mesh,
                                const MoeLayerCudaConfig& config, MoeLayerCudaScratch* scratch,
                                const float* a, const MoeLayerCudaWeights& w, float* y);
  // Hands over the dispatch and expert buffers (the layer holds none until GiveActivations
  // or its next forward; Backward needs them re-run first). Give: buffers to use.
  MoeLayerCudaActivations TakeActivations();
  void GiveActivations(MoeLayerCudaActivations activations);
  bool holds_activations() const { return activations_valid_; }
  // The device bytes this layer holds between calls: its routing ([T, E], [T, K] and the
  // permutation plan's [T K]) and its dispatch and expert activations, as capacities. The
  // [E]-sized bookkeeping is not counted (model/ops.h HeldActivationBytes).
  int64_t HeldBytes() const;

  // c[l, m, :] of §5 after Forward: the world's SUM of the expert counts (device, [E]).
  const int64_t* global_counts() const { return global_counts_.as<int64_t>(); }

 private:
  absl::Status Reserve(int64_t T, const MoeLayerCudaConfig& config, MoeLayerCudaScratch* scratch);
  // Forward's part after the routing, the plans and the permutation into scratch->send:
  // the all-to-all, experts, the reverse all-to-all and the combine into y, in acts_.
  // Forward and RecomputeForward.
  absl::Status DispatchExpertsCombine(const CudaExec& exec, const Mesh& mesh,
                                      const MoeLayerCudaConfig& config,
                                      MoeLayerCudaScratch* scratch, const MoeLayerCudaWeights& w,
                                      float* y);

  int64_t rows_ = -1;
  cuda::DeviceBuffer logits_, probs_, index_, weight_, lse_;    // [T, E], [T, E], [T, K] x 2, [T]
  cuda::DeviceBuffer local_counts_, global_counts_, gating_;    // [E] i64, [E] i64, [E] f64
  cuda::DeviceBuffer offsets_, permuted_copy_, copy_position_;  // [E + 1], [T K], [T K] i64
  MoeLayerCudaActivations acts_;
  bool activations_valid_ = false;  // acts_ hold this micro-batch's dispatch
  EpExchangePlan exchange_;         // send side by expert, receive side by source then expert
  PermutePlanCudaArgs plan_;
};

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_CUDA_MOE_LAYER_CUDA_H_
