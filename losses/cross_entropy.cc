#include "losses/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "losses/cross_entropy_kernel.h"
#include "losses/parallel.h"

namespace gradsum::losses {
namespace {

constexpr int kLanes = 8;                // independent accumulators (two SSE vectors)
constexpr int64_t kTile = 1024;          // floats per tile: 4 KiB, stays in L1 between max and sum
constexpr float kExpUnderflow = -86.0f;  // exp(x) < 4.5e-38 below this: returned as 0

// exp(x) in fp32 without a libm call, so the row loops vectorise. Cody-Waite range
// reduction x = n ln2 + r, |r| <= ln2/2, and Cephes' degree-6 polynomial for exp(r):
// about 2 ulp over [-86, 88]. Below -86 it returns exactly 0 (so exp(-inf) == 0).
// NaN in gives NaN out (the caller detects NaN rows through the row sum).
inline float FastExp(float x) {
  const float xc = x < kExpUnderflow ? kExpUnderflow : (x > 88.0f ? 88.0f : x);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = xc * 1.44269504088896341f + kRound;
  const float fn = t - kRound;
  uint32_t t_bits;
  std::memcpy(&t_bits, &t, sizeof(t_bits));
  const uint32_t n_shifted = (t_bits - 0x4B400000u) << 23;  // n * 2^23, two's complement
  float r = xc - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  uint32_t y_bits;
  std::memcpy(&y_bits, &y, sizeof(y_bits));
  y_bits += n_shifted;
  float e;
  std::memcpy(&e, &y_bits, sizeof(e));
  return x < kExpUnderflow ? 0.0f : e;
}

// Round-to-nearest-even fp32 -> bf16 bits for finite values (the rows written here are
// checked finite), branch-free so the store loop vectorises. Matches BF16::FromFloat.
inline uint16_t ToBF16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float BF16BitsToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Per-row outcome, kept per row so the first bad row is reported whatever the threading.
enum RowCode : uint8_t { kRowOk = 0, kRowNaN, kRowPosInf, kRowAllNegInf, kRowTargetNegInf };

const char* RowCodeText(uint8_t code) {
  switch (code) {
    case kRowNaN: return "contains NaN (the loss would be NaN)";
    case kRowPosInf: return "contains +inf (the loss would be NaN)";
    case kRowAllNegInf: return "is all -inf (the loss would be NaN)";
    case kRowTargetNegInf: return "has a -inf target logit (the loss would be infinite)";
    default: return "is fine";
  }
}

// Loads a tile of `len` elements as fp32: f32 rows are used in place, bf16 rows widened
// into `buf`.
template <typename T>
inline const float* LoadTile(const T* x, int64_t len, float* buf);
template <>
inline const float* LoadTile<float>(const float* x, int64_t /*len*/, float* /*buf*/) {
  return x;
}
template <>
inline const float* LoadTile<uint16_t>(const uint16_t* x, int64_t len, float* buf) {
  for (int64_t i = 0; i < len; ++i) buf[i] = BF16BitsToFloat(x[i]);
  return buf;
}

template <typename T>
inline float ToFloat(T v);
template <>
inline float ToFloat<float>(float v) {
  return v;
}
template <>
inline float ToFloat<uint16_t>(uint16_t v) {
  return BF16BitsToFloat(v);
}

// Gradient stores. (Non-temporal stores were tried here: no measurable change on this
// machine, where the kernel is bound by the exp throughput of SSE2, so they are not used.)
template <typename T>
inline void StoreTile(const float* g, int64_t len, T* out);
template <>
inline void StoreTile<float>(const float* g, int64_t len, float* out) {
  std::memcpy(out, g, static_cast<size_t>(len) * sizeof(float));
}
template <>
inline void StoreTile<uint16_t>(const float* g, int64_t len, uint16_t* out) {
  for (int64_t i = 0; i < len; ++i) out[i] = ToBF16Bits(g[i]);
}

template <typename T>
inline void StoreOne(float g, T* out);
template <>
inline void StoreOne<float>(float g, float* out) {
  *out = g;
}
template <>
inline void StoreOne<uint16_t>(float g, uint16_t* out) {
  *out = ToBF16Bits(g);
}

// Max of x[0, body), body a multiple of kLanes; NaN entries are skipped (a NaN row is
// caught through its exp sum instead). SSE2 (every x86-64) because GCC will not vectorise
// a float max without -ffinite-math-only; a portable loop elsewhere.
inline float TileMax(const float* x, int64_t body) {
#if defined(__SSE2__)
  __m128 m0 = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  __m128 m1 = m0;
  for (int64_t i = 0; i < body; i += 8) {
    m0 = _mm_max_ps(_mm_loadu_ps(x + i), m0);  // NaN in the first operand keeps m0
    m1 = _mm_max_ps(_mm_loadu_ps(x + i + 4), m1);
  }
  float lanes[4];
  _mm_storeu_ps(lanes, _mm_max_ps(m0, m1));
  return std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < body; ++i) m = x[i] > m ? x[i] : m;
  return m;
#endif
}

// Scratch for one row, reused by each thread: the row's exp values and each tile's
// reference max. A row of V = 32768 fp32 values (128 KiB) stays in L2 between the sweeps.
struct RowScratch {
  std::vector<float> exps;
  std::vector<float> tile_ref;
};

// The only read of the row from memory: logsumexp with an online max. Per tile (in L1):
// the tile's max; if it grew, rescale the running sum once; then add exp(x - running max).
// If `scratch` is given, the exp values are kept there (with the max they are relative
// to), so the gradient needs no second exp and no second read of the logits.
// Returns a RowCode; on success logsumexp(row) = *row_max + *log_sum (kept apart so that
// large logits lose nothing).
template <typename T>
uint8_t RowLogSumExp(const T* row, int64_t vocab, float* row_max, double* log_sum,
                     RowScratch* scratch) {
  float buf[kTile];
  float running_max = -std::numeric_limits<float>::infinity();
  double running_sum = 0.0;
  for (int64_t start = 0, tile = 0; start < vocab; start += kTile, ++tile) {
    const int64_t len = std::min(kTile, vocab - start);
    const float* x = LoadTile<T>(row + start, len, buf);
    const int64_t body = len - len % kLanes;
    float tile_max = TileMax(x, body);
    for (int64_t i = body; i < len; ++i) tile_max = x[i] > tile_max ? x[i] : tile_max;
    if (tile_max == std::numeric_limits<float>::infinity()) return kRowPosInf;
    if (tile_max > running_max) {
      running_sum *= std::exp(static_cast<double>(running_max) - static_cast<double>(tile_max));
      running_max = tile_max;
    }
    if (scratch != nullptr) scratch->tile_ref[tile] = running_max;
    if (running_max == -std::numeric_limits<float>::infinity()) {
      // Everything so far is -inf or NaN: x - max would be NaN, so look for NaN directly.
      for (int64_t i = 0; i < len; ++i) {
        if (std::isnan(x[i])) return kRowNaN;
      }
      if (scratch != nullptr) {
        std::fill(scratch->exps.begin() + start, scratch->exps.begin() + start + len, 0.0f);
      }
      continue;
    }
    float* e = scratch != nullptr ? scratch->exps.data() + start : buf;  // buf: overwrite in place
    for (int64_t i = 0; i < len; ++i) e[i] = FastExp(x[i] - running_max);
    float lane_sum[kLanes] = {};
    for (int64_t i = 0; i < body; i += kLanes) {
      for (int k = 0; k < kLanes; ++k) lane_sum[k] += e[i + k];
    }
    float tile_sum = 0.0f;
    for (int k = 0; k < kLanes; ++k) tile_sum += lane_sum[k];
    for (int64_t i = body; i < len; ++i) tile_sum += e[i];
    running_sum += static_cast<double>(tile_sum);  // NaN anywhere in the row lands here
  }
  if (std::isnan(running_sum)) return kRowNaN;
  if (running_max == -std::numeric_limits<float>::infinity()) return kRowAllNegInf;
  *row_max = running_max;
  *log_sum = std::log(running_sum);
  return kRowOk;
}

// Writes the gradient from the kept exp values: softmax_j = exp(x_j - ref_tile) *
// exp(ref_tile - lse), the second factor once per tile; then the target's scale * (p_y - 1).
// The logits are not read again, so `grad` may alias them.
template <typename T>
void RowGradient(const RowScratch& scratch, T* grad, int64_t vocab, int64_t label,
                 float target_logit, float row_max, double log_sum, float scale) {
  float out_buf[kTile];
  const double lse = static_cast<double>(row_max) + log_sum;
  for (int64_t start = 0, tile = 0; start < vocab; start += kTile, ++tile) {
    const int64_t len = std::min(kTile, vocab - start);
    const float ref = scratch.tile_ref[tile];
    const float factor =
        ref == -std::numeric_limits<float>::infinity()
            ? 0.0f
            : static_cast<float>(static_cast<double>(scale) *
                                 std::exp((static_cast<double>(ref) - row_max) - log_sum));
    const float* e = scratch.exps.data() + start;
    for (int64_t i = 0; i < len; ++i) out_buf[i] = factor * e[i];
    StoreTile<T>(out_buf, len, grad + start);
  }
  // d/dz_y: scale * (p_y - 1), computed directly rather than as a difference of stores.
  const float p_target = static_cast<float>(std::exp(static_cast<double>(target_logit) - lse));
  StoreOne<T>(scale * (p_target - 1.0f), grad + label);
}

inline float RowWeight(absl::Span<const int64_t> labels, absl::Span<const float> weights,
                       int64_t row, int64_t ignore_index) {
  if (labels[row] == ignore_index) return 0.0f;
  return weights.empty() ? 1.0f : weights[row];
}

template <typename T>
absl::StatusOr<CrossEntropyResult> RunKernel(const T* logits, T* grad, int64_t rows, int64_t vocab,
                                             absl::Span<const int64_t> labels,
                                             absl::Span<const float> weights, double d,
                                             const CrossEntropyOptions& options,
                                             int64_t row_offset) {
  std::vector<double> row_loss(static_cast<size_t>(rows), 0.0);
  std::vector<uint8_t> row_code(static_cast<size_t>(rows), kRowOk);
  // ~64K elements per task: enough tasks to balance two threads, few enough to be cheap.
  const int64_t rows_per_block = std::clamp<int64_t>(65536 / vocab, 1, 1024);
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  const int threads = rows * vocab >= (int64_t{1} << 16) ? options.num_threads : 1;
  ParallelFor(threads, blocks, [&](int64_t block) {
    thread_local RowScratch scratch;
    if (grad != nullptr && static_cast<int64_t>(scratch.exps.size()) < vocab) {
      scratch.exps.resize(static_cast<size_t>(vocab));
      scratch.tile_ref.resize(static_cast<size_t>((vocab + kTile - 1) / kTile));
    }
    const int64_t end = std::min(rows, (block + 1) * rows_per_block);
    for (int64_t r = block * rows_per_block; r < end; ++r) {
      const T* row = logits + r * vocab;
      T* grad_row = grad == nullptr ? nullptr : grad + r * vocab;
      const float w = RowWeight(labels, weights, r, options.ignore_index);
      if (w == 0.0f) {
        if (grad_row != nullptr) std::memset(grad_row, 0, static_cast<size_t>(vocab) * sizeof(T));
        continue;
      }
      const int64_t label = labels[r];
      const float target_logit = ToFloat<T>(row[label]);
      float row_max = 0.0f;
      double log_sum = 0.0;
      const uint8_t code =
          RowLogSumExp<T>(row, vocab, &row_max, &log_sum, grad_row == nullptr ? nullptr : &scratch);
      if (code != kRowOk) {
        row_code[r] = code;
        continue;
      }
      if (target_logit == -std::numeric_limits<float>::infinity()) {
        row_code[r] = kRowTargetNegInf;
        continue;
      }
      // CE = (max - z_y) + log_sum: the difference first, so large logits lose nothing.
      row_loss[r] = static_cast<double>(w) *
                    ((static_cast<double>(row_max) - static_cast<double>(target_logit)) + log_sum);
      if (grad_row != nullptr) {
        const float scale = static_cast<float>(static_cast<double>(w) / d);
        RowGradient<T>(scratch, grad_row, vocab, label, target_logit, row_max, log_sum, scale);
      }
    }
  });

  CrossEntropyResult result;
  for (int64_t r = 0; r < rows; ++r) {
    if (row_code[r] != kRowOk) {
      int64_t bad_rows = 0;
      for (int64_t q = r; q < rows; ++q) bad_rows += row_code[q] != kRowOk ? 1 : 0;
      return absl::InvalidArgumentError(
          absl::StrCat("cross-entropy: logits row ", row_offset + r, " (label ", labels[r], ") ",
                       RowCodeText(row_code[r]), "; ", bad_rows, " such row(s) in total"));
    }
    result.local_weighted_ce_sum += row_loss[r];
    const float w = RowWeight(labels, weights, r, options.ignore_index);
    result.local_weight_sum += static_cast<double>(w);
    if (labels[r] != options.ignore_index) ++result.local_valid_tokens;
  }
  result.local_loss = d > 0.0 ? result.local_weighted_ce_sum / d : 0.0;
  return result;
}

absl::Status CheckLogitsView(const TensorView& logits, absl::string_view what) {
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

absl::StatusOr<CrossEntropyResult> ForwardBackward(const TensorView& logits,
                                                   absl::Span<const int64_t> labels,
                                                   absl::Span<const float> token_weights,
                                                   double global_weight_sum,
                                                   const TensorView* grad_logits,
                                                   const CrossEntropyOptions& options) {
  absl::Status s = CheckLogitsView(logits, "logits");
  if (!s.ok()) return s;
  if (grad_logits != nullptr) {
    s = CheckLogitsView(*grad_logits, "grad_logits");
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
  return internal::CrossEntropyKernel(
      logits.raw(), grad_logits == nullptr ? nullptr : grad_logits->raw(), logits.dtype(), rows,
      vocab, labels, token_weights, global_weight_sum, options);
}

}  // namespace

namespace internal {

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

absl::StatusOr<CrossEntropyResult> CrossEntropyKernel(
    const void* logits, void* grad, DType dtype, int64_t rows, int64_t vocab,
    absl::Span<const int64_t> labels, absl::Span<const float> token_weights,
    double global_weight_sum, const CrossEntropyOptions& options, int64_t row_offset) {
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
