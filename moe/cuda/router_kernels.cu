// Router kernels (SEMANTICS.md §4, §5, §10): softmax over E experts, top-K by p with ties to
// the lower expert index, renormalisation and router_scale, routing statistics; the z-loss
// and load-balancing loss values and the full gradient with respect to the router logits.
// One warp per token; each lane holds experts lane, lane + 32, ... (PL per lane).
// §5.1: sigmoid scores p = sigmoid(u) in place of the softmax, and an expert bias b added
// to the scores for the top-K selection only (the weights w_k are of the unbiased p).

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "core/cuda/device_math.cuh"
#include "moe/cuda/router_kernels.h"

namespace gradsum::moe::cuda_internal {
namespace {

using cuda_device::BlockSum;
using cuda_device::WarpMax;
using cuda_device::WarpSum;

constexpr int kWarpsPerBlock = 8;

// sigmoid(x) = 1 / (1 + exp(-x)) from exp(-|x|) <= 1, so nothing overflows (as
// core/vec_math.h computes it on the CPU).
__device__ __forceinline__ float Sigmoid(float x) {
  const float e = expf(-fabsf(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// RouterForwardKernel's phases, for one token t on one warp (lane = this thread's lane;
// each lane holds experts lane, lane + 32, ..., PL of them).

// A padding token (mask != 1): not routed (§1); zeros and index -1, like the CPU router.
template <int PL>
__device__ __forceinline__ void WritePaddingToken(const RouterForwardLaunch& p, int64_t t, int lane,
                                                  float* prow) {
  const int E = p.experts, K = p.top_k;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int e = lane + 32 * i;
    if (e < E) prow[e] = 0.0f;
  }
  if (lane < K) {
    p.expert_index[t * K + lane] = -1;
    p.combine_weight[t * K + lane] = 0.0f;
  }
  if (lane == 0 && p.logsumexp) p.logsumexp[t] = 0.0f;
}

// Loads the token's logits into u (-inf past E) and returns the warp's max. A non-finite
// logit is reported in bad_token and read as 0 (max 0), to keep the outputs finite; the
// call then returns InvalidArgument.
template <int PL>
__device__ __forceinline__ float LoadLogits(const RouterForwardLaunch& p, int64_t t, int lane,
                                            float (&u)[PL]) {
  const int E = p.experts;
  bool bad = false;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int e = lane + 32 * i;
    u[i] = e < E ? p.logits[t * E + e] : -INFINITY;
    if (e < E && !isfinite(u[i])) bad = true;
    mx = fmaxf(mx, u[i]);
  }
  if (__any_sync(0xffffffffu, bad)) {
    if (lane == 0) atomicMin(p.bad_token, static_cast<unsigned long long>(t));
    mx = 0.0f;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      if (!isfinite(u[i]) && lane + 32 * i < E) u[i] = 0.0f;
    }
  }
  return WarpMax(mx);
}

// The scores pr (softmax of u, or sigmoid §5.1), written to prow, and the token's lse.
template <int PL>
__device__ __forceinline__ void ComputeScores(const RouterForwardLaunch& p, int64_t t, int lane,
                                              const float (&u)[PL], float mx, float (&pr)[PL],
                                              float* prow) {
  const int E = p.experts;
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < PL; ++i) s += expf(u[i] - mx);
  s = WarpSum(s);
  const float inv_s = 1.0f / s;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int e = lane + 32 * i;
    // Sigmoid scores (§5.1) are per expert; the softmax statistics above still give the
    // z-loss's lse, which is of the logits whatever the scores.
    pr[i] = p.sigmoid ? (e < E ? Sigmoid(u[i]) : 0.0f) : expf(u[i] - mx) * inv_s;
    if (e < E) prow[e] = pr[i];
  }
  if (lane == 0 && p.logsumexp) p.logsumexp[t] = mx + logf(s);
}

// Top-K by the key (p, or p + b with the expert bias, §5.1, the sum in fp32): K rounds of
// a warp argmax; equal keys -> lower expert index. The winner's unbiased p travels with it
// (bp): the weights are of p, never of the key. Lane k < K gets slot k's expert and p in
// my_e, my_p; returns the sum of the picked p (the same on every lane).
template <int PL>
__device__ __forceinline__ float SelectTopK(const RouterForwardLaunch& p, int lane,
                                            const float (&pr)[PL], int* my_e, float* my_p) {
  const int E = p.experts, K = p.top_k;
  float key[PL];
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int e = lane + 32 * i;
    key[i] = (p.expert_bias != nullptr && e < E) ? pr[i] + p.expert_bias[e] : pr[i];
  }
  bool taken[PL];
