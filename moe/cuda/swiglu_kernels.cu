// SwiGLU elementwise part of the experts (SEMANTICS.md §10): h = SiLU(g) * u with
// SiLU(g) = g * sigmoid(g), and its backward
//   du = dh * SiLU(g),   dg = dh * u * s * (1 + g * (1 - s)),   s = sigmoid(g).
// Grid-stride over elements, fp32 math; outputs may alias inputs element by element.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/cuda/device_math.cuh"
#include "moe/cuda/layer_kernels.h"

namespace gradsum::moe::cuda_internal {
namespace {

using cuda_device::FromFloat;
using cuda_device::ToFloat;

__device__ __forceinline__ float Sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
__global__ void SwiGluForwardKernel(SwiGluLaunch p) {
  const T* g = static_cast<const T*>(p.gate);
  const T* u = static_cast<const T*>(p.up);
  T* h = static_cast<T*>(p.out);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gv = ToFloat(g[i]);
    h[i] = FromFloat<T>(gv * Sigmoid(gv) * ToFloat(u[i]));
  }
}

template <typename T>
__global__ void SwiGluBackwardKernel(SwiGluLaunch p) {
  const T* g = static_cast<const T*>(p.gate);
  const T* u = static_cast<const T*>(p.up);
  const T* dh = static_cast<const T*>(p.d_out);
  T* dg = static_cast<T*>(p.d_gate);
  T* du = static_cast<T*>(p.d_up);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gv = ToFloat(g[i]), uv = ToFloat(u[i]), dhv = ToFloat(dh[i]);
    const float s = Sigmoid(gv);
    // Read everything before writing: d_gate / d_up may alias gate / up.
    dg[i] = FromFloat<T>(dhv * uv * s * (1.0f + gv * (1.0f - s)));
    du[i] = FromFloat<T>(dhv * gv * s);
  }
}

}  // namespace

cudaError_t LaunchSwiGluForward(const SwiGluLaunch& l) {
  if (l.n == 0) return cudaSuccess;
  if (l.dtype == ElemType::kBF16) {
    SwiGluForwardKernel<__nv_bfloat16><<<l.num_blocks, 256, 0, l.stream>>>(l);
  } else {
    SwiGluForwardKernel<float><<<l.num_blocks, 256, 0, l.stream>>>(l);
  }
  return cudaGetLastError();
}

cudaError_t LaunchSwiGluBackward(const SwiGluLaunch& l) {
  if (l.n == 0) return cudaSuccess;
  if (l.dtype == ElemType::kBF16) {
    SwiGluBackwardKernel<__nv_bfloat16><<<l.num_blocks, 256, 0, l.stream>>>(l);
  } else {
    SwiGluBackwardKernel<float><<<l.num_blocks, 256, 0, l.stream>>>(l);
  }
  return cudaGetLastError();
}

}  // namespace gradsum::moe::cuda_internal
