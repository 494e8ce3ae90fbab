// Kernels of model/cuda/model_kernels.h (launch wrappers below return cudaError_t; the
// absl::Status wrappers are in model_kernels.cc so that nvcc never sees absl).
#include <cuda_runtime.h>

#include <cstdint>

namespace gradsum::model::cuda_internal {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 16 ? (b < 1 ? 1 : b) : 65535 * 16);
}

__global__ void EmbeddingForwardKernel(const float* __restrict__ emb,
                                       const int32_t* __restrict__ tokens, int64_t rows,
                                       int64_t dim, float* __restrict__ h) {
  const int64_t n = rows * dim;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / dim, j = i - t * dim;
    h[i] = emb[int64_t{tokens[t]} * dim + j];
  }
}

__global__ void EmbeddingBackwardKernel(const int32_t* __restrict__ tokens,
                                        const float* __restrict__ dh, int64_t rows, int64_t dim,
                                        float* __restrict__ d_emb) {
  const int64_t n = rows * dim;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / dim, j = i - t * dim;
    atomicAdd(&d_emb[int64_t{tokens[t]} * dim + j], dh[i]);
  }
}

__global__ void AddKernel(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = a[i] + b[i];
  }
}

__global__ void Bf16ToF32Kernel(const uint16_t* __restrict__ in, float* __restrict__ out,
                                int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
  }
}

__global__ void F32ToBf16Kernel(const float* __restrict__ in, uint16_t* __restrict__ out,
                                int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t u = __float_as_uint(in[i]);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      out[i] = static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN, sign kept
    } else {
      out[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
}

// x [rows, heads, 2 half]: each head's (i, i + half) pairs rotated by the row's angles
// (cos, sin [rows, half]); sign -1 rotates back.
__global__ void RopeKernel(float* __restrict__ x, const float* __restrict__ cos_t,
                           const float* __restrict__ sin_t, int64_t rows, int heads, int64_t half,
                           float sign) {
  const int64_t n = rows * heads * half;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx % half, th = idx / half, t = th / heads;
    float* v = x + th * 2 * half;
    const float c = cos_t[t * half + i], s = sign * sin_t[t * half + i];
    const float a = v[i], b = v[i + half];
    v[i] = a * c - b * s;
    v[i + half] = b * c + a * s;
  }
}

// out[t, j, :] = sum over g of x[t, j * group + g, :], in g order.
__global__ void SumGroupsKernel(const float* __restrict__ x, float* __restrict__ out, int64_t rows,
                                int64_t groups, int group, int64_t dim) {
  const int64_t n = rows * groups * dim;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx % dim, tj = idx / dim;
    const float* src = x + tj * group * dim + i;
    float acc = src[0];
    for (int g = 1; g < group; ++g) acc += src[g * dim];
    out[idx] = acc;
  }
}

}  // namespace

cudaError_t LaunchRope(float* x, const float* cos_t, const float* sin_t, int64_t rows, int heads,
                       int64_t half, bool inverse, cudaStream_t stream) {
  const int64_t n = rows * heads * half;
  if (n == 0) return cudaSuccess;
  RopeKernel<<<Blocks(n), kThreads, 0, stream>>>(x, cos_t, sin_t, rows, heads, half,
                                                 inverse ? -1.0f : 1.0f);
  return cudaGetLastError();
}

cudaError_t LaunchSumGroups(const float* x, float* out, int64_t rows, int64_t groups, int group,
                            int64_t dim, cudaStream_t stream) {
  const int64_t n = rows * groups * dim;
  if (n == 0) return cudaSuccess;
  SumGroupsKernel<<<Blocks(n), kThreads, 0, stream>>>(x, out, rows, groups, group, dim);
  return cudaGetLastError();
}

cudaError_t LaunchEmbeddingForward(const float* emb, const int32_t* tokens, int64_t rows,
                                   int64_t dim, float* h, cudaStream_t stream) {
  if (rows * dim == 0) return cudaSuccess;
  EmbeddingForwardKernel<<<Blocks(rows * dim), kThreads, 0, stream>>>(emb, tokens, rows, dim, h);
  return cudaGetLastError();
}

cudaError_t LaunchEmbeddingBackward(const int32_t* tokens, const float* dh, int64_t rows,
                                    int64_t dim, float* d_emb, cudaStream_t stream) {
  if (rows * dim == 0) return cudaSuccess;
  EmbeddingBackwardKernel<<<Blocks(rows * dim), kThreads, 0, stream>>>(tokens, dh, rows, dim,
                                                                       d_emb);
  return cudaGetLastError();
}

cudaError_t LaunchAdd(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  AddKernel<<<Blocks(n), kThreads, 0, stream>>>(a, b, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchBf16ToF32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  Bf16ToF32Kernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchF32ToBf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  F32ToBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

}  // namespace gradsum::model::cuda_internal
