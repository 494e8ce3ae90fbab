#ifndef GRADSUM_LOSSES_CROSS_ENTROPY_KERNEL_H_
#define GRADSUM_LOSSES_CROSS_ENTROPY_KERNEL_H_

// Internal entry points of the fused cross-entropy kernel, shared with the fused linear
// cross-entropy (which runs the kernel chunk by chunk on rows it has checked once).
// Not a public API: use cross_entropy.h.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "losses/cross_entropy.h"

namespace gradsum::losses::internal {

// The argument checks of CrossEntropyForwardBackward that need no logits: label range,
// weight sign and finiteness, D >= 0 and finite, D >= this call's weight sum. Row numbers
// in messages are `row_offset + i`.
absl::Status CheckCrossEntropyArgs(int64_t rows, int64_t vocab, absl::Span<const int64_t> labels,
                                   absl::Span<const float> token_weights, double global_weight_sum,
                                   int64_t ignore_index, int64_t row_offset = 0);

// Runs the kernel on checked arguments. `logits` is [rows, vocab] of `dtype` (f32/bf16);
// `grad` (same dtype and shape) may alias it or be null (forward only). Non-finite rows are
// reported as InvalidArgument naming row `row_offset + i`.
absl::StatusOr<CrossEntropyResult> CrossEntropyKernel(
    const void* logits, void* grad, DType dtype, int64_t rows, int64_t vocab,
    absl::Span<const int64_t> labels, absl::Span<const float> token_weights,
    double global_weight_sum, const CrossEntropyOptions& options, int64_t row_offset = 0);

// Shape helpers shared by the fused linear CE and the vocab-parallel CE (one copy of each).
//
// OK if `t` is a 2-D f32 CPU tensor of [rows, cols] (a negative bound: any size); else
// InvalidArgument "<who>: <what> must be ..." naming the tensor.
absl::Status CheckF32Matrix(const TensorView& t, absl::string_view who, absl::string_view what,
                            int64_t rows, int64_t cols);
// Whether two views' bytes overlap (empty views overlap nothing).
bool Overlap(const TensorView& a, const TensorView& b);
// The fused linear CE's automatic chunk: large enough for efficient GEMMs, small enough
// that a [chunk, vocab] fp32 logits chunk stays a small fraction (<= 1/8) of the [N, vocab]
// logits it replaces: min(rows whose logits fit 4 MiB, N / 8), at least 32, at most N
// (and >= 1).
int64_t AutoChunkRows(int64_t rows, int64_t vocab);

}  // namespace gradsum::losses::internal

#endif  // GRADSUM_LOSSES_CROSS_ENTROPY_KERNEL_H_
