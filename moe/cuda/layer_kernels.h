#ifndef GRADSUM_MOE_CUDA_LAYER_KERNELS_H_
#define GRADSUM_MOE_CUDA_LAYER_KERNELS_H_

// Internal launch interface of the RMSNorm and SwiGLU CUDA kernels (nvcc side; no absl).
// Use moe/cuda/layers_cuda.h, which wraps them.

#include <cuda_runtime.h>

#include <cstdint>

namespace gradsum::moe::cuda_internal {

enum class ElemType { kF32, kBF16 };

struct RmsNormLaunch {
  ElemType dtype = ElemType::kF32;  // of x, y, dy, dx
  int64_t rows = 0;
  int64_t width = 0;
  float eps = 1e-6f;
  const void* x = nullptr;
  const float* gamma = nullptr;
  void* y = nullptr;           // forward output
  float* rstd = nullptr;       // [rows] forward output (optional) / backward input (optional)
  const void* dy = nullptr;    // backward
  void* dx = nullptr;          // backward output (may alias dy)
  bool accumulate_dx = false;  // dx += instead of =
  float* dgamma = nullptr;     // backward, accumulated (+=); optional
  float* partials = nullptr;   // [num_blocks, width] scratch when dgamma
  int num_blocks = 0;
  int threads = 0;
  cudaStream_t stream = nullptr;
};

cudaError_t LaunchRmsNormForward(const RmsNormLaunch& l);
cudaError_t LaunchRmsNormBackward(const RmsNormLaunch& l);

struct SwiGluLaunch {
  ElemType dtype = ElemType::kF32;
  int64_t n = 0;                // elements
  const void* gate = nullptr;   // x Wg (pre-activation)
  const void* up = nullptr;     // x Wu
  void* out = nullptr;          // forward: SiLU(gate) * up
  const void* d_out = nullptr;  // backward
  void* d_gate = nullptr;       // backward outputs (may alias gate / up respectively)
  void* d_up = nullptr;
  int num_blocks = 0;
  cudaStream_t stream = nullptr;
};

cudaError_t LaunchSwiGluForward(const SwiGluLaunch& l);
cudaError_t LaunchSwiGluBackward(const SwiGluLaunch& l);

}  // namespace gradsum::moe::cuda_internal

#endif  // GRADSUM_MOE_CUDA_LAYER_KERNELS_H_
