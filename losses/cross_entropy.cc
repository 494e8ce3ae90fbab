#include "losses/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "losses/cross_entropy_kernel.h"
#include "losses/cross_entropy_rows.h"
#include "losses/parallel.h"

namespace gradsum::losses {
namespace {

using internal::kCeTile;
using internal::kRowOk;
using internal::RowScratchView;

const char* RowCodeText(uint8_t code) {
  switch (code) {
    case internal::kRowNaN:
      return "contains NaN (the loss would be NaN)";
    case internal::kRowPosInf:
      return "contains +inf (the loss would be NaN)";
    case internal::kRowAllNegInf:
      return "is all -inf (the loss would be NaN)";
    case internal::kRowTargetNegInf:
      return "has a -inf target logit (the loss would be infinite)";
    case internal::kRowSmoothNegInf:
      return "has a -inf logit (with label smoothing the loss would be infinite)";
    default:
      return "is fine";
  }
}

// Scratch reused by each thread: two rows' exp values and tile reference maxes (the row being
// read and the row whose gradient is written under it). Two rows of V = 32768 fp32 values
// (256 KiB) stay in L2.
struct RowScratch {
  std::vector<float> exps;
  std::vector<float> tile_ref;
};

// The selected build's block functions for T: CE's, and the scaled form (RowScaleHook).
template <typename T>
struct RowsFn;
template <>
struct RowsFn<float> {
  static internal::CeRowsF32Fn Get() { return internal::SelectedCeRowKernels().f32; }
  static internal::CeRowsScaledF32Fn GetScaled() {
    return internal::SelectedCeRowKernels().f32_scaled;
  }
};
template <>
struct RowsFn<uint16_t> {
  static internal::CeRowsBf16Fn Get() { return internal::SelectedCeRowKernels().bf16; }
  static internal::CeRowsScaledBf16Fn GetScaled() {
    return internal::SelectedCeRowKernels().bf16_scaled;
  }
};

inline float RowWeight(absl::Span<const int64_t> labels, absl::Span<const float> weights,
                       int64_t row, int64_t ignore_index) {
  if (labels[row] == ignore_index) return 0.0f;
  return weights.empty() ? 1.0f : weights[row];
}

// A GlobalRowScaleHook seen from one block: the row kernels number rows from the block's
// start, the hook from the call's.
struct BlockHook {
  const internal::GlobalRowScaleHook* hook;
  int64_t begin;
};

float BlockHookFn(void* ctx, int64_t row, double ce) {
  const BlockHook* b = static_cast<const BlockHook*>(ctx);
  return b->hook->fn(b->hook->ctx, b->begin + row, ce);
}

// The row blocks over the threads, shared by CE (hook == nullptr: the scale is w / d) and
// the scaled callers (the policy loss). Writes row_loss / row_code for every row.
template <typename T>
void RunRowBlocks(const T* logits, T* grad, int64_t rows, int64_t vocab, const int64_t* labels,
                  const float* row_weight, double d, int num_threads,
                  const internal::GlobalRowScaleHook* hook, double* row_loss, uint8_t* row_code) {
  const auto ce_rows = RowsFn<T>::Get();
  const auto scaled_rows = RowsFn<T>::GetScaled();
  // ~256K elements per task: enough tasks to balance two threads, long enough that the
  // gradient of all but a block's last row is written under the next row's forward.
  const int64_t rows_per_block = std::clamp<int64_t>((int64_t{1} << 18) / vocab, 1, 1024);
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  const int threads = rows * vocab >= (int64_t{1} << 16) ? num_threads : 1;
  ParallelFor(threads, blocks, [&](int64_t block) {
    thread_local RowScratch scratch;
    const int64_t tiles = (vocab + kCeTile - 1) / kCeTile;
    if (grad != nullptr && static_cast<int64_t>(scratch.exps.size()) < 2 * vocab) {
      scratch.exps.resize(static_cast<size_t>(2 * vocab));
    }
    if (grad != nullptr && static_cast<int64_t>(scratch.tile_ref.size()) < 2 * tiles) {
      scratch.tile_ref.resize(static_cast<size_t>(2 * tiles));
    }
    const RowScratchView view{scratch.exps.data(), scratch.tile_ref.data()};
    const int64_t begin = block * rows_per_block;
    const int64_t end = std::min(rows, begin + rows_per_block);
    T* block_grad = grad == nullptr ? nullptr : grad + begin * vocab;
    if (hook == nullptr) {
      ce_rows(logits + begin * vocab, block_grad, end - begin, vocab, labels + begin,
              row_weight + begin, d, &view, row_loss + begin, row_code + begin);
    } else {
      BlockHook block_hook{hook, begin};
      const internal::RowScaleHook row_hook{&BlockHookFn, &block_hook};
      scaled_rows(logits + begin * vocab, block_grad, end - begin, vocab, labels + begin,
                  row_weight + begin, d, &view, row_loss + begin, row_code + begin, &row_hook);
    }
  });
}

// InvalidArgument naming the first row whose code is not kRowOk, or OK.
absl::Status FirstBadRow(absl::string_view what, absl::Span<const uint8_t> row_code,
                         absl::Span<const int64_t> labels, int64_t row_offset) {
  const int64_t rows = static_cast<int64_t>(row_code.size());
  for (int64_t r = 0; r < rows; ++r) {
    if (row_code[r] != kRowOk) {
      int64_t bad_rows = 0;
      for (int64_t q = r; q < rows; ++q) bad_rows += row_code[q] != kRowOk ? 1 : 0;
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": logits row ", row_offset + r, " (label ", labels[r], ") ",
                       RowCodeText(row_code[r]), "; ", bad_rows, " such row(s) in total"));
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<CrossEntropyResult> RunKernel(const T* logits, T* grad, int64_t rows, int64_t vocab,
                                             absl::Span<const int64_t> labels,
                                             absl::Span<const float> weights, double d,
                                             const CrossEntropyOptions& options,
                                             int64_t row_offset) {
  std::vector<double> row_loss(static_cast<size_t>(rows), 0.0);
  std::vector<uint8_t> row_code(static_cast<size_t>(rows), kRowOk);
  std::vector<float> row_weight(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    row_weight[r] = RowWeight(labels, weights, r, options.ignore_index);
  }
  RunRowBlocks<T>(logits, grad, rows, vocab, labels.data(), row_weight.data(), d,
                  options.num_threads, /*hook=*/nullptr, row_loss.data(), row_code.data());
  absl::Status bad = FirstBadRow("cross-entropy", row_code, labels, row_offset);
  if (!bad.ok()) return bad;

  CrossEntropyResult result;
  for (int64_t r = 0; r < rows; ++r) {
    result.local_weighted_ce_sum += row_loss[r];
    result.local_weight_sum += static_cast<double>(row_weight[r]);
    if (labels[r] != options.ignore_index) ++result.local_valid_tokens;
  }
  result.local_loss = d > 0.0 ? result.local_weighted_ce_sum / d : 0.0;
  return result;
}

// The options path (SEMANTICS.md §3.2): label smoothing, logit softcap and the output
// z-loss. It is a separate path so that the plain kernel above keeps its bits when every
// option is off. Each row is widened (bf16) and capped into an fp32 row buffer, which the
// vocab-parallel CE's row code (cross_entropy_rows.inc, §3.1) reads once: it already
// computes the max, the exp sum, the target logit and the row sum of z that smoothing
// needs, keeps the exps in the buffer, and writes §3.1's gradient over them; this is
// that code with a group of one. The cap's chain factor is then applied and the row stored.
struct OptionsScratch {
  std::vector<float> z, factor, tile_ref;
};

template <typename T>
absl::StatusOr<CrossEntropyResult> RunOptionsKernel(const T* logits, T* grad, int64_t rows,
                                                    int64_t vocab, absl::Span<const int64_t> labels,
                                                    absl::Span<const float> weights, double d,
                                                    const CrossEntropyOptions& options,
                                                    int64_t row_offset) {
  const internal::CeRowKernels& k = internal::SelectedCeRowKernels();
  const double eps = options.ce.label_smoothing;
  const double cap = options.ce.logit_softcap;
  const double alpha = options.ce.alpha_lse;
  const double inv_v = 1.0 / static_cast<double>(vocab);
  std::vector<double> row_ce(static_cast<size_t>(rows), 0.0);
  std::vector<double> row_lse_sq(static_cast<size_t>(rows), 0.0);
  std::vector<uint8_t> row_code(static_cast<size_t>(rows), kRowOk);
  std::vector<float> row_weight(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    row_weight[r] = RowWeight(labels, weights, r, options.ignore_index);
  }
  const int64_t rows_per_block = std::clamp<int64_t>((int64_t{1} << 18) / vocab, 1, 1024);
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  const int threads = rows * vocab >= (int64_t{1} << 16) ? options.num_threads : 1;
  const int64_t tiles = (vocab + kCeTile - 1) / kCeTile;
  ParallelFor(threads, blocks, [&](int64_t block) {
    thread_local OptionsScratch sc;
    if (static_cast<int64_t>(sc.z.size()) < vocab) sc.z.resize(static_cast<size_t>(vocab));
    if (cap > 0.0 && static_cast<int64_t>(sc.factor.size()) < vocab) {
      sc.factor.resize(static_cast<size_t>(vocab));
    }
    if (static_cast<int64_t>(sc.tile_ref.size()) < tiles) {
      sc.tile_ref.resize(static_cast<size_t>(tiles));
    }
    float* z = sc.z.data();
    float* factor = sc.factor.data();
    const int64_t end = std::min(rows, (block + 1) * rows_per_block);
    for (int64_t r = block * rows_per_block; r < end; ++r) {
      T* out = grad == nullptr ? nullptr : grad + r * vocab;
      float w = row_weight[r];
      if (w == 0.0f) {
        if (out != nullptr) std::memset(out, 0, static_cast<size_t>(vocab) * sizeof(T));
        continue;
      }
      // Widen (bf16) and cap into z. The row is read here, before `out` (which may alias it)
      // is written.
      const T* x = logits + r * vocab;
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(z, x, static_cast<size_t>(vocab) * sizeof(float));
      } else {
        k.bf16_to_f32(x, z, vocab);
      }
      if (cap > 0.0) {
        const float c = static_cast<float>(cap);
        for (int64_t j = 0; j < vocab; ++j) {
          const float t = std::tanh(z[j] / c);
          z[j] = c * t;
          factor[j] = 1.0f - t * t;  // dz/dx of the cap
        }
      }
      const int64_t label = labels[r];
      float m = 0.0f, z_y = 0.0f;
      double sum = 0.0, zsum = 0.0;
      uint8_t code = kRowOk;
      k.vp_local_f32(z, out == nullptr ? nullptr : z, sc.tile_ref.data(), 1, vocab, &w, &label, &m,
                     &sum, eps > 0.0 ? &zsum : nullptr, &z_y, &code);
      if (code == kRowOk && m == -std::numeric_limits<float>::infinity()) {
        code = internal::kRowAllNegInf;
      }
      if (code == kRowOk && z_y == -std::numeric_limits<float>::infinity()) {
        code = internal::kRowTargetNegInf;
      }
      if (code == kRowOk && eps > 0.0 && !std::isfinite(zsum)) code = internal::kRowSmoothNegInf;
      if (code != kRowOk) {
        row_code[r] = code;
        continue;
      }
      const double log_sum = std::log(sum);
      const double lse = static_cast<double>(m) + log_sum;
      // (max - z_y) + log_sum: the difference first, so large logits lose nothing (§3.1).
      double ce = (static_cast<double>(m) - z_y) + log_sum;
      // lse - (1 - eps) z_y - eps U / V = (lse - z_y) + eps (z_y - U / V).
      if (eps > 0.0) ce += eps * (static_cast<double>(z_y) - zsum * inv_v);
      row_ce[r] = w * ce;
      row_lse_sq[r] = w * lse * lse;
      if (out == nullptr) continue;
      // dL/dz_j = (w / D) ((1 + 2 alpha lse) p_j - (1 - eps) [j == y] - eps / V), §3.2.
      const double wd = w / d;
      internal::VpGradRow g;
      g.scale = wd * (1.0 + 2.0 * alpha * lse);
      g.global_max = m;
      g.log_sum = log_sum;
      g.offset = static_cast<float>(-wd * eps * inv_v);
      g.local_label = label;
      const double p_y = std::exp(static_cast<double>(z_y) - lse);
      g.target_grad = static_cast<float>(g.scale * p_y - wd * (1.0 - eps) - wd * eps * inv_v);
      k.vp_grad_f32(z, sc.tile_ref.data(), 1, vocab, &g);
      if (cap > 0.0) {
        for (int64_t j = 0; j < vocab; ++j) z[j] *= factor[j];
      }
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(out, z, static_cast<size_t>(vocab) * sizeof(float));
      } else {
        k.f32_to_bf16(z, out, vocab);
      }
    }
  });
  absl::Status bad = FirstBadRow("cross-entropy", row_code, labels, row_offset);
  if (!bad.ok()) return bad;

