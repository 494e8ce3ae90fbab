#ifndef GRADSUM_MOE_CUDA_PERMUTE_CUDA_H_
#define GRADSUM_MOE_CUDA_PERMUTE_CUDA_H_

// Token permutation for dropless MoE dispatch on a CUDA device (SEMANTICS.md §10).
//
// The K copies c = t * K + k of the tokens are ordered by expert, and within an expert by
// copy index (a stable counting sort: the order of moe/dispatch.cc's send buffer, so
// rows for EP rank r are one contiguous range). Sizes stay on the device: the number of
// routed copies S = expert_offsets[E] is never read back, buffers are sized for T * K.
//
//   PermutePlanCudaArgs plan;
//   plan.expert_index = idx; plan.tokens = T; plan.top_k = K; plan.experts = E;
//   plan.expert_offsets = offs; plan.permuted_copy = perm; plan.copy_position = pos;
//   GRADSUM_RETURN_IF_ERROR(PermutePlanCuda(plan, stream));
//   // gather a [T, D] into send [T*K, D] (rows >= S untouched)
//   GRADSUM_RETURN_IF_ERROR(PermuteRowsCuda({a, DType::kBF16, D, send}, plan, stream));
//   ... experts: rows offs[e]..offs[e+1] belong to expert e ...
//   // y[t] = sum_k w_tk * out[pos(t, k)]
//   CombineCudaArgs cmb{...}; GRADSUM_RETURN_IF_ERROR(CombineCuda(cmb, plan, stream));
//
// Backward: CombineBackwardCuda gives d_out rows (w * dy) and dL/dw; the gather's backward
// is CombineCuda with weights == nullptr and accumulate = true (d_a += sum_k d_send[pos]).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "core/cuda/device_flag.h"
#include "core/dtype.h"

namespace gradsum::moe {

struct PermutePlanCudaArgs {
  const int32_t* expert_index = nullptr;  // [T, K] in [0, E) or -1 (not routed)
  int64_t tokens = 0;                     // T >= 0, T * K < 2^31
  int top_k = 0;                          // K >= 1
  int experts = 0;                        // 1 <= E <= 1024
  // Outputs (device).
  int64_t* expert_offsets = nullptr;  // [E + 1] exclusive prefix sums; [E] = S
  int64_t* permuted_copy = nullptr;   // [T * K] position -> copy c; -1 at positions >= S
  int64_t* copy_position = nullptr;   // [T * K] copy -> position, -1 when not routed
  // Where an expert index outside [-1, E) is recorded (lowest copy). Null: the call waits
  // and returns InvalidArgument itself.
  cuda::DeviceIndexFlag* error = nullptr;
};

// Errors: InvalidArgument for bad sizes or null / non-device pointers (named), and (with
// error == nullptr) for an expert index outside [-1, E) naming token and slot;
// FailedPrecondition without a usable GPU.
absl::Status PermutePlanCuda(const PermutePlanCudaArgs& args, cudaStream_t stream);

struct PermuteRowsCudaArgs {
  const void* src = nullptr;  // [T, width] token rows (any dtype; copied bit for bit)
  DType dtype = DType::kF32;
  int64_t width = 0;    // elements per row >= 0
  void* dst = nullptr;  // [T * K, width]; position p gets token permuted_copy[p] / K
};

// Gathers rows into permuted order using a plan made by PermutePlanCuda (same T, K, E).
absl::Status PermuteRowsCuda(const PermuteRowsCudaArgs& args, const PermutePlanCudaArgs& plan,
                             cudaStream_t stream);

struct CombineCudaArgs {
  DType dtype = DType::kF32;       // kF32 or kBF16, of rows / out / d_out / d_rows
  int64_t width = 0;               // D
  const void* rows = nullptr;      // [T * K, D] permuted rows (expert outputs)
  const float* weights = nullptr;  // [T, K] combine weights, or null (all 1)
  void* out = nullptr;             // [T, D] forward output
  bool accumulate = false;         // out += instead of =
  const void* d_out = nullptr;     // backward: [T, D] dL/d out
  void* d_rows = nullptr;          // backward: [T * K, D] dL/d rows (positions >= S untouched)
  float* d_weights = nullptr;      // backward: [T, K] dL/dw (0 for unrouted copies), optional
};

// out[t] (+)= sum_k w[t, k] * rows[copy_position[t * K + k]], fp32 accumulation in slot order.
absl::Status CombineCuda(const CombineCudaArgs& args, const PermutePlanCudaArgs& plan,
                         cudaStream_t stream);

// d_rows[pos(t, k)] = w[t, k] * d_out[t]; d_weights[t, k] = <d_out[t], rows[pos(t, k)]>.
absl::Status CombineBackwardCuda(const CombineCudaArgs& args, const PermutePlanCudaArgs& plan,
                                 cudaStream_t stream);

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_CUDA_PERMUTE_CUDA_H_
