#ifndef GRADSUM_CORE_CUDA_DEVICE_MATH_CUH_
#define GRADSUM_CORE_CUDA_DEVICE_MATH_CUH_

// Device-side helpers shared by gradsum's .cu files (include only from nvcc-compiled code):
// fp32 conversion of f32/bf16 elements, 16-byte vector loads/stores, warp and block
// reductions with a fixed combination order (so results are run-to-run deterministic).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace gradsum::cuda_device {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Elements per 16-byte vector.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

// Loads kN consecutive elements starting at p (16-byte aligned when kN * sizeof(T) == 16)
// as floats.
template <typename T, int kN>
__device__ __forceinline__ void LoadAsFloat(const T* p, float (&out)[kN]) {
  if constexpr (kN * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    T vals[kN];
    memcpy(vals, &raw, 16);
#pragma unroll
    for (int i = 0; i < kN; ++i) out[i] = ToFloat(vals[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) out[i] = ToFloat(p[i]);
  }
}

template <typename T, int kN>
__device__ __forceinline__ void StoreFromFloat(T* p, const float (&in)[kN]) {
  if constexpr (kN * sizeof(T) == 16) {
    T vals[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) vals[i] = FromFloat<T>(in[i]);
    uint4 raw;
    memcpy(&raw, vals, 16);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) p[i] = FromFloat<T>(in[i]);
  }
}

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
// `scratch` holds >= 32 values. Contains __syncthreads(): call from all threads.
template <typename T>
__device__ __forceinline__ T BlockSum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : T(0);
  return WarpSum(v);
}

// Online-logsumexp state: running max m and sum s of exp(x - m).
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum MergeMaxSum(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  // Both empty or all -inf: the sums are 0, or NaN when a NaN was seen (kept).
  if (m == -INFINITY) return {m, a.s + b.s};
  // NaN in either sum propagates; +inf maxima give inf - inf = NaN, flagged by the caller.
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ MaxSum WarpMaxSum(MaxSum v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = MergeMaxSum(v, other);
  }
  return v;
}

// Block-wide MaxSum merge; every thread gets the result. `scratch` holds >= 32 entries.
__device__ __forceinline__ MaxSum BlockMaxSum(MaxSum v, MaxSum* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = WarpMaxSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : MaxSum{-INFINITY, 0.0f};
  return WarpMaxSum(v);
}

// Host side: the grid for a grid-stride kernel, `upper` lowered to the number of blocks
// resident at once (blocks per SM from the occupancy calculator times the SM count), so the
// work spreads over one full wave instead of a full wave plus a partial one.
template <typename Kernel>
inline int ResidentGrid(Kernel kernel, int threads, int upper, size_t dynamic_smem = 0) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem) !=
          cudaSuccess ||
      per_sm < 1) {
    return upper;  // the launch itself reports a real problem
  }
  const long long resident = static_cast<long long>(per_sm) * sms;
  return resident < upper ? static_cast<int>(resident) : upper;
}

}  // namespace gradsum::cuda_device

#endif  // GRADSUM_CORE_CUDA_DEVICE_MATH_CUH_