  CrossEntropyResult result;
  for (int64_t r = 0; r < rows; ++r) {
    result.local_weighted_ce_sum += row_ce[r];
    result.local_weighted_lse_sq_sum += row_lse_sq[r];
    result.local_weight_sum += static_cast<double>(row_weight[r]);
    if (labels[r] != options.ignore_index) ++result.local_valid_tokens;
  }
  result.local_loss =
      d > 0.0 ? (result.local_weighted_ce_sum + alpha * result.local_weighted_lse_sq_sum) / d : 0.0;
  return result;
}

absl::Status CheckLogitsViewImpl(const TensorView& logits, absl::string_view what) {
  if (logits.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be 2-D [N, V], got ", logits.DebugString()));
  }
  if (logits.dtype() != DType::kF32 && logits.dtype() != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be f32 or bf16, got ", logits.DebugString()));
  }
  if (logits.device().type != Device::kCpu) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be on the CPU, got ", logits.DebugString()));
  }
  return absl::OkStatus();
}

}  // namespace

namespace internal {

absl::Status CheckLogitsView(const TensorView& logits, absl::string_view what) {
  return CheckLogitsViewImpl(logits, what);
}

}  // namespace internal

namespace {

absl::StatusOr<CrossEntropyResult> ForwardBackward(const TensorView& logits,
                                                   absl::Span<const int64_t> labels,
                                                   absl::Span<const float> token_weights,
                                                   double global_weight_sum,
                                                   const TensorView* grad_logits,
                                                   const CrossEntropyOptions& options) {
  absl::Status s = internal::CheckLogitsView(logits, "logits");
  if (!s.ok()) return s;
  if (grad_logits != nullptr) {
    s = internal::CheckLogitsView(*grad_logits, "grad_logits");
    if (!s.ok()) return s;
    if (grad_logits->dtype() != logits.dtype() || grad_logits->shape() != logits.shape()) {
      return absl::InvalidArgumentError(absl::StrCat("grad_logits ", grad_logits->DebugString(),
                                                     " must have the dtype and shape of logits ",
                                                     logits.DebugString()));
    }
  }
  const int64_t rows = logits.dim(0);
  const int64_t vocab = logits.dim(1);
  s = internal::CheckCrossEntropyArgs(rows, vocab, labels, token_weights, global_weight_sum,
                                      options.ignore_index);
  if (!s.ok()) return s;
  s = internal::CheckCrossEntropyOptions(options, "cross-entropy");
  if (!s.ok()) return s;
  return internal::CrossEntropyKernel(
      logits.raw(), grad_logits == nullptr ? nullptr : grad_logits->raw(), logits.dtype(), rows,
      vocab, labels, token_weights, global_weight_sum, options);
}

}  // namespace

