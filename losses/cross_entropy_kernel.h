#ifndef GRADSUM_LOSSES_CROSS_ENTROPY_KERNEL_H_
#define GRADSUM_LOSSES_CROSS_ENTROPY_KERNEL_H_

// Internal entry points of the fused cross-entropy kernel, shared with the fused linear
// cross-entropy (which runs the kernel chunk by chunk on rows it has checked once).
// Not a public API: use cross_entropy.h.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
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

// The checks of the options of SEMANTICS.md §3.2 (label_smoothing in [0, 1), logit_softcap
// and alpha_lse finite and >= 0): InvalidArgument naming the option and its value, prefixed
// by `who`.
absl::Status CheckCrossEntropyOptions(const CrossEntropyOptions& options, absl::string_view who);

// Whether any option of §3.2 is on (the kernel then takes its options path).
bool CrossEntropyOptionsOn(const CrossEntropyOptions& options);

// Runs the kernel on checked arguments (options included). `logits` is [rows, vocab] of `dtype`
// (f32/bf16); `grad` (same dtype and shape) may alias it or be null (forward only). Non-finite rows
// are reported as InvalidArgument naming row `row_offset + i`.
absl::StatusOr<CrossEntropyResult> CrossEntropyKernel(
    const void* logits, void* grad, DType dtype, int64_t rows, int64_t vocab,
    absl::Span<const int64_t> labels, absl::Span<const float> token_weights,
    double global_weight_sum, const CrossEntropyOptions& options, int64_t row_offset = 0);

// A 2-D f32 or bf16 CPU view (the logits, or their gradient); InvalidArgument naming `what`.
absl::Status CheckLogitsView(const TensorView& logits, absl::string_view what);

// The per-row gradient scale of ScaledRowsKernel (RowScaleHook of cross_entropy_rows.h with
// the call's row numbers): fn(ctx, row, ce) for row in [0, rows), ce = logsumexp - z[label].
// Called concurrently for different rows from the kernel's threads.
struct GlobalRowScaleHook {
  float (*fn)(void* ctx, int64_t row, double ce) = nullptr;
  void* ctx = nullptr;
};

// The fused CE rows (same threads, blocks and row code as CrossEntropyKernel) with each
// row's gradient scale from `hook` instead of w / D: grad row r = s_r * (softmax - onehot),
// s_r = hook.fn(.., r, CE_r). Rows of row_weight 0 are not read and get a zero gradient (the
// hook is not called for them); the others need a label in [0, vocab) (checked by the
// caller). row_loss[r] = row_weight[r] * CE_r (0 for skipped rows). `grad` may alias
// `logits` or be null. InvalidArgument, prefixed by `what`, naming the first non-finite row.
absl::Status ScaledRowsKernel(const void* logits, void* grad, DType dtype, int64_t rows,
                              int64_t vocab, absl::Span<const int64_t> labels,
                              absl::Span<const float> row_weight, const GlobalRowScaleHook& hook,
                              int num_threads, absl::string_view what, absl::Span<double> row_loss);

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
