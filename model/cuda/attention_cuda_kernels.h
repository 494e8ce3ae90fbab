#ifndef GRADSUM_MODEL_CUDA_ATTENTION_CUDA_KERNELS_H_
#define GRADSUM_MODEL_CUDA_ATTENTION_CUDA_KERNELS_H_

// Internal to model/cuda/attention_cuda: the launch side of the attention kernels
// (attention_cuda.cu), without absl, so nvcc compiles it. The arguments are checked by
// attention_cuda.cc before any launch.

#include <cuda_runtime.h>

#include <cstdint>

namespace gradsum::model::cuda_internal {

inline constexpr int kAttentionMaxHeads = 256;  // q_heads and kv_heads
inline constexpr int kAttentionMaxHeadDim = 128;

// Everything the kernels read, by value (about 3 KiB, under the 4 KiB parameter limit).
struct AttentionCudaParams {
  int64_t num_seqs = 0;
  int64_t seq_len = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  float scale = 0;
  const float* q = nullptr;  // [T, q_heads, head_dim]
  const float* k = nullptr;  // [T, kv_heads, head_dim]
  const float* v = nullptr;
  const int32_t* doc_start = nullptr;  // [T]
  // Forward only: written.
  float* out = nullptr;  // [T, q_heads, head_dim]
  float* lse = nullptr;  // [T, q_heads]
  // Backward only: the forward's out and lse (read), d_out; dq, dk, dv written.
  const float* fwd_out = nullptr;
  const float* fwd_lse = nullptr;
  const float* d_out = nullptr;
  float* dq = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  float* dsum = nullptr;  // scratch [T, q_heads]: d_out . out per row
  int kv_of_q[kAttentionMaxHeads] = {};
  // The query heads of kv head g, ascending: heads[heads_begin[g] .. heads_begin[g + 1]).
  int heads_begin[kAttentionMaxHeads + 1] = {};
  int heads[kAttentionMaxHeads] = {};
};

// Records in *flag (atomicMin) the lowest token index whose doc_start is neither -1, nor
// its own position, nor its predecessor's value, or outside [0, position].
cudaError_t LaunchAttentionCheckDocStart(const int32_t* doc_start, int64_t num_seqs,
                                         int64_t seq_len, unsigned long long* flag,
                                         cudaStream_t stream);

// Writes p.out and p.lse.
cudaError_t LaunchAttentionForward(const AttentionCudaParams& p, cudaStream_t stream);

// Writes p.dq, p.dk, p.dv; p.dsum must point at T * q_heads floats of scratch.
cudaError_t LaunchAttentionBackward(const AttentionCudaParams& p, cudaStream_t stream);

}  // namespace gradsum::model::cuda_internal

#endif  // GRADSUM_MODEL_CUDA_ATTENTION_CUDA_KERNELS_H_
