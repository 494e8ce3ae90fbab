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
//
// The CE options of SEMANTICS.md §3.2 (label smoothing, logit softcap, output z-loss) run in
// a second row kernel of the same shape, CrossEntropyOptionsRowKernel, so that the plain
// kernel's code and results do not change when they are off.

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

// Both row kernels' per-row prologue. RowWeight (thread 0): the row's CE weight w_t, 0 for
// an ignored label; a label outside [0, vocab) or a weight that is negative, NaN or inf is
// recorded in p.error and weighs 0.
__device__ __forceinline__ float RowWeight(const CeLaunch& p, int64_t row) {
  const int64_t y = p.labels[row];
  if (y == p.ignore_index) return 0.0f;
  if (y < 0 || y >= p.vocab) {
    atomicMin(&p.error->bad_label_row, static_cast<unsigned long long>(row));
    atomicAdd(&p.error->bad_label_count, 1ull);
    return 0.0f;
  }
  const float w = p.token_weights ? p.token_weights[row] : 1.0f;
  if (!(w >= 0.0f && w <= 3.4028234663852886e38f)) {
    atomicMin(&p.error->bad_weight_row, static_cast<unsigned long long>(row));
    atomicAdd(&p.error->bad_weight_count, 1ull);
    return 0.0f;
  }
  return w;
}

// A row of weight 0 (the whole block): gradient exactly 0, token loss 0.
template <typename T, int kN>
__device__ __forceinline__ void SkipRow(const CeLaunch& p, int64_t row, int64_t chunks) {
  if (p.grad_logits != nullptr) {
    T* g = static_cast<T*>(p.grad_logits) + row * p.vocab;
    float zeros[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) zeros[i] = 0.0f;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x)
      StoreFromFloat<T, kN>(g + c * kN, zeros);
  }
  if (threadIdx.x == 0 && p.token_loss) p.token_loss[row] = 0.0f;
}

// One chunk's max, then its sum of exp(v - max): one rescale per chunk when merged. fmaxf
// drops NaN from the max, so a NaN poisons the sum instead (the row is then reported as
// non-finite rather than silently skipped).
template <int kN>
__device__ __forceinline__ MaxSum ChunkMaxSum(const float (&v)[kN]) {
  float cm = v[0];
#pragma unroll
  for (int i = 1; i < kN; ++i) cm = fmaxf(cm, v[i]);
  float cs = 0.0f;
  if (cm != -INFINITY) {
#pragma unroll
    for (int i = 0; i < kN; ++i) cs += __expf(v[i] - cm);
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    if (isnan(v[i])) cs = NAN;
  }
  return MaxSum{cm, cs};
}

// Both kernels: whether D is usable (false for NaN, inf, < 0, which block 0 records).
__device__ __forceinline__ bool NormaliserOk(const CeLaunch& p, double D) {
  const bool ok = D >= 0.0 && D <= 1.7976931348623157e308;
  if (!ok && blockIdx.x == 0 && threadIdx.x == 0) atomicExch(&p.error->bad_normaliser, 1);
  return ok;
}

// Both kernels' start of a row, called by every thread of the block: thread 0 reads the
// row's weight (RowWeight), adds it to *block_weight and shares it through *slot (0 when
// `use_rows` is false); a row of weight 0 is written off (SkipRow) and 0 returned, with the
// block past its last read of *slot.
template <typename T, int kN>
__device__ __forceinline__ float StartRow(const CeLaunch& p, int64_t row, int64_t chunks,
                                          bool use_rows, float* slot, double* block_weight) {
  if (threadIdx.x == 0) {
    const float w = RowWeight(p, row);
    *block_weight += w;
    *slot = use_rows ? w : 0.0f;
  }
  __syncthreads();
  const float w = *slot;
  if (w == 0.0f) {
    SkipRow<T, kN>(p, row, chunks);
    __syncthreads();  // *slot is rewritten for the next row
  }
  return w;
}

template <typename T, int kN>
__global__ void CrossEntropyRowKernel(CeLaunch p) {
  __shared__ MaxSum ms_scratch[32];
  __shared__ float row_info[3];  // scale for the gradient, lse, weight (or 0: skip)

  const T* logits = static_cast<const T*>(p.logits);
  T* grad = static_cast<T*>(p.grad_logits);
  const int64_t vocab = p.vocab;
  const int64_t chunks = vocab / kN;  // kN divides vocab (checked by the launcher)

  const double D = *p.global_weight_sum;
  const bool d_ok = NormaliserOk(p, D);

  double block_loss = 0.0;    // thread 0 only
  double block_weight = 0.0;  // thread 0 only

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = logits + row * vocab;
    // D == 0 means every label of the step is ignored: loss 0, gradient exactly 0.
    const float w = StartRow<T, kN>(p, row, chunks, d_ok && D > 0.0, &row_info[2], &block_weight);
    if (w == 0.0f) continue;

    // Pass 1: online logsumexp. A chunk's max first, then one rescale per chunk.
    MaxSum acc{-INFINITY, 0.0f};
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[kN];
      LoadAsFloat<T, kN>(x + c * kN, v);
      acc = MergeMaxSum(acc, ChunkMaxSum<kN>(v));
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
    p.partials[kCePartialsPerBlock * blockIdx.x] = block_loss;
    p.partials[kCePartialsPerBlock * blockIdx.x + 1] = block_weight;
  }
}