namespace internal {

const CeRowKernels* CeRowKernelsFor(const char* isa) {
  static const IsaBuilds<CeRowKernels> builds(GRADSUM_ISA_BUILDS(rows, Kernels));
  return builds.For(isa);
}

const CeRowKernels& SelectedCeRowKernels() {
  static const CeRowKernels& kernels =
      PickIsaBuild<CeRowKernels>("GRADSUM_CE_ISA", &CeRowKernelsFor);
  return kernels;
}

absl::Status CheckCrossEntropyArgs(int64_t rows, int64_t vocab, absl::Span<const int64_t> labels,
                                   absl::Span<const float> token_weights, double global_weight_sum,
                                   int64_t ignore_index, int64_t row_offset) {
  if (vocab < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("cross-entropy: vocabulary size ", vocab, " must be >= 1"));
  }
  if (static_cast<int64_t>(labels.size()) != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("cross-entropy: ", labels.size(), " labels for ", rows, " rows of logits"));
  }
  if (!token_weights.empty() && static_cast<int64_t>(token_weights.size()) != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("cross-entropy: ", token_weights.size(), " token weights for ", rows,
                     " rows (give N weights, or none for token mode)"));
  }
  if (!std::isfinite(global_weight_sum) || global_weight_sum < 0.0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cross-entropy: global weight sum D = ", global_weight_sum, " must be finite and >= 0"));
  }
  double local_weight_sum = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t y = labels[r];
    if (y == ignore_index) continue;
    if (y < 0 || y >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("cross-entropy: label ", y, " at row ", row_offset + r, " is outside [0, ",
                       vocab, ") and is not ignore_index (", ignore_index, ")"));
    }
    if (!token_weights.empty()) {
      const float w = token_weights[r];
      if (!(w >= 0.0f) || !std::isfinite(w)) {
        return absl::InvalidArgumentError(absl::StrCat("cross-entropy: token weight ", w,
                                                       " at row ", row_offset + r,
                                                       " must be finite and >= 0"));
      }
      local_weight_sum += static_cast<double>(w);
    } else {
      local_weight_sum += 1.0;
    }
  }
  // D is a sum of non-negative weights over all ranks and micro-batches, so it cannot be
  // below this call's share; if it is, a local sum was passed where the global one belongs.
  if (local_weight_sum > global_weight_sum * (1.0 + 1e-9)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cross-entropy: global weight sum D = ", global_weight_sum,
        " is smaller than this call's own weight sum ", local_weight_sum,
        "; D must be summed over all ranks and micro-batches of the step (SEMANTICS.md §3)"));
  }
  return absl::OkStatus();
}

