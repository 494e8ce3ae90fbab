#ifndef GRADSUM_MODEL_CUDA_MODEL_KERNELS_H_
#define GRADSUM_MODEL_CUDA_MODEL_KERNELS_H_

// The elementwise pieces of moe_lm on the GPU that no library package provides: the token
// embedding (gather and its scatter-add backward), the residual add, and the f32 <-> bf16
// conversions of the parameter upload and the bf16 gradient reduction. All pointers are
// device memory; calls enqueue on `stream` and do not synchronise.
//
//   GRADSUM_RETURN_IF_ERROR(EmbeddingForwardCuda(emb, tokens, T, D, h, stream));
//   GRADSUM_RETURN_IF_ERROR(AddCuda(h, y, h_next, T * D, stream));        // h_next = h + y
//   GRADSUM_RETURN_IF_ERROR(EmbeddingBackwardCuda(tokens, dh, T, D, d_emb, stream));
//
// Tokens are checked on the host before upload (the model owns the batch there); the
// kernels trust them.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace gradsum::model {

// h[t, :] = emb[tokens[t], :] for t < rows (f32).
absl::Status EmbeddingForwardCuda(const float* emb, const int32_t* tokens, int64_t rows,
                                  int64_t dim, float* h, cudaStream_t stream);

// d_emb[tokens[t], :] += dh[t, :] (f32 atomics: the order of equal tokens' additions is
// not fixed, so repeated tokens sum to fp32 rounding, not bit for bit).
absl::Status EmbeddingBackwardCuda(const int32_t* tokens, const float* dh, int64_t rows,
                                   int64_t dim, float* d_emb, cudaStream_t stream);

// out[i] = a[i] + b[i] for i < n (f32); out may alias a or b.
absl::Status AddCuda(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream);

// out[i] = float(in[i]) for bf16 bit patterns `in` (exact).
absl::Status Bf16ToF32Cuda(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);

// out[i] = bf16(in[i]), round to nearest even (NaN stays NaN), as core/half.h.
absl::Status F32ToBf16Cuda(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);

// RoPE in place on x [rows, heads, head_dim] (head_dim even), rotate-half form
// (SEMANTICS.md §10): each head's pairs (i, i + head_dim / 2) rotated by the row's angle,
// whose cosines and sines (computed on the host, so that both devices rotate by the same
// fp32 values) are cos_table, sin_table [rows, head_dim / 2]; `inverse` rotates back.
absl::Status RopeCuda(float* x, const float* cos_table, const float* sin_table, int64_t rows,
                      int heads, int64_t head_dim, bool inverse, cudaStream_t stream);

// out[t, j, :] = x[t, j * group, :] + ... + x[t, j * group + group - 1, :], added in that
// order: x [rows, groups * group, dim] -> out [rows, groups, dim].
absl::Status SumGroupsCuda(const float* x, float* out, int64_t rows, int64_t groups, int group,
                           int64_t dim, cudaStream_t stream);

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_CUDA_MODEL_KERNELS_H_