#pragma unroll
  for (int i = 0; i < PL; ++i) taken[i] = false;
  float picked_sum = 0.0f;
  for (int k = 0; k < K; ++k) {
    float bv = -INFINITY, bp = 0.0f;  // every finite key beats it
    int be = INT_MAX;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !taken[i] && (key[i] > bv || (key[i] == bv && e < be))) {
        bv = key[i];
        bp = pr[i];
        be = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const float op = __shfl_xor_sync(0xffffffffu, bp, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ov > bv || (ov == bv && oe < be)) {
        bv = ov;
        bp = op;
        be = oe;
      }
    }
    if (be >= E) be = 0;  // unreachable with finite keys; never index out of range
    if ((be & 31) == lane) {
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        if (i == (be >> 5)) taken[i] = true;
      }
    }
    if (lane == k) {
      *my_e = be;
      *my_p = bp;
    }
    picked_sum += bp;
  }
  return picked_sum;
}

template <int PL>
__global__ void RouterForwardKernel(RouterForwardLaunch p) {
  __shared__ int hist[kMaxCudaExperts];
  __shared__ int routed_in_block;
  const int E = p.experts, K = p.top_k;
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  if (threadIdx.x == 0) routed_in_block = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = warp; t < p.tokens; t += warp_stride) {
    const uint8_t m = p.mask ? p.mask[t] : 1;
    if (m > 1 && lane == 0) atomicMin(p.bad_token, static_cast<unsigned long long>(t));
    float* prow = p.probs + t * E;
    if (m != 1) {
      WritePaddingToken<PL>(p, t, lane, prow);
      continue;
    }
    float u[PL];
    const float mx = LoadLogits<PL>(p, t, lane, u);
    float pr[PL];
    ComputeScores<PL>(p, t, lane, u, mx, pr, prow);
    int my_e = -1;
    float my_p = 0.0f;
    const float picked_sum = SelectTopK<PL>(p, lane, pr, &my_e, &my_p);
    if (lane < K) {
      float w = my_p;
      // Sigmoid scores or a bias may pick scores that all round to 0: weights 0, not NaN
      // (as the CPU router). The unbiased softmax always has picked_sum >= 1 / E > 0.
      if (p.norm_topk_prob) w = picked_sum > 0.0f ? w / picked_sum : 0.0f;
      w *= p.router_scale;
      p.expert_index[t * K + lane] = my_e;
      p.combine_weight[t * K + lane] = w;
      atomicAdd(&hist[my_e], 1);
    }
    if (lane == 0) atomicAdd(&routed_in_block, 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (hist[e] != 0) atomicAdd(&p.expert_counts[e], static_cast<unsigned long long>(hist[e]));
  }
  if (threadIdx.x == 0 && routed_in_block != 0) {
    atomicAdd(p.routed_tokens, static_cast<unsigned long long>(routed_in_block));
  }
}

// gating_partials[chunk, e] = sum of probs[t, e] over the chunk's tokens (padding rows
// of probs are 0), in a fixed order; block (32 experts x 8 token lanes).
__global__ void GatingPartialsKernel(RouterForwardLaunch p) {
  __shared__ double acc[8][33];
  const int e = blockIdx.x * 32 + threadIdx.x;
  const int64_t per_chunk = (p.tokens + p.gating_chunks - 1) / p.gating_chunks;
  const int64_t begin = blockIdx.y * per_chunk;
  const int64_t end = begin + per_chunk < p.tokens ? begin + per_chunk : p.tokens;
  double s = 0.0;
  if (e < p.experts) {
    for (int64_t t = begin + threadIdx.y; t < end; t += 8) s += p.probs[t * p.experts + e];
  }
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && e < p.experts) {
    double total = 0.0;
    for (int y = 0; y < 8; ++y) total += acc[y][threadIdx.x];
    p.gating_partials[static_cast<int64_t>(blockIdx.y) * p.experts + e] = total;
  }
}

__global__ void GatingSumKernel(RouterForwardLaunch p) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.experts) return;
  double s = 0.0;
  for (int c = 0; c < p.gating_chunks; ++c)
    s += p.gating_partials[static_cast<int64_t>(c) * p.experts + e];
  p.gating_sums[e] = s;
}

// §4: sum over routed tokens of lse^2, per block (thread 0 keeps the block's sum).
__global__ void ZLossPartialsKernel(RouterAuxLaunch p) {
  __shared__ double scratch[32];
  double s = 0.0;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < p.tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (p.mask == nullptr || p.mask[t] == 1) {
      const double l = p.logsumexp[t];
      s += l * l;
    }
  }
  s = BlockSum(s, scratch);
  if (threadIdx.x == 0) p.partials[blockIdx.x] = s;
}