absl::Status CheckCrossEntropyOptions(const CrossEntropyOptions& cross_entropy_options,
                                      absl::string_view who) {
  const CeOptions& options = cross_entropy_options.ce;
  // Written so that NaN fails every check.
  if (!(options.label_smoothing >= 0.0 && options.label_smoothing < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": label_smoothing ", options.label_smoothing, " must be in [0, 1)"));
  }
  if (!(options.logit_softcap >= 0.0 && std::isfinite(options.logit_softcap))) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": logit_softcap ", options.logit_softcap,
                                                   " must be finite and >= 0 (0 = off)"));
  }
  if (!(options.alpha_lse >= 0.0 && std::isfinite(options.alpha_lse))) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": alpha_lse ", options.alpha_lse, " must be finite and >= 0 (0 = off)"));
  }
  return absl::OkStatus();
}

bool CrossEntropyOptionsOn(const CrossEntropyOptions& cross_entropy_options) {
  const CeOptions& options = cross_entropy_options.ce;
  return options.label_smoothing != 0.0 || options.logit_softcap != 0.0 || options.alpha_lse != 0.0;
}

absl::Status CheckF32Matrix(const TensorView& t, absl::string_view who, absl::string_view what,
                            int64_t rows, int64_t cols) {
  if (t.rank() != 2 || t.dtype() != DType::kF32 || t.device().type != Device::kCpu) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", what, " must be a 2-D f32 CPU tensor, got ", t.DebugString()));
  }
  if ((rows >= 0 && t.dim(0) != rows) || (cols >= 0 && t.dim(1) != cols)) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", what, " is ", t.DebugString(),
                                                   ", expected [", rows, ",", cols, "]"));
  }
  return absl::OkStatus();
}

