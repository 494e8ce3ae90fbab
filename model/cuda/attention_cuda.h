#ifndef GRADSUM_MODEL_CUDA_ATTENTION_CUDA_H_
#define GRADSUM_MODEL_CUDA_ATTENTION_CUDA_H_

// The attention of model/attention.h on the GPU: the same dims, layouts, mask and outputs,
// with device pointers, fp32, enqueued on `stream`.
//
//   GRADSUM_RETURN_IF_ERROR(AttentionForwardCuda(dims, q, k, v, doc_start, out, lse, stream));
//   GRADSUM_RETURN_IF_ERROR(AttentionBackwardCuda(dims, q, k, v, doc_start, out, lse, d_out,
//                                                 dq, dk, dv, stream));
//
// How it computes (flash-attention style, model/cuda/attention_cuda.cu): a thread block
// per 64 queries of one (sequence, query head) runs an online softmax over 64-key tiles,
// from the tile holding the block's earliest document start to its last query; a tile in
// which the document-causal mask hides every (query, key) pair is skipped. Backward is two
// kernels: dq per query tile (recomputing the probabilities from lse), and dk / dv per key
// tile of one kv head, over that kv head's query heads in ascending order and the query
// tiles in order. Every sum has a fixed order and nothing uses atomics: the results are the
// same bits from run to run (not the CPU kernel's bits; fp32 rounding apart, the same
// values). Scratch (backward: [T, q_heads] floats) comes from cudaMallocAsync on `stream`.
//
// Errors: those of model/attention.h for dims (InvalidArgument naming the value), and
// InvalidArgument for head_dim > 128 or q_heads > 256 (the kernels' limits); a null or
// host pointer is InvalidArgument naming it; no usable device is FailedPrecondition.
// doc_start is checked on the device: with `error == nullptr` the call waits for the
// stream and returns the CPU kernel's InvalidArgument for the first bad token (and
// computes nothing); with a flag it records the first bad token index there and computes
// anyway (a bad value counts as padding; the outputs are then meaningless, but every access
// stays in bounds), and the caller reads the flag later (DeviceIndexFlag::ReadAndReset).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "core/cuda/device_flag.h"
#include "model/attention.h"

namespace gradsum::model {

inline constexpr int64_t kAttentionCudaMaxHeadDim = 128;
inline constexpr int kAttentionCudaMaxHeads = 256;

absl::Status AttentionForwardCuda(const AttentionDims& dims, const float* q, const float* k,
                                  const float* v, const int32_t* doc_start, float* out, float* lse,
                                  cudaStream_t stream, cuda::DeviceIndexFlag* error = nullptr);

// Writes (does not accumulate) dq, dk, dv; out and lse as AttentionForwardCuda returned them.
absl::Status AttentionBackwardCuda(const AttentionDims& dims, const float* q, const float* k,
                                   const float* v, const int32_t* doc_start, const float* out,
                                   const float* lse, const float* d_out, float* dq, float* dk,
                                   float* dv, cudaStream_t stream,
                                   cuda::DeviceIndexFlag* error = nullptr);

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_CUDA_ATTENTION_CUDA_H_
