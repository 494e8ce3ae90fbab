#ifndef GRADSUM_MOE_CUDA_EXPERTS_CUDA_H_
#define GRADSUM_MOE_CUDA_EXPERTS_CUDA_H_

// Grouped SwiGLU experts on a CUDA device (SEMANTICS.md §10), the GPU counterpart of
// moe/experts.h: rows arrive grouped by local expert (e.g. permuted by moe/cuda/permute_cuda.h
// or received from the EP all-to-all), expert j owns rows [offsets[j], offsets[j+1]).
//
//   Expert_j(x) = (SiLU(x Wg_j) * (x Wu_j)) Wd_j      Wg_j, Wu_j: [D, H], Wd_j: [H, D]
//
// Three cuBLAS GEMMs per expert (core/cuda/gemm.h, fp32 accumulation) around the SwiGLU
// kernel (moe/cuda/layers_cuda.h). The group offsets are host values: the caller copies
// expert_offsets to the host once per layer (it needs them anyway to size the EP exchange).
//
//   ExpertsCudaConfig c{.d_model = D, .hidden = H, .num_local_experts = El, .dtype = DType::kBF16};
//   ExpertsCudaSaved saved{gate_pre, up_pre, hidden};            // [N, H] each, caller-owned
//   GRADSUM_RETURN_IF_ERROR(ExpertsForwardCuda(blas, stream, c, w, x, offsets, y, saved));
//   ...
//   GRADSUM_RETURN_IF_ERROR(ExpertsBackwardCuda(blas, stream, c, w, x, offsets, saved, dy, dx, g));

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/cuda/gemm.h"
#include "core/dtype.h"

namespace gradsum::moe {

struct ExpertsCudaConfig {
  int64_t d_model = 0;        // D >= 1
  int64_t hidden = 0;         // H >= 1
  int num_local_experts = 0;  // >= 1
  DType dtype = DType::kF32;  // activations and weights: kF32 or kBF16
};

// Stacked weights of the local experts, row-major, `dtype`, device.
struct ExpertsCudaWeights {
  const void* gate = nullptr;  // [E_l, D, H]
  const void* up = nullptr;    // [E_l, D, H]
  const void* down = nullptr;  // [E_l, H, D]
};

// Weight gradients, fp32 whatever the dtype, accumulated (+=) so micro-batches sum (§2).
struct ExpertsCudaWeightGrads {
  float* gate = nullptr;
  float* up = nullptr;
  float* down = nullptr;
};

// Activations forward keeps for backward, [N, H] each in `dtype`, caller-allocated.
// Backward consumes them (overwrites them with gradients).
struct ExpertsCudaSaved {
  void* gate_pre = nullptr;  // x Wg
  void* up_pre = nullptr;    // x Wu
  void* hidden = nullptr;    // SiLU(gate_pre) * up_pre
};

// y[offsets[j] .. offsets[j+1]) = Expert_j(x[...]) for every local expert j.
// `x`, `y`: [N, D] device with N = offsets.back(); `offsets`: host, E_l + 1 entries,
// non-decreasing from 0. Errors: InvalidArgument for a bad config, offsets of the wrong
// length / decreasing / not starting at 0, or null / non-device pointers (named);
// FailedPrecondition without a GPU; cuBLAS failures as core/cuda/cuda_status.h.
absl::Status ExpertsForwardCuda(const cuda::CublasHandle& blas, cudaStream_t stream,
                                const ExpertsCudaConfig& config, const ExpertsCudaWeights& weights,
                                const void* x, absl::Span<const int64_t> offsets, void* y,
                                const ExpertsCudaSaved& saved);

// Given dy = dL/dy ([N, D]), overwrites dx ([N, D], may not alias dy) and adds the weight
// gradients into `grads`. `x`, `offsets` and `saved` must be the forward's; `saved` is
// overwritten. Same errors as the forward.
absl::Status ExpertsBackwardCuda(const cuda::CublasHandle& blas, cudaStream_t stream,
                                 const ExpertsCudaConfig& config, const ExpertsCudaWeights& weights,
                                 const void* x, absl::Span<const int64_t> offsets,
                                 const ExpertsCudaSaved& saved, const void* dy, void* dx,
                                 const ExpertsCudaWeightGrads& grads);

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_CUDA_EXPERTS_CUDA_H_
