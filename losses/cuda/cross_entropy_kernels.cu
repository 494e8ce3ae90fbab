// Fused cross-entropy forward + backward on the GPU (SEMANTICS.md §3).
//
// One thread block per row (grid-stride over rows). Pass 1 reads the row once and keeps
// an online logsumexp (max, sum of exp) per thread, merged across the block. Pass 2 reads
// the row again and writes the gradient (w_t / D) * grad_scale * (softmax - onehot), so
// the logits are read twice and the gradient written once: the "3-pass" byte count. The
// gradient may overwrite the logits (each element is read before it is written by the
// same thread). All math is fp32; per-row losses are summed in fp64 per block and the
// block partials are added by one block in a fixed order, so the loss is deterministic.
//
// D is read from device memory (no host sync): D == 0 gives loss 0 and zero gradients.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/device_math.cuh"
#include "losses/cuda/cross_entropy_kernels.h"

namespace gradsum::losses::cuda_internal {
namespace {

using cuda_device::BlockMaxSum;
using cuda_device::BlockSum;
using cuda_device::LoadAsFloat;
using cuda_device::MaxSum;
using cuda_device::MergeMaxSum;
using cuda_device::StoreFromFloat;
using cuda_device::ToFloat;

template <typename T, int kN>
__global__ void CrossEntropyRowKernel(CeLaunch p) {
  __shared__ MaxSum ms_scratch[32];
  __shared__ float row_info[3];  // scale for the gradient, lse, weight (or 0: skip)

  const T* logits = static_cast<const T*>(p.logits);
  T* grad = static_cast<T*>(p.grad_logits);
  const int64_t vocab = p.vocab;
  const int64_t chunks = vocab / kN;  // kN divides vocab (checked by the launcher)

  const double D = *p.global_weight_sum;
  const bool d_ok = D >= 0.0 && D <= 1.7976931348623157e308;  // false for NaN, inf, < 0
  if (!d_ok && blockIdx.x == 0 && threadIdx.x == 0) atomicExch(&p.error->bad_normaliser, 1);

  double block_loss = 0.0;    // thread 0 only
  double block_weight = 0.0;  // thread 0 only

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = logits + row * vocab;
    if (threadIdx.x == 0) {
      const int64_t y = p.labels[row];
      float w = 0.0f;
      if (y != p.ignore_index) {
        if (y < 0 || y >= vocab) {
          atomicMin(&p.error->bad_label_row, static_cast<unsigned long long>(row));
          atomicAdd(&p.error->bad_label_count, 1ull);
        } else {
          w = p.token_weights ? p.token_weights[row] : 1.0f;
          if (!(w >= 0.0f && w <= 3.4028234663852886e38f)) {
            atomicMin(&p.error->bad_weight_row, static_cast<unsigned long long>(row));
            atomicAdd(&p.error->bad_weight_count, 1ull);
            w = 0.0f;
          }
        }
      }
      block_weight += w;
      // D == 0 means every label of the step is ignored: loss 0, gradient exactly 0.
      row_info[2] = (d_ok && D > 0.0) ? w : 0.0f;
    }
    __syncthreads();
    const float w = row_info[2];

    if (w == 0.0f) {
      if (grad != nullptr) {
        T* g = grad + row * vocab;
        float zeros[kN];
#pragma unroll
        for (int i = 0; i < kN; ++i) zeros[i] = 0.0f;
        for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) StoreFromFloat<T, kN>(g + c * kN, zeros);
      }
      if (threadIdx.x == 0 && p.token_loss) p.token_loss[row] = 0.0f;
      __syncthreads();  // row_info is rewritten for the next row
      continue;
    }

