// Token permutation for dropless dispatch (SEMANTICS.md §10): the K copies of every routed
// token ordered by expert, ties by copy index c = t * K + k (a stable counting sort, the
// same order as moe/dispatch.cc), and the gather / weighted combine / combine backward.
//
// Plan: (1) per chunk of 256 copies, a per-expert histogram; (2) one block turns the
// histograms into expert offsets and per-chunk bases; (3) per chunk, each copy's rank
// among the chunk's earlier copies of the same expert (warp match + per-warp counts) gives
// its position. Positions depend only on the input, never on scheduling.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/device_math.cuh"
#include "moe/cuda/permute_kernels.h"

namespace gradsum::moe::cuda_internal {
namespace {

using cuda_device::BlockSum;
using cuda_device::FromFloat;
using cuda_device::ToFloat;

constexpr int kChunkWarps = kPermuteChunk / 32;

__global__ void ChunkHistogramKernel(PermutePlanLaunch p) {
  __shared__ int hist[kMaxPermuteExperts];
  for (int e = threadIdx.x; e < p.experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kPermuteChunk + threadIdx.x;
  if (c < p.copies) {
    const int e = p.expert_index[c];
    if (e >= 0 && e < p.experts) {
      atomicAdd(&hist[e], 1);
    } else if (e != -1) {
      atomicMin(p.bad_copy, static_cast<unsigned long long>(c));
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.experts; e += blockDim.x) {
    p.chunk_counts[static_cast<int64_t>(blockIdx.x) * p.experts + e] = hist[e];
  }
}

// One block: expert totals, exclusive scan into expert_offsets, and per-chunk bases written
// back over chunk_counts.
__global__ void ScanKernel(PermutePlanLaunch p, int chunks) {
  __shared__ long long totals[kMaxPermuteExperts];
  for (int e = threadIdx.x; e < p.experts; e += blockDim.x) {
    long long s = 0;
    for (int c = 0; c < chunks; ++c) s += p.chunk_counts[static_cast<int64_t>(c) * p.experts + e];
    totals[e] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    long long run = 0;
    for (int e = 0; e < p.experts; ++e) {
      const long long t = totals[e];
      totals[e] = run;
      p.expert_offsets[e] = run;
      run += t;
    }
    p.expert_offsets[p.experts] = run;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.experts; e += blockDim.x) {
    long long run = totals[e];
    for (int c = 0; c < chunks; ++c) {
      int* slot = &p.chunk_counts[static_cast<int64_t>(c) * p.experts + e];
      const int n = *slot;
      *slot = static_cast<int>(run - totals[e]);  // base within the expert's segment
      run += n;
    }
  }
}

__global__ void ScatterKernel(PermutePlanLaunch p) {
  __shared__ int warp_counts[kChunkWarps][kMaxPermuteExperts];
  for (int i = threadIdx.x; i < kChunkWarps * p.experts; i += blockDim.x) {
    warp_counts[i / p.experts][i % p.experts] = 0;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kPermuteChunk + threadIdx.x;
  int e = c < p.copies ? p.expert_index[c] : -1;
  const bool valid = e >= 0 && e < p.experts;
  if (!valid) e = -1;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int rank_in_warp = __popc(peers & ((1u << lane) - 1u));
  if (valid && lane == __ffs(peers) - 1) warp_counts[warp][e] = __popc(peers);
  __syncthreads();
  if (c >= p.copies) return;
  if (!valid) {
    p.copy_position[c] = -1;
    return;
  }
  int rank = rank_in_warp;
  for (int w = 0; w < warp; ++w) rank += warp_counts[w][e];
  const int64_t pos =
      p.expert_offsets[e] + p.chunk_counts[static_cast<int64_t>(blockIdx.x) * p.experts + e] + rank;
  p.copy_position[c] = pos;
  p.permuted_copy[pos] = c;
}

// dst[pos] = src[permuted_copy[pos] / K] for pos < S (rows beyond S are left untouched).
template <typename Word>
__global__ void GatherKernel(PermuteRowsLaunch p, int64_t words_per_row) {
  const int64_t routed = p.expert_offsets[p.experts];
  const Word* src = static_cast<const Word*>(p.src);
  Word* dst = static_cast<Word*>(p.dst);
  for (int64_t pos = blockIdx.x; pos < routed; pos += gridDim.x) {
    const int64_t token = p.permuted_copy[pos] / p.top_k;
    const Word* s = src + token * words_per_row;
    Word* d = dst + pos * words_per_row;
    for (int64_t j = threadIdx.x; j < words_per_row; j += blockDim.x) d[j] = s[j];
  }
}

// out[t] (+)= sum_k w[t, k] * rows[position(t, k)], fp32 accumulation in slot order.
template <typename T>
__global__ void CombineKernel(CombineLaunch p) {
  const T* rows = static_cast<const T*>(p.rows);
  T* out = static_cast<T*>(p.out);
  for (int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    for (int64_t j = threadIdx.x; j < p.width; j += blockDim.x) {
      float acc = p.accumulate ? ToFloat(out[t * p.width + j]) : 0.0f;
      for (int k = 0; k < p.top_k; ++k) {
        const int64_t pos = p.copy_position[t * p.top_k + k];
        if (pos < 0) continue;
        const float w = p.weights ? p.weights[t * p.top_k + k] : 1.0f;
        acc += w * ToFloat(rows[pos * p.width + j]);
      }
      out[t * p.width + j] = FromFloat<T>(acc);
    }
  }
}

// d_rows[position(t, k)] = w[t, k] * d_out[t];  d_weights[t, k] = <d_out[t], rows[position]>.
template <typename T>
__global__ void CombineBackwardKernel(CombineLaunch p) {
  __shared__ float scratch[32];
  const T* rows = static_cast<const T*>(p.rows);
  const T* dout = static_cast<const T*>(p.d_out);
  T* drows = static_cast<T*>(p.d_rows);
  for (int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    for (int k = 0; k < p.top_k; ++k) {
      const int64_t pos = p.copy_position[t * p.top_k + k];
      if (pos < 0) {
        if (threadIdx.x == 0 && p.d_weights) p.d_weights[t * p.top_k + k] = 0.0f;
        continue;
      }
      const float w = p.weights ? p.weights[t * p.top_k + k] : 1.0f;
      float dot = 0.0f;
      for (int64_t j = threadIdx.x; j < p.width; j += blockDim.x) {
        const float g = ToFloat(dout[t * p.width + j]);
        if (p.d_weights) dot += g * ToFloat(rows[pos * p.width + j]);
        drows[pos * p.width + j] = FromFloat<T>(w * g);
      }
      if (p.d_weights) {
        dot = BlockSum(dot, scratch);
        if (threadIdx.x == 0) p.d_weights[t * p.top_k + k] = dot;
      }
    }
  }
}

}  // namespace

cudaError_t LaunchPermutePlan(const PermutePlanLaunch& l) {
  const int chunks = static_cast<int>((l.copies + kPermuteChunk - 1) / kPermuteChunk);
  cudaError_t err = cudaMemsetAsync(l.permuted_copy, 0xff, sizeof(int64_t) * l.copies, l.stream);
  if (err != cudaSuccess) return err;
  if (chunks > 0) ChunkHistogramKernel<<<chunks, kPermuteChunk, 0, l.stream>>>(l);
  ScanKernel<<<1, 1024, 0, l.stream>>>(l, chunks);
  if (chunks > 0) ScatterKernel<<<chunks, kPermuteChunk, 0, l.stream>>>(l);
  return cudaGetLastError();
}

cudaError_t LaunchPermuteRows(const PermuteRowsLaunch& l) {
  if (l.copies == 0 || l.width == 0) return cudaSuccess;
  const int64_t row_bytes = l.width * l.elem_bytes;
  const auto aligned = [](const void* ptr, int a) {
    return reinterpret_cast<uintptr_t>(ptr) % a == 0;
  };
  if (row_bytes % 16 == 0 && aligned(l.src, 16) && aligned(l.dst, 16)) {
    GatherKernel<uint4><<<l.num_blocks, 128, 0, l.stream>>>(l, row_bytes / 16);
  } else if (row_bytes % 4 == 0 && aligned(l.src, 4) && aligned(l.dst, 4)) {
    GatherKernel<uint32_t><<<l.num_blocks, 128, 0, l.stream>>>(l, row_bytes / 4);
  } else {
    GatherKernel<uint8_t><<<l.num_blocks, 128, 0, l.stream>>>(l, row_bytes);
  }
  return cudaGetLastError();
}

cudaError_t LaunchCombine(const CombineLaunch& l) {
  if (l.tokens == 0) return cudaSuccess;
  if (l.bf16)
    CombineKernel<__nv_bfloat16><<<l.num_blocks, 128, 0, l.stream>>>(l);
  else
    CombineKernel<float><<<l.num_blocks, 128, 0, l.stream>>>(l);
  return cudaGetLastError();
}

cudaError_t LaunchCombineBackward(const CombineLaunch& l) {
  if (l.tokens == 0) return cudaSuccess;
  if (l.bf16)
    CombineBackwardKernel<__nv_bfloat16><<<l.num_blocks, 128, 0, l.stream>>>(l);
  else
    CombineBackwardKernel<float><<<l.num_blocks, 128, 0, l.stream>>>(l);
  return cudaGetLastError();
}

}  // namespace gradsum::moe::cuda_internal
