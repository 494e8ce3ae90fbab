#ifndef GRADSUM_CORE_EXACT_SUM_H_
#define GRADSUM_CORE_EXACT_SUM_H_

// Exact, order-independent summation (SEMANTICS.md §11, reproducible mode).
//
// A value is held as a fixed-point integer V in units of 2^kLsbExponent, split into kLimbs
// signed int64 limbs of kLimbBits bits each, least significant first:
//
//   V = sum_k limb[k] * 2^(k * kLimbBits),   value = V * 2^kLsbExponent.
//
// Integer addition is associative and commutative, so a sum built from the same
// contributions has the same V whatever the order, grouping, number of ranks or transport
// (any SUM collective over int64 adds limbs elementwise). Two values add limb by limb
// with plain int64 addition, with no carries, so a SUM all-reduce / reduce-scatter over
// kI64 carries the format unchanged (Hallberg's "reproducing sums", as in MOM6).
//
// Canonical form: limbs 0 .. kLimbs-2 in [0, 2^kLimbBits), the top limb signed. Normalize()
// moves the carries up; it changes the limbs but never V. Between two normalisations a
// limb may take at most kMaxAddsBetweenNormalize additions of canonical values or of fresh
// contributions (each limb then stays below 2^62 in magnitude: no int64 overflow). A SUM
// collective over S ranks of canonical buffers is such an addition S times.
// Normalising never shrinks the top limb, so partial sums must also stay below
// 2^(63 + (kLimbs - 1) * kLimbBits + kLsbExponent) in magnitude (2^47 for GradFormat, 2^83
// for WideFormat), far beyond the range that reads back finite.
//
// Contributions. A float or double x becomes V = round(x / 2^kLsbExponent) to the nearest
// integer, ties to even (the value itself is rounded, once, so the result does not depend
// on grouping; the process must run in the default FE_TONEAREST mode). Values below half
// an LSB become 0. A contribution that is NaN, infinite or |x| >= kMaxAbs is NOT added:
// the Add functions count it ("rejected") and the caller carries that count beside the
// sum (summed as an integer like the limbs); a sum with a nonzero rejected count reads
// back as NaN for every element of the tensor (fp32 would give NaN or Inf there; the
// training loop treats either as a non-finite gradient).
//
// Reading back. ToFloat / ToDouble depend only on V: they round V * 2^kLsbExponent
// correctly (to nearest, ties to even) to float or double. A canonical sum whose magnitude
// reached 2^kMaxExponent (overflow of the represented range) reads back as +-Inf by
// the sign of V. No subnormal results: 2^kLsbExponent is a normal float.
//
// Formats. Gradients (element-major arrays [n][kLimbs]) use GradFormat: 2 limbs x 46
// bits, LSB 2^-62 (2.2e-19), |x| < 2^29 (5.4e8), 2^16 additions between normalisations,
// 16 bytes per element on the wire (4x fp32). Scalar sums (display losses, the squared
// gradient norm) use ExactScalar's WideFormat: 4 limbs x 40 bits, LSB 2^-100, |x| < 2^59,
// self-normalising. See docs/BENCHMARKS.md for the cost of the conversions.

#include <array>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace gradsum::exact {

template <int Limbs, int LimbBits, int LsbExponent>
struct Format {
  static_assert(Limbs >= 2 && Limbs <= 4, "2..4 limbs");
  static_assert(LimbBits >= 24 && LimbBits <= 52, "limb bits in [24, 52]");
  static_assert(LsbExponent >= -126, "the LSB must be a normal float");
  static constexpr int kLimbs = Limbs;
  static constexpr int kLimbBits = LimbBits;
  static constexpr int kLsbExponent = LsbExponent;
  // |value| < 2^kMaxExponent for every contribution and every representable sum.
  static constexpr int kMaxExponent = Limbs * LimbBits - 1 + LsbExponent;
  static constexpr int64_t kMaxAddsBetweenNormalize = int64_t{1} << (62 - LimbBits);
};