// The logit softcap of SEMANTICS.md §3.2 on one fp32 logit, as the CPU kernel computes it
// (losses/cross_entropy.cc RunOptionsKernel): t = tanh(x / c), z = c t, dz/dx = 1 - t^2.
__device__ __forceinline__ float SoftCap(float x, float c, float* factor) {
  const float t = tanhf(x / c);
  if (factor != nullptr) *factor = 1.0f - t * t;
  return c * t;
}

// The options path (SEMANTICS.md §3.2: label smoothing eps, logit softcap c, output z-loss
// alpha), a kernel of its own so that the plain one above keeps its code and bits. The
// same shape: one block per row, pass 1 an online logsumexp of the capped logits z (and,
// with eps > 0, their row sum U), pass 2 the gradient. Per row, in fp64 from the fp32 block
// sums, as the CPU kernel:
//   lse = m + log S,  CE = (m - z_y) + log S + eps (z_y - U / V)
//   = lse - (1 - eps) z_y - (eps / V) U,  the loss term w (CE + alpha lse^2) / D,
// and per element dL/dx_j = (w / D) grad_scale ((1 + 2 alpha lse) p_j - (1 - eps) [j == y]
// - eps / V), times 1 - tanh^2(x_j / c) with the cap. A row whose CE or lse is not finite
// (NaN or +inf logits without the cap, all -inf, a -inf target, or with eps > 0 a -inf
// anywhere) is reported as non-finite. Block partials: sum w CE, sum w lse^2, sum w.
template <typename T, int kN>
__global__ void CrossEntropyOptionsRowKernel(CeLaunch p) {
  __shared__ MaxSum ms_scratch[32];
  __shared__ double zsum_scratch[32];
  // scale of p_j, lse, offset added to every element, subtracted at the target, weight
  __shared__ float row_info[5];

  const T* logits = static_cast<const T*>(p.logits);
  T* grad = static_cast<T*>(p.grad_logits);
  const int64_t vocab = p.vocab;
  const int64_t chunks = vocab / kN;  // kN divides vocab (checked by the launcher)
  const bool capped = p.logit_softcap > 0.0;
  const float cap = static_cast<float>(p.logit_softcap);
  const double eps = p.label_smoothing;
  const double alpha = p.alpha_lse;

  const double D = *p.global_weight_sum;
  const bool d_ok = NormaliserOk(p, D);

  double block_ce = 0.0;      // thread 0 only
  double block_lse_sq = 0.0;  // thread 0 only
  double block_weight = 0.0;  // thread 0 only

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = logits + row * vocab;
    // D == 0 means every label of the step is ignored: loss 0, gradient exactly 0.
    const float w = StartRow<T, kN>(p, row, chunks, d_ok && D > 0.0, &row_info[4], &block_weight);
    if (w == 0.0f) continue;

    // Pass 1: online logsumexp of the capped logits, and their sum for smoothing.
    MaxSum acc{-INFINITY, 0.0f};
    double zs = 0.0;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[kN];
      LoadAsFloat<T, kN>(x + c * kN, v);
      if (capped) {
#pragma unroll
        for (int i = 0; i < kN; ++i) v[i] = SoftCap(v[i], cap, nullptr);
      }
      acc = MergeMaxSum(acc, ChunkMaxSum<kN>(v));
      if (eps > 0.0) {
#pragma unroll
        for (int i = 0; i < kN; ++i) zs += static_cast<double>(v[i]);
      }
    }
    const MaxSum total = BlockMaxSum(acc, ms_scratch);
    // eps is the same for the whole grid, so every thread of the block takes this branch.
    const double zsum = eps > 0.0 ? BlockSum(zs, zsum_scratch) : 0.0;
    if (threadIdx.x == 0) {
      const int64_t y = p.labels[row];
      float zy = ToFloat(x[y]);
      if (capped) zy = SoftCap(zy, cap, nullptr);
      const double log_sum = log(static_cast<double>(total.s));
      const double lse = static_cast<double>(total.m) + log_sum;
      // (max - z_y) + log S: the difference first, as the CPU kernel.
      double ce = (static_cast<double>(total.m) - static_cast<double>(zy)) + log_sum;
      if (eps > 0.0) ce += eps * (static_cast<double>(zy) - zsum / static_cast<double>(vocab));
      const double wd = static_cast<double>(w);
      if (!isfinite(ce) || !isfinite(lse)) {
        atomicMin(&p.error->nonfinite_row, static_cast<unsigned long long>(row));
        atomicAdd(&p.error->nonfinite_count, 1ull);
      } else {
        block_ce += wd * ce;
        block_lse_sq += wd * lse * lse;
      }
      if (p.token_loss) p.token_loss[row] = static_cast<float>(wd * (ce + alpha * lse * lse) / D);
      const double g = wd * p.grad_scale / D;
      row_info[0] = static_cast<float>(g * (1.0 + 2.0 * alpha * lse));
      row_info[1] = static_cast<float>(lse);
      row_info[2] = static_cast<float>(-g * eps / static_cast<double>(vocab));
      row_info[3] = static_cast<float>(g * (1.0 - eps));
    }
    __syncthreads();  // z_y is read before any thread overwrites the row (in place)

    if (grad != nullptr) {
      const float scale = row_info[0];
      const float lse = row_info[1];
      const float offset = row_info[2];
      const float target = row_info[3];
      const int64_t y = p.labels[row];
      T* g = grad + row * vocab;
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[kN];
        LoadAsFloat<T, kN>(x + c * kN, v);
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          float factor = 1.0f;
          const float z = capped ? SoftCap(v[i], cap, &factor) : v[i];
          float d = scale * __expf(z - lse) + offset;
          if (c * kN + i == y) d -= target;
          v[i] = capped ? d * factor : d;
        }
        StoreFromFloat<T, kN>(g + c * kN, v);
      }
    }
    __syncthreads();  // row_info is rewritten for the next row
  }
  if (threadIdx.x == 0) {
    p.partials[kCePartialsPerBlock * blockIdx.x] = block_ce;
    p.partials[kCePartialsPerBlock * blockIdx.x + 1] = block_lse_sq;
    p.partials[kCePartialsPerBlock * blockIdx.x + 2] = block_weight;
  }
}

