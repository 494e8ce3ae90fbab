#include "losses/linear_cross_entropy.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/gemm.h"
#include "losses/cross_entropy_kernel.h"

namespace gradsum::losses {
namespace {

constexpr char kWho[] = "linear cross-entropy";

absl::Status CheckF32Matrix(const TensorView& t, const char* what, int64_t rows, int64_t cols) {
  return internal::CheckF32Matrix(t, kWho, what, rows, cols);
}

using internal::Overlap;

}  // namespace

absl::StatusOr<LinearCrossEntropyResult> LinearCrossEntropyForwardBackward(
    const TensorView& hidden, const TensorView& head, absl::Span<const int64_t> labels,
    absl::Span<const float> token_weights, double global_weight_sum, const TensorView& grad_hidden,
    const TensorView& grad_head, const LinearCrossEntropyOptions& options) {
  absl::Status s = CheckF32Matrix(hidden, "hidden", -1, -1);
  if (!s.ok()) return s;
  const int64_t n = hidden.dim(0);
  const int64_t dm = hidden.dim(1);
  const bool ht = options.head_transposed;  // head and grad_head are [V, Dm]
  s = ht ? CheckF32Matrix(head, "head (transposed)", -1, dm) : CheckF32Matrix(head, "head", dm, -1);
  if (!s.ok()) return s;
  const int64_t v = ht ? head.dim(0) : head.dim(1);
  s = CheckF32Matrix(grad_hidden, "grad_hidden", n, dm);
  if (!s.ok()) return s;
  s = ht ? CheckF32Matrix(grad_head, "grad_head (transposed)", v, dm)
         : CheckF32Matrix(grad_head, "grad_head", dm, v);
  if (!s.ok()) return s;
  if (Overlap(grad_head, hidden) || Overlap(grad_head, head) || Overlap(grad_head, grad_hidden) ||
      Overlap(grad_hidden, head) ||
      (Overlap(grad_hidden, hidden) && grad_hidden.raw() != hidden.raw())) {
    return absl::InvalidArgumentError(
        "linear cross-entropy: grad_head must not overlap any other buffer, and grad_hidden may "
        "only overlap hidden exactly (in place)");
  }
  if (options.chunk_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("linear cross-entropy: chunk_rows ", options.chunk_rows, " must be >= 0"));
  }
  s = internal::CheckCrossEntropyArgs(n, v, labels, token_weights, global_weight_sum,
                                      options.ignore_index);
  if (!s.ok()) return s;
  CrossEntropyOptions ce_options;
  ce_options.ignore_index = options.ignore_index;
  ce_options.ce = options.ce;
  s = internal::CheckCrossEntropyOptions(ce_options, kWho);
  if (!s.ok()) return s;

  int64_t chunk = options.chunk_rows == 0 ? internal::AutoChunkRows(n, v) : options.chunk_rows;
  chunk = std::max<int64_t>(1, std::min(chunk, n));

  LinearCrossEntropyResult result;
  result.chunk_rows = chunk;
  const absl::Span<const float> h(hidden.data<float>(), n * dm);
  const absl::Span<const float> w(head.data<float>(), dm * v);
  const absl::Span<float> gh(grad_hidden.data<float>(), n * dm);
  const absl::Span<float> gw(grad_head.data<float>(), dm * v);

  std::unique_ptr<float[]> logits_buf;  // allocated on the first chunk that needs it
  const int threads = std::max(1, options.num_threads);
  ce_options.num_threads = threads;

  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0);
    const absl::Span<const int64_t> chunk_labels = labels.subspan(r0, rows);
    const absl::Span<const float> chunk_weights =
        token_weights.empty() ? token_weights : token_weights.subspan(r0, rows);
    bool any_weight = false;
    for (int64_t i = 0; i < rows && !any_weight; ++i) {
      any_weight = chunk_labels[i] != options.ignore_index &&
                   (chunk_weights.empty() || chunk_weights[i] != 0.0f);
    }
    if (!any_weight || global_weight_sum == 0.0) {
      // No row of this chunk is in the loss: zero hidden gradient, head untouched.
      for (int64_t i = 0; i < rows; ++i) {
        if (chunk_labels[i] != options.ignore_index) ++result.ce.local_valid_tokens;
      }
      std::fill_n(gh.data() + r0 * dm, rows * dm, 0.0f);
      continue;
    }
    if (logits_buf == nullptr) {
      logits_buf.reset(new float[static_cast<size_t>(chunk * v)]);
      // The CE kernel keeps 9 bytes per row (row loss + row status) and, per thread, one
      // fp32 row of exp values plus one float per 1024-column tile.
      result.peak_scratch_bytes =
          chunk * v * static_cast<int64_t>(sizeof(float)) + chunk * 9 +
          threads * (v + (v + 1023) / 1024) * static_cast<int64_t>(sizeof(float));
    }
    const absl::Span<float> logits(logits_buf.get(), rows * v);
    const absl::Span<const float> h_c = h.subspan(r0 * dm, rows * dm);

    // logits_c = hidden_c @ head (core/gemm.h splits it over the threads).
    s = ht ? Sgemm(Trans::kNo, Trans::kYes, rows, v, dm, 1.0f, h_c, dm, w, dm, 0.0f, logits, v,
                   threads)
           : Sgemm(Trans::kNo, Trans::kNo, rows, v, dm, 1.0f, h_c, dm, w, v, 0.0f, logits, v,
                   threads);
    if (!s.ok()) return s;
    absl::StatusOr<CrossEntropyResult> ce = internal::CrossEntropyKernel(
        logits_buf.get(), logits_buf.get(), DType::kF32, rows, v, chunk_labels, chunk_weights,
        global_weight_sum, ce_options, /*row_offset=*/r0);
    if (!ce.ok()) return ce.status();
    result.ce.local_weighted_ce_sum += ce->local_weighted_ce_sum;
    result.ce.local_weighted_lse_sq_sum += ce->local_weighted_lse_sq_sum;
    result.ce.local_weight_sum += ce->local_weight_sum;
    result.ce.local_valid_tokens += ce->local_valid_tokens;

    // grad_head += hidden_c^T @ dlogits_c, before grad_hidden_c is written, so grad_hidden
    // may alias hidden.
    s = ht ? Sgemm(Trans::kYes, Trans::kNo, v, dm, rows, 1.0f, logits, v, h_c, dm, 1.0f, gw, dm,
                   threads)
           : Sgemm(Trans::kYes, Trans::kNo, dm, v, rows, 1.0f, h_c, dm, logits, v, 1.0f, gw, v,
                   threads);
    if (!s.ok()) return s;
    // grad_hidden_c = dlogits_c @ head^T.
    s = ht ? Sgemm(Trans::kNo, Trans::kNo, rows, dm, v, 1.0f, logits, v, w, dm, 0.0f,
                   gh.subspan(r0 * dm, rows * dm), dm, threads)
           : Sgemm(Trans::kNo, Trans::kYes, rows, dm, v, 1.0f, logits, v, w, v, 0.0f,
                   gh.subspan(r0 * dm, rows * dm), dm, threads);
    if (!s.ok()) return s;
  }
  // The z-loss term only when it is on, so that the plain result keeps its bits.
  const double objective = options.ce.alpha_lse > 0.0
                               ? result.ce.local_weighted_ce_sum +
                                     options.ce.alpha_lse * result.ce.local_weighted_lse_sq_sum
                               : result.ce.local_weighted_ce_sum;
  result.ce.local_loss = global_weight_sum > 0.0 ? objective / global_weight_sum : 0.0;
  return result;
}

}  // namespace gradsum::losses
