#ifndef GRADSUM_MOE_CUDA_MOE_LAYER_CUDA_H_
#define GRADSUM_MOE_CUDA_MOE_LAYER_CUDA_H_

// The GPU's compute of the MoE layers' steps (moe/moe_block.h orders them, as for the
// host): router GEMM and top-K (moe/cuda/router_cuda.h), the global SUM of the expert
// counts (§5) over NCCL, the permutation and the EP all-to-all-v over NCCL
// (moe/cuda/permute_cuda.h, sized by a count exchange over the host EP group,
// moe/ep_exchange.h), grouped SwiGLU experts through cuBLAS (moe/cuda/experts_cuda.h), the
// weighted combine; and their backward with the router z-loss (§4) and balancing loss (§5).
// fp32 activations, TF32 off. One block per micro-batch (no row blocks).
//
//   std::unique_ptr<MoeLayersCuda> kernels =
//       MakeMoeLayersCuda(&exec, mesh, config, {.alpha_z = az, .alpha_b = ab}, L);
//   MoeBlock block(kernels.get(), L);
//   kernels->BeginMicroBatch({.rows = T, .mask = mask, ...});  // device pointers
//   block.BeginMicroBatch();
//   ... block.Forward / Recompute / Release / Backward ...
//   ... kernels->global_counts(l) (device [E]) ...
//
// Host syncs: one per forward for the routed counts that size the all-to-all-v (NCCL needs
// them on the host), and the collectives' own waits. The communicators come from the
// rank's mesh (collectives/mesh.h): the expert counts' SUM over device_group(kWorld), the
// dispatch's all-to-all-v over device_group(kEp) (NCCL, their streams reached through
// device_stream()), the per-expert row counts that size it over the host group(kEp).

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "collectives/mesh.h"
#include "core/cuda/device_buffer.h"
#include "core/cuda/gemm.h"
#include "moe/moe_block.h"

namespace gradsum::moe {

// Where the layers run (not owned): the compute stream, its cuBLAS handle, an event for
// ordering the NCCL streams after it.
struct CudaExec {
  const cuda::CublasHandle* blas = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t fence = nullptr;
};

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

// One micro-batch as the layers see it (device memory, valid until the next one).
struct MoeMicroBatchCuda {
  int64_t rows = 0;                              // T
  const uint8_t* mask = nullptr;                 // [T] 1 routed, 0 padding
  int num_micro_batches = 1;                     // G (§5)
  const double* global_routed_tokens = nullptr;  // N of §4 (scalar)
  double* z_loss = nullptr;                      // += every layer's L_z[r, m] (scalar)
  double* balance_loss = nullptr;                // += every layer's L_bal[r, m] (scalar)
};

// The GPU's MoeLayerKernels (their steps are defined in moe_layer_cuda.cc), with what the
// ops read of them.
class MoeLayersCuda : public MoeLayerKernels {
 public:
  virtual void BeginMicroBatch(const MoeMicroBatchCuda& batch) = 0;
  // c[l, m, :] of §5 after layer l's forward: the world's SUM of the expert counts (device,
  // [E]).
  virtual const int64_t* global_counts(int l) const = 0;
  // The device bytes held between calls, as capacities: every layer's routing ([T, E],
  // [T, K] and the permutation plan's [T K]) and activations, the spare sets, the shared
  // scratch. The [E]-sized bookkeeping is not counted (model/ops.h HeldActivationBytes).
  virtual int64_t HeldBytes() const = 0;
};

// `exec` and `mesh` (not owned; the mesh with its device view) outlive the kernels; `exec`
// may be filled in after this call. E % P == 0.
std::unique_ptr<MoeLayersCuda> MakeMoeLayersCuda(const CudaExec* exec, const Mesh& mesh,
                                                 const MoeLayerConfig& config,
                                                 const MoeLossWeights& losses, int num_layers);

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_CUDA_MOE_LAYER_CUDA_H_