// Writes (or adds, with p.accumulate) `value` into an optional device scalar.
__device__ __forceinline__ void Output(double* out, double value, bool accumulate) {
  if (out == nullptr) return;
  if (accumulate) {
    *out += value;
  } else {
    *out = value;
  }
}

// One block: adds the per-block partials in a fixed order, checks D against this call's
// weight sum, fills the label of the first bad row. kOptions: the options kernel's
// partials (CE sum, lse^2 sum, weight), divided by D here; else the plain kernel's (loss
// already divided per row, weight).
template <bool kOptions>
__global__ void CrossEntropyFinaliseKernel(CeLaunch p) {
  __shared__ double scratch[32];
  double loss = 0.0, lse_sq = 0.0, weight = 0.0;
  for (int b = threadIdx.x; b < p.num_blocks; b += blockDim.x) {
    if constexpr (kOptions) {
      loss += p.partials[kCePartialsPerBlock * b];
      lse_sq += p.partials[kCePartialsPerBlock * b + 1];
      weight += p.partials[kCePartialsPerBlock * b + 2];
    } else {
      loss += p.partials[kCePartialsPerBlock * b];
      weight += p.partials[kCePartialsPerBlock * b + 1];
    }
  }
  loss = BlockSum(loss, scratch);
  if constexpr (kOptions) lse_sq = BlockSum(lse_sq, scratch);
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
    if constexpr (kOptions) {
      // As the CPU's local_loss: (sum w CE + alpha sum w lse^2) / D, 0 unless D > 0 (the
      // rows were all skipped then, so the sums are 0 too).
      const bool divide = D > 0.0 && D <= 1.7976931348623157e308;
      const double ce = divide ? loss / D : 0.0;
      const double z_out = divide ? p.alpha_lse * lse_sq / D : 0.0;
      Output(p.loss, divide ? (loss + p.alpha_lse * lse_sq) / D : 0.0, p.accumulate);
      Output(p.ce_loss, ce, p.accumulate);
      Output(p.z_out_loss, z_out, p.accumulate);
    } else {
      Output(p.loss, loss, p.accumulate);
      Output(p.ce_loss, loss, p.accumulate);
      Output(p.z_out_loss, 0.0, p.accumulate);
    }
    Output(p.local_weight_sum, weight, p.accumulate);
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
template <bool kOptions, typename Kernel>
cudaError_t LaunchOneWave(Kernel kernel, CeLaunch p) {
  p.num_blocks = cuda_device::ResidentGrid(kernel, p.threads, p.num_blocks);
  if (p.rows > 0) {
    kernel<<<p.num_blocks, p.threads, 0, p.stream>>>(p);
    const cudaError_t launch = cudaGetLastError();
    if (launch != cudaSuccess) return launch;
  }
  CrossEntropyFinaliseKernel<kOptions><<<1, 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchTyped(const CeLaunch& p) {
  constexpr int kVec = cuda_device::kVec16<T>;
  const auto aligned = [](const void* ptr) {
    return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  };
  const bool vec_ok = p.vocab % kVec == 0 && aligned(p.logits) && aligned(p.grad_logits);
  if (OptionsOn(p)) {
    return vec_ok ? LaunchOneWave<true>(CrossEntropyOptionsRowKernel<T, kVec>, p)
                  : LaunchOneWave<true>(CrossEntropyOptionsRowKernel<T, 1>, p);
  }
  return vec_ok ? LaunchOneWave<false>(CrossEntropyRowKernel<T, kVec>, p)
                : LaunchOneWave<false>(CrossEntropyRowKernel<T, 1>, p);
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
