#ifndef GRADSUM_MOE_CUDA_PERMUTE_KERNELS_H_
#define GRADSUM_MOE_CUDA_PERMUTE_KERNELS_H_

// Internal launch interface of the token permutation CUDA kernels (nvcc side; no absl).
// Use moe/cuda/permute_cuda.h.

#include <cuda_runtime.h>

#include <cstdint>

namespace gradsum::moe::cuda_internal {

constexpr int kMaxPermuteExperts = 1024;  // per-block shared-memory histograms

struct PermutePlanLaunch {
  const int32_t* expert_index = nullptr;  // [copies]
  int64_t copies = 0;                     // T * K
  int experts = 0;
  int64_t* expert_offsets = nullptr;  // [E + 1]
  int64_t* permuted_copy = nullptr;   // [copies], prefilled with -1 by the launcher
  int64_t* copy_position = nullptr;   // [copies]
  int* chunk_counts = nullptr;        // [chunks, E] scratch
  unsigned long long* bad_copy = nullptr;
  cudaStream_t stream = nullptr;
};
constexpr int kPermuteChunk = 256;

cudaError_t LaunchPermutePlan(const PermutePlanLaunch& l);

struct PermuteRowsLaunch {
  const void* src = nullptr;  // [T, width] (gather) ; [capacity, width] rows
  void* dst = nullptr;
  int64_t width = 0;  // elements per row
  int elem_bytes = 0;
  int top_k = 0;
  int64_t copies = 0;  // capacity T * K
  int experts = 0;
  const int64_t* permuted_copy = nullptr;
  const int64_t* expert_offsets = nullptr;  // [E + 1]; offsets[E] = routed copies S
  int num_blocks = 0;
  cudaStream_t stream = nullptr;
};

cudaError_t LaunchPermuteRows(const PermuteRowsLaunch& l);

struct CombineLaunch {
  bool bf16 = false;
  int64_t tokens = 0;
  int top_k = 0;
  int64_t width = 0;
  const int64_t* copy_position = nullptr;  // [T, K]
  const float* weights = nullptr;          // [T, K] or null (1)
  const void* rows = nullptr;              // [capacity, width] permuted rows (expert outputs)
  void* out = nullptr;                     // [T, width] (forward)
  bool accumulate = false;
  const void* d_out = nullptr;  // [T, width] (backward)
  void* d_rows = nullptr;       // [capacity, width] (backward)
  float* d_weights = nullptr;   // [T, K] (backward) or null
  int num_blocks = 0;
  cudaStream_t stream = nullptr;
};

cudaError_t LaunchCombine(const CombineLaunch& l);
cudaError_t LaunchCombineBackward(const CombineLaunch& l);

}  // namespace gradsum::moe::cuda_internal

#endif  // GRADSUM_MOE_CUDA_PERMUTE_KERNELS_H_