// Finalises both aux losses in one thread block: z = alpha_z * sum lse^2 / N (§4);
// bal = alpha_b / G * E * sum_e c_e / (N_lm K) * gating_sum_e / N_lm (§5), 0 when N_lm == 0.
__global__ void AuxLossFinaliseKernel(RouterAuxLaunch p) {
  __shared__ double scratch[32];
  double z = 0.0;
  for (int b = threadIdx.x; b < p.num_blocks; b += blockDim.x) z += p.partials[b];
  z = BlockSum(z, scratch);
  double csum = 0.0;
  for (int e = threadIdx.x; e < p.experts; e += blockDim.x)
    csum += static_cast<double>(p.global_expert_counts[e]);
  csum = BlockSum(csum, scratch);
  const double n_lm = csum / p.top_k;
  double bal = 0.0;
  if (n_lm > 0.0) {
    for (int e = threadIdx.x; e < p.experts; e += blockDim.x) {
      bal += static_cast<double>(p.global_expert_counts[e]) / (n_lm * p.top_k) *
             p.local_gating_sums[e];
    }
  }
  bal = BlockSum(bal, scratch);
  if (threadIdx.x == 0) {
    const double n_z = *p.global_routed_tokens;
    const double z_loss = n_z > 0.0 ? p.alpha_z * z / n_z : 0.0;
    const double bal_loss =
        n_lm > 0.0 ? static_cast<double>(p.alpha_b) / p.num_micro_batches * p.experts * bal / n_lm
                   : 0.0;
    if (p.accumulate) {
      *p.z_loss += z_loss;
      *p.balance_loss += bal_loss;
    } else {
      *p.z_loss = z_loss;
      *p.balance_loss = bal_loss;
    }
  }
}

template <int PL>
__global__ void RouterBackwardKernel(RouterAuxLaunch p) {
  __shared__ float coef[kMaxCudaExperts];  // dL_bal / dp[e] for every routed token (§5)
  __shared__ double csum_scratch[32];
  const int E = p.experts, K = p.top_k;
  double csum = 0.0;
  if (p.global_expert_counts != nullptr) {
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      csum += static_cast<double>(p.global_expert_counts[e]);
  }
  csum = BlockSum(csum, csum_scratch);
  const double n_lm = csum / K;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    coef[e] =
        (n_lm > 0.0 && p.alpha_b != 0.0f)
            ? static_cast<float>(static_cast<double>(p.alpha_b) / p.num_micro_batches * E *
                                 static_cast<double>(p.global_expert_counts[e]) / (n_lm * n_lm * K))
            : 0.0f;
  }
  __syncthreads();
  const double n_z = p.global_routed_tokens ? *p.global_routed_tokens : 0.0;
  const float z_coef =
      (n_z > 0.0 && p.alpha_z != 0.0f) ? static_cast<float>(2.0 * p.alpha_z / n_z) : 0.0f;

  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = warp; t < p.tokens; t += warp_stride) {
    float* drow = p.d_logits + t * E;
    const bool routed = p.mask == nullptr || p.mask[t] == 1;
    if (!routed) {
      if (!p.accumulate) {
#pragma unroll
        for (int i = 0; i < PL; ++i) {
          if (lane + 32 * i < E) drow[lane + 32 * i] = 0.0f;
        }
      }
      continue;
    }
    const float* prow = p.probs + t * E;
    // Gradient through the combine weights: lane k holds slot k.
    int my_e = -1;
    float my_dw = 0.0f, my_p = 0.0f;
    if (p.d_combine_weight != nullptr && lane < K) {
      my_e = p.expert_index[t * K + lane];
      if (my_e >= 0 && my_e < E) {
        my_dw = p.d_combine_weight[t * K + lane];
        my_p = prow[my_e];
      }
    }
    const float picked = WarpSum(my_p);
    const float dw_p = WarpSum(my_dw * my_p);
    // dL/dp[i_k]: s * dw_k (plain) or s * (dw_k / S - sum_j dw_j p_j / S^2) (renormalised;
    // S = 0, whose forward weights were 0, has no gradient, as on the CPU).
    const float my_dp =
        p.norm_topk_prob
            ? (picked > 0.0f ? p.router_scale * (my_dw / picked - dw_p / (picked * picked)) : 0.0f)
            : p.router_scale * my_dw;
    float pr[PL], dp[PL];
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int e = lane + 32 * i;
      pr[i] = e < E ? prow[e] : 0.0f;
      dp[i] = e < E ? coef[e] : 0.0f;
    }
    if (p.d_combine_weight != nullptr) {
      for (int k = 0; k < K; ++k) {
        const int ek = __shfl_sync(0xffffffffu, my_e, k);
        const float dk = __shfl_sync(0xffffffffu, my_dp, k);
#pragma unroll
        for (int i = 0; i < PL; ++i) {
          if (lane + 32 * i == ek) dp[i] += dk;
        }
      }
    }
    const float lse = p.logsumexp ? p.logsumexp[t] : 0.0f;
    if (p.sigmoid) {
      // Sigmoid scores (§5.1): du_e = p_e (1 - p_e) dp_e, no coupling between experts. The
      // z-loss is of the logits: d(alpha_z lse^2 / N)/du_e = 2 alpha_z lse softmax(u)_e / N,
      // the softmax from the kept logits and lse.
      const float* urow = p.logits + t * E;
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        const int e = lane + 32 * i;
        if (e >= E) continue;
        float g = pr[i] * (1.0f - pr[i]) * dp[i];
        if (z_coef != 0.0f) g += z_coef * lse * expf(urow[e] - lse);
        drow[e] = p.accumulate ? drow[e] + g : g;
      }
      continue;
    }