    // Pass 1: online logsumexp. A chunk's max first, then one rescale per chunk.
    MaxSum acc{-INFINITY, 0.0f};
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[kN];
      LoadAsFloat<T, kN>(x + c * kN, v);
      float cm = v[0];
#pragma unroll
      for (int i = 1; i < kN; ++i) cm = fmaxf(cm, v[i]);
      float cs = 0.0f;
      if (cm != -INFINITY) {
#pragma unroll
        for (int i = 0; i < kN; ++i) cs += __expf(v[i] - cm);
      }
      // fmaxf drops NaN from the max; make sure a NaN still poisons the sum (then the
      // row is reported as non-finite rather than silently skipped).
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        if (isnan(v[i])) cs = NAN;
      }
      acc = MergeMaxSum(acc, MaxSum{cm, cs});
    }
    const MaxSum total = BlockMaxSum(acc, ms_scratch);
    if (threadIdx.x == 0) {
      const int64_t y = p.labels[row];
      const float lse = total.m + __logf(total.s);
      const float zy = ToFloat(x[y]);
      const float ce = lse - zy;
      const double row_loss = static_cast<double>(w) * static_cast<double>(ce) / D;
      if (!isfinite(ce)) {
        atomicMin(&p.error->nonfinite_row, static_cast<unsigned long long>(row));
        atomicAdd(&p.error->nonfinite_count, 1ull);
      } else {
        block_loss += row_loss;
      }
      if (p.token_loss) p.token_loss[row] = static_cast<float>(row_loss);
      row_info[0] = static_cast<float>(static_cast<double>(w) * p.grad_scale / D);
      row_info[1] = lse;
    }
    __syncthreads();  // z_y is read before any thread overwrites the row (in place)

    if (grad != nullptr) {
      const float scale = row_info[0];
      const float lse = row_info[1];
      const int64_t y = p.labels[row];
      T* g = grad + row * vocab;
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[kN];
        LoadAsFloat<T, kN>(x + c * kN, v);
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          const float prob = __expf(v[i] - lse);
          v[i] = scale * (c * kN + i == y ? prob - 1.0f : prob);
        }
        StoreFromFloat<T, kN>(g + c * kN, v);
      }
    }
    __syncthreads();  // row_info is rewritten for the next row
  }
  if (threadIdx.x == 0) {
    p.partials[2 * blockIdx.x] = block_loss;
    p.partials[2 * blockIdx.x + 1] = block_weight;
  }
}

// One block: adds the per-block partials in a fixed order, checks D against this call's
// weight sum, fills the label of the first bad row.
__global__ void CrossEntropyFinaliseKernel(CeLaunch p) {
  __shared__ double scratch[32];
  double loss = 0.0, weight = 0.0;
  for (int b = threadIdx.x; b < p.num_blocks; b += blockDim.x) {
    loss += p.partials[2 * b];
    weight += p.partials[2 * b + 1];
  }
  loss = BlockSum(loss, scratch);
  weight = BlockSum(weight, scratch);
  if (threadIdx.x == 0) {
    const double D = *p.global_weight_sum;
    // D is a global sum of the same weights (in another order): allow rounding only.
    if (D < weight * (1.0 - 1e-9)) {
      p.error->normaliser_too_small = 1;
      p.error->normaliser = D;
      p.error->local_weight_sum = weight;
    }
    if (p.error->bad_label_row != kNoRow) {
      p.error->bad_label_value = p.labels[p.error->bad_label_row];
    }
    if (p.accumulate) {
      *p.loss += loss;
      if (p.local_weight_sum) *p.local_weight_sum += weight;
    } else {
      *p.loss = loss;
      if (p.local_weight_sum) *p.local_weight_sum = weight;
    }
  }
}

__global__ void ResetRecordKernel(CeErrorRecord* r) {
  r->bad_label_row = kNoRow;
  r->bad_label_count = 0;
  r->bad_label_value = 0;
  r->nonfinite_row = kNoRow;
  r->nonfinite_count = 0;
  r->bad_weight_row = kNoRow;
  r->bad_weight_count = 0;
  r->bad_normaliser = 0;
  r->normaliser_too_small = 0;
  r->normaliser = 0.0;
  r->local_weight_sum = 0.0;
}

// Grid-stride over rows with a grid larger than what is resident would run a partial
// second wave (a register-limited 512-thread block fits 3 times per SM, not 4): size the
// grid to the resident blocks instead.
template <typename Kernel>
cudaError_t LaunchOneWave(Kernel kernel, CeLaunch p) {
  p.num_blocks = cuda_device::ResidentGrid(kernel, p.threads, p.num_blocks);
  if (p.rows > 0) {
    kernel<<<p.num_blocks, p.threads, 0, p.stream>>>(p);
    const cudaError_t launch = cudaGetLastError();
    if (launch != cudaSuccess) return launch;
  }
  CrossEntropyFinaliseKernel<<<1, 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchTyped(const CeLaunch& p) {
  constexpr int kVec = cuda_device::kVec16<T>;
  const auto aligned = [](const void* ptr) {
    return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  };
  const bool vec_ok = p.vocab % kVec == 0 && aligned(p.logits) && aligned(p.grad_logits);
  return vec_ok ? LaunchOneWave(CrossEntropyRowKernel<T, kVec>, p)
                : LaunchOneWave(CrossEntropyRowKernel<T, 1>, p);
}

}  // namespace

cudaError_t LaunchCrossEntropy(const CeLaunch& launch) {
  if (launch.dtype == CeDType::kBF16) return LaunchTyped<__nv_bfloat16>(launch);
  return LaunchTyped<float>(launch);
}

cudaError_t ResetCeErrorRecord(CeErrorRecord* record, cudaStream_t stream) {
  ResetRecordKernel<<<1, 1, 0, stream>>>(record);
  return cudaGetLastError();
}

}  // namespace gradsum::losses::cuda_internal