using GradFormat = Format<2, 46, -62>;
using WideFormat = Format<4, 40, -100>;

// The gradient format's parameters (element-major arrays: element i is limbs
// [i * kLimbs, (i + 1) * kLimbs)).
inline constexpr int kLimbs = GradFormat::kLimbs;
inline constexpr int kLimbBits = GradFormat::kLimbBits;
inline constexpr int kLsbExponent = GradFormat::kLsbExponent;
inline constexpr int kMaxExponent = GradFormat::kMaxExponent;
inline constexpr int64_t kMaxAddsBetweenNormalize = GradFormat::kMaxAddsBetweenNormalize;
// Contributions with |x| >= kMaxAbs (or not finite) are rejected.
inline constexpr double kMaxAbs = static_cast<double>(int64_t{1} << kMaxExponent);

// ---- Element-major gradient arrays (GradFormat). ----

// limbs[i * kLimbs + k] += limb k of round(values[i]) for every i. Rejected elements
// (NaN, Inf, |x| >= kMaxAbs) are skipped and counted into *rejected (not reset).
// InvalidArgument if limbs.size() != values.size() * kLimbs or rejected is null.
absl::Status AddFloats(absl::Span<const float> values, absl::Span<int64_t> limbs,
                       int64_t* rejected);
// The same for doubles.
absl::Status AddDoubles(absl::Span<const double> values, absl::Span<int64_t> limbs,
                        int64_t* rejected);
// Adds element-major limbs `in` into `acc` (limb-wise, wrap-free under the
// kMaxAddsBetweenNormalize rule). InvalidArgument on a size mismatch.
absl::Status AddLimbs(absl::Span<const int64_t> in, absl::Span<int64_t> acc);
// Canonical form of every element (size must be a multiple of kLimbs).
absl::Status Normalize(absl::Span<int64_t> limbs);
// out[i] = the value of element i, correctly rounded to float; every out[i] is NaN when
// rejected > 0. Reads canonical or non-canonical limbs (it canonicalises a copy).
// InvalidArgument if limbs.size() != out.size() * kLimbs.
absl::Status ToFloats(absl::Span<const int64_t> limbs, int64_t rejected, absl::Span<float> out);
// One element (kLimbs limbs) to double, correctly rounded (NaN if rejected > 0).
double ToDouble(absl::Span<const int64_t> element_limbs, int64_t rejected = 0);

// ---- A self-normalising scalar sum in WideFormat (losses, squared norms). ----
//
// words(): kWords int64 (the limbs, then the rejected count) that a SUM collective over
// kI64 adds elementwise; call Normalize() before sending (then up to 2^22 ranks).
class ExactScalar {
 public:
  static constexpr int kLimbs = WideFormat::kLimbs;
  static constexpr int kWords = kLimbs + 1;
  static constexpr double kMaxAbs = static_cast<double>(int64_t{1} << WideFormat::kMaxExponent);

  // Adds one value (rejected when NaN, Inf or |v| >= kMaxAbs).
  void Add(double v);
  // Adds v[i] * v[i] for every i (each square exact in double, then rounded to the LSB).
  void AddSquares(absl::Span<const float> v);
  // Adds another sum (its limbs and rejected count).
  void Add(const ExactScalar& other);
  void Normalize();
  // The value, correctly rounded; NaN if anything was rejected; +-Inf on range overflow.
  double ToDouble() const;
  int64_t rejected() const { return words_[kLimbs]; }
  bool IsZero() const;

  absl::Span<int64_t> words() { return absl::MakeSpan(words_); }
  absl::Span<const int64_t> words() const { return absl::MakeConstSpan(words_); }

 private:
  void CountAdd();
  std::array<int64_t, kWords> words_{};
  int64_t adds_since_normalize_ = 0;
};

}  // namespace gradsum::exact

#endif  // GRADSUM_CORE_EXACT_SUM_H_