#pragma unroll
    for (int i = 0; i < PL; ++i) dot += pr[i] * dp[i];
    dot = WarpSum(dot);
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int e = lane + 32 * i;
      if (e >= E) continue;
      // Softmax Jacobian, plus the z-loss term d(alpha_z lse^2 / N)/du = 2 alpha_z lse p / N.
      const float g = pr[i] * (dp[i] - dot) + z_coef * lse * pr[i];
      drow[e] = p.accumulate ? drow[e] + g : g;
    }
  }
}

int LanesFor(int experts) { return (experts + 31) / 32; }

template <int PL>
void LaunchForwardPL(const RouterForwardLaunch& l) {
  const int threads = 32 * kWarpsPerBlock;
  const int grid = cuda_device::ResidentGrid(RouterForwardKernel<PL>, threads, l.num_blocks);
  RouterForwardKernel<PL><<<grid, threads, 0, l.stream>>>(l);
}

template <int PL>
void LaunchBackwardPL(const RouterAuxLaunch& l) {
  const int threads = 32 * kWarpsPerBlock;
  const int grid = cuda_device::ResidentGrid(RouterBackwardKernel<PL>, threads, l.num_blocks);
  RouterBackwardKernel<PL><<<grid, threads, 0, l.stream>>>(l);
}

}  // namespace

cudaError_t LaunchRouterForward(const RouterForwardLaunch& l) {
  if (l.tokens > 0) {
    const int pl = LanesFor(l.experts);
    if (pl <= 1)
      LaunchForwardPL<1>(l);
    else if (pl <= 2)
      LaunchForwardPL<2>(l);
    else if (pl <= 4)
      LaunchForwardPL<4>(l);
    else if (pl <= 8)
      LaunchForwardPL<8>(l);
    else if (pl <= 16)
      LaunchForwardPL<16>(l);
    else
      LaunchForwardPL<32>(l);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (l.gating_sums != nullptr) {
    if (l.tokens > 0) {
      GatingPartialsKernel<<<dim3((l.experts + 31) / 32, l.gating_chunks), dim3(32, 8), 0,
                             l.stream>>>(l);
      GatingSumKernel<<<(l.experts + 255) / 256, 256, 0, l.stream>>>(l);
    } else {
      cudaMemsetAsync(l.gating_sums, 0, sizeof(double) * l.experts, l.stream);
    }
  }
  return cudaGetLastError();
}

cudaError_t LaunchRouterAuxLoss(const RouterAuxLaunch& l) {
  ZLossPartialsKernel<<<l.num_blocks, 256, 0, l.stream>>>(l);
  AuxLossFinaliseKernel<<<1, 256, 0, l.stream>>>(l);
  return cudaGetLastError();
}

cudaError_t LaunchRouterBackward(const RouterAuxLaunch& l) {
  if (l.tokens == 0) return cudaSuccess;
  const int pl = LanesFor(l.experts);
  if (pl <= 1)
    LaunchBackwardPL<1>(l);
  else if (pl <= 2)
    LaunchBackwardPL<2>(l);
  else if (pl <= 4)
    LaunchBackwardPL<4>(l);
  else if (pl <= 8)
    LaunchBackwardPL<8>(l);
  else if (pl <= 16)
    LaunchBackwardPL<16>(l);
  else
    LaunchBackwardPL<32>(l);
  return cudaGetLastError();
}

}  // namespace gradsum::moe::cuda_internal
