// RMSNorm of SEMANTICS.md §10: y = x / sqrt(mean(x^2) + eps) * g, and its backward
//   r = (mean(x^2) + eps)^-1/2,  dx_j = r * (g_j dy_j - x_j r^2 mean_i(g_i dy_i x_i)),
//   dg_j += sum over rows of dy_j x_j r.
// One block per row (grid-stride), fp32 math. dgamma: each block accumulates its rows'
// contributions in shared memory (a column is always owned by the same thread), writes one
// partial row, and a column kernel sums the partials in block order: deterministic.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/cuda/device_math.cuh"
#include "moe/cuda/layer_kernels.h"

namespace gradsum::moe::cuda_internal {
namespace {

using cuda_device::BlockSum;
using cuda_device::FromFloat;
using cuda_device::ToFloat;

template <typename T>
__global__ void RmsNormForwardKernel(RmsNormLaunch p) {
  __shared__ float scratch[32];
  const T* xs = static_cast<const T*>(p.x);
  T* ys = static_cast<T*>(p.y);
  const int64_t width = p.width;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = xs + row * width;
    float ss = 0.0f;
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
      const float v = ToFloat(x[j]);
      ss += v * v;
    }
    ss = BlockSum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / static_cast<float>(width) + p.eps);
    T* y = ys + row * width;
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
      y[j] = FromFloat<T>(ToFloat(x[j]) * r * p.gamma[j]);
    }
    if (threadIdx.x == 0 && p.rstd != nullptr) p.rstd[row] = r;
  }
}

template <typename T>
__global__ void RmsNormBackwardKernel(RmsNormLaunch p) {
  __shared__ float scratch[32];
  extern __shared__ float dgamma_acc[];  // [width] when p.dgamma
  const T* xs = static_cast<const T*>(p.x);
  const T* dys = static_cast<const T*>(p.dy);
  T* dxs = static_cast<T*>(p.dx);
  const int64_t width = p.width;
  const float inv_w = 1.0f / static_cast<float>(width);
  if (p.dgamma != nullptr) {
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) dgamma_acc[j] = 0.0f;
  }
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = xs + row * width;
    const T* dy = dys + row * width;
    float r;
    if (p.rstd != nullptr) {
      r = p.rstd[row];
    } else {
      float ss = 0.0f;
      for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
        const float v = ToFloat(x[j]);
        ss += v * v;
      }
      ss = BlockSum(ss, scratch);
      r = 1.0f / sqrtf(ss * inv_w + p.eps);
    }
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
      const float xv = ToFloat(x[j]), dyv = ToFloat(dy[j]);
      dot += p.gamma[j] * dyv * xv;
      if (p.dgamma != nullptr) dgamma_acc[j] += dyv * xv * r;
    }
    dot = BlockSum(dot, scratch);
    const float c = r * r * dot * inv_w;
    T* dx = dxs + row * width;
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
      const float xv = ToFloat(x[j]), dyv = ToFloat(dy[j]);
      float v = r * (p.gamma[j] * dyv - xv * c);
      if (p.accumulate_dx) v += ToFloat(dx[j]);
      dx[j] = FromFloat<T>(v);  // dx may alias dy: this thread read dy[j] above
    }
  }
  if (p.dgamma != nullptr) {
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
      p.partials[static_cast<int64_t>(blockIdx.x) * width + j] = dgamma_acc[j];
    }
  }
}

__global__ void SumPartialsKernel(RmsNormLaunch p) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= p.width) return;
  double s = 0.0;
  for (int b = 0; b < p.num_blocks; ++b) s += p.partials[static_cast<int64_t>(b) * p.width + j];
  p.dgamma[j] += static_cast<float>(s);
}

template <typename T>
cudaError_t Forward(const RmsNormLaunch& l) {
  if (l.rows == 0) return cudaSuccess;
  RmsNormForwardKernel<T><<<l.num_blocks, l.threads, 0, l.stream>>>(l);
  return cudaGetLastError();
}

template <typename T>
cudaError_t Backward(const RmsNormLaunch& l) {
  const size_t smem = l.dgamma != nullptr ? sizeof(float) * l.width : 0;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(RmsNormBackwardKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  if (l.rows > 0) {
    RmsNormBackwardKernel<T><<<l.num_blocks, l.threads, smem, l.stream>>>(l);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (l.dgamma != nullptr) {
      SumPartialsKernel<<<static_cast<int>((l.width + 255) / 256), 256, 0, l.stream>>>(l);
    }
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchRmsNormForward(const RmsNormLaunch& l) {
  return l.dtype == ElemType::kBF16 ? Forward<__nv_bfloat16>(l) : Forward<float>(l);
}

cudaError_t LaunchRmsNormBackward(const RmsNormLaunch& l) {
  return l.dtype == ElemType::kBF16 ? Backward<__nv_bfloat16>(l) : Backward<float>(l);
}

}  // namespace gradsum::moe::cuda_internal