bool Overlap(const TensorView& a, const TensorView& b) {
  const char* a0 = static_cast<const char*>(a.raw());
  const char* b0 = static_cast<const char*>(b.raw());
  return a.nbytes() > 0 && b.nbytes() > 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

int64_t AutoChunkRows(int64_t rows, int64_t vocab) {
  constexpr int64_t kAutoChunkBytes = int64_t{4} << 20;
  constexpr int64_t kMinAutoChunkRows = 32;
  const int64_t chunk = std::max(
      kMinAutoChunkRows, std::min(kAutoChunkBytes / (std::max<int64_t>(vocab, 1) * 4), rows / 8));
  return std::max<int64_t>(1, std::min(chunk, rows));
}

absl::StatusOr<CrossEntropyResult> CrossEntropyKernel(
    const void* logits, void* grad, DType dtype, int64_t rows, int64_t vocab,
    absl::Span<const int64_t> labels, absl::Span<const float> token_weights,
    double global_weight_sum, const CrossEntropyOptions& options, int64_t row_offset) {
  if (CrossEntropyOptionsOn(options)) {
    switch (dtype) {
      case DType::kF32:
        return RunOptionsKernel<float>(static_cast<const float*>(logits), static_cast<float*>(grad),
                                       rows, vocab, labels, token_weights, global_weight_sum,
                                       options, row_offset);
      case DType::kBF16:
        return RunOptionsKernel<uint16_t>(static_cast<const uint16_t*>(logits),
                                          static_cast<uint16_t*>(grad), rows, vocab, labels,
                                          token_weights, global_weight_sum, options, row_offset);
      default:
        break;  // the error below
    }
  }
  switch (dtype) {
    case DType::kF32:
      return RunKernel<float>(static_cast<const float*>(logits), static_cast<float*>(grad), rows,
                              vocab, labels, token_weights, global_weight_sum, options, row_offset);
    case DType::kBF16:
      return RunKernel<uint16_t>(static_cast<const uint16_t*>(logits), static_cast<uint16_t*>(grad),
                                 rows, vocab, labels, token_weights, global_weight_sum, options,
                                 row_offset);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cross-entropy: logits dtype ", DTypeName(dtype), " is not f32 or bf16"));
  }
}

absl::Status ScaledRowsKernel(const void* logits, void* grad, DType dtype, int64_t rows,
                              int64_t vocab, absl::Span<const int64_t> labels,
                              absl::Span<const float> row_weight, const GlobalRowScaleHook& hook,
                              int num_threads, absl::string_view what,
                              absl::Span<double> row_loss) {
  std::vector<uint8_t> row_code(static_cast<size_t>(rows), kRowOk);
  switch (dtype) {
    case DType::kF32:
      RunRowBlocks<float>(static_cast<const float*>(logits), static_cast<float*>(grad), rows, vocab,
                          labels.data(), row_weight.data(), 1.0, num_threads, &hook,
                          row_loss.data(), row_code.data());
      break;
    case DType::kBF16:
      RunRowBlocks<uint16_t>(static_cast<const uint16_t*>(logits), static_cast<uint16_t*>(grad),
                             rows, vocab, labels.data(), row_weight.data(), 1.0, num_threads, &hook,
                             row_loss.data(), row_code.data());
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": logits dtype ", DTypeName(dtype), " is not f32 or bf16"));
  }
  return FirstBadRow(what, row_code, labels, /*row_offset=*/0);
}

}  // namespace internal

absl::StatusOr<CrossEntropyResult> CrossEntropyForwardBackward(
    const TensorView& logits, absl::Span<const int64_t> labels,
    absl::Span<const float> token_weights, double global_weight_sum, const TensorView& grad_logits,
    const CrossEntropyOptions& options) {
  return ForwardBackward(logits, labels, token_weights, global_weight_sum, &grad_logits, options);
}

absl::StatusOr<CrossEntropyResult> CrossEntropyForward(const TensorView& logits,
                                                       absl::Span<const int64_t> labels,
                                                       absl::Span<const float> token_weights,
                                                       double global_weight_sum,
                                                       const CrossEntropyOptions& options) {
  return ForwardBackward(logits, labels, token_weights, global_weight_sum, nullptr, options);
}

}  // namespace gradsum::losses
