#include "core/exact_sum.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "core/exact_add.h"

namespace gradsum::exact {
namespace {

constexpr double Pow2(int e) {
  double r = 1.0;
  for (; e > 0; --e) r *= 2.0;
  for (; e < 0; ++e) r *= 0.5;
  return r;
}

// Rounding to an integer, ties to even, for |y| < 2^51 (FE_TONEAREST): t = y + 1.5 * 2^52
// leaves no fraction bits; the integer sits in the low mantissa bits (read off by
// subtracting the constant's bit pattern) and, as a double, is t - 1.5 * 2^52. No
// float <-> int conversion instructions (SSE2 has none for 64-bit lanes). Not folded: the
// build has no -ffast-math.
constexpr double kRoundMagic = 6755399441055744.0;  // 1.5 * 2^52
constexpr int64_t kRoundMagicBits = 0x4338000000000000;

template <class F>
struct Consts {
  static constexpr double kScale = Pow2(-F::kLsbExponent);  // value -> units of the LSB
  static constexpr double kMaxAbs = Pow2(F::kMaxExponent);
  static constexpr int64_t kMask = (int64_t{1} << F::kLimbBits) - 1;
};

// 2^e as a T (float or double), built from its exponent bits (exact; e within T's normal
// range).
template <class T>
inline T Pow2Of(int e) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr int kMantissaBits = std::numeric_limits<T>::digits - 1;
  constexpr int kBias = std::numeric_limits<T>::max_exponent - 1;
  const U bits = static_cast<U>(e + kBias) << kMantissaBits;
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

// Split below runs on one double (D = double, I = int64_t) or on two at once (GCC vector
// extensions, SSE2 at the baseline ISA: D = V2d, I = V2i); every operation is written once
// for both. A mask is all ones (-1) in an accepted lane, 0 in a rejected one.
using V2d = double __attribute__((vector_size(16)));
using V2i = int64_t __attribute__((vector_size(16)));
inline int64_t LessMask(double a, double b) { return -static_cast<int64_t>(a < b); }
inline V2i LessMask(V2d a, V2d b) { return a < b; }  // -1 where true
template <class To, class From>
inline To BitCast(From v) {
  return __builtin_bit_cast(To, v);
}

// Limbs K-1 .. 1 of y (in LSB units), top first: q_k = round(y / 2^(B k)), then
// y -= q_k * 2^(B k). Unrolled at compile time so the units are immediate constants.
template <class F, int K, class D, class I>
inline void SplitHigh(D& y, I* q) {
  if constexpr (K >= 1) {
    constexpr double kUnit = Pow2(F::kLimbBits * K);
    constexpr double kInv = Pow2(-F::kLimbBits * K);
    const D t = y * kInv + kRoundMagic;
    q[K] = BitCast<I>(t) - kRoundMagicBits;
    y -= (t - kRoundMagic) * kUnit;
    SplitHigh<F, K - 1>(y, q);
  }
}

// Splits x into the limbs of round(x / LSB), q[0] least significant; returns the accept
// mask (rejected lanes: NaN, Inf, |x| >= kMaxAbs, get zero limbs). Each remainder above
// is a multiple of y's ulp no larger than |y| (or 0), so every step is exact and only the
// value itself is rounded, once, to nearest-even: every higher limb is a multiple of 2^B
// (even), so rounding the last remainder is rounding the whole value. Branch-free.
template <class F, class D, class I>
inline I Split(D x, I* q) {
  constexpr int64_t kAbs = INT64_MAX;  // clears the sign bit
  const I ok = LessMask(BitCast<D>(BitCast<I>(x) & kAbs), D{} + Consts<F>::kMaxAbs);
  // y = x / LSB (exact: a power of two), or +0 when rejected (NaN fails the comparison).
  D y = BitCast<D>(BitCast<I>(x * Consts<F>::kScale) & ok);
  SplitHigh<F, F::kLimbs - 1>(y, q);
  q[0] = BitCast<I>(y + kRoundMagic) - kRoundMagicBits;
  return ok;
}

template <class F>
inline void NormalizeElement(int64_t* c) {
  for (int k = 0; k + 1 < F::kLimbs; ++k) {
    const int64_t carry = c[k] >> F::kLimbBits;  // floor division (arithmetic shift)
    c[k] &= Consts<F>::kMask;
    c[k + 1] += carry;
  }
}

// Correctly rounded value of an element's limbs (any form) as T (float or double).
template <class F, class T>
T ElementTo(const int64_t* limbs) {
  int64_t c[F::kLimbs];
  std::memcpy(c, limbs, sizeof(c));
  NormalizeElement<F>(c);
  const int64_t top_limit = int64_t{1} << (F::kLimbBits - 1);
  int64_t& top = c[F::kLimbs - 1];
  if (top >= top_limit) return std::numeric_limits<T>::infinity();
  if (top < -top_limit) return -std::numeric_limits<T>::infinity();
  const bool negative = top < 0;
  if (negative) {
    for (int64_t& v : c) v = -v;
    NormalizeElement<F>(c);
  }
  // The magnitude, packed into 192 bits (the canonical limbs do not overlap).
  static_assert(F::kLimbs * F::kLimbBits <= 192, "fits three words");
  uint64_t w[3] = {0, 0, 0};
  for (int k = 0; k < F::kLimbs; ++k) {
    const uint64_t v = static_cast<uint64_t>(c[k]);
    const int o = k * F::kLimbBits;
    const int wi = o / 64, b = o % 64;
    w[wi] |= v << b;
    if (b != 0 && b + F::kLimbBits > 64) w[wi + 1] |= v >> (64 - b);
  }
  int msb = -1;
  for (int i = 2; i >= 0 && msb < 0; --i) {
    if (w[i] != 0) msb = 64 * i + 63 - __builtin_clzll(w[i]);
  }
  if (msb < 0) return T(0);
  uint64_t mant;
  int shift = 0;
  if (msb < 64) {
    mant = w[0];
  } else {
    // 64 bits [shift, shift + 64) and a sticky bit for everything below: bit 0 lies far
    // below the rounding position of float and double, so the conversion of `mant`
    // rounds exactly as the full magnitude would.
    shift = msb - 63;
    const int wi = shift / 64, b = shift % 64;
    mant = w[wi] >> b;
    if (b != 0) mant |= w[wi + 1] << (64 - b);
    bool sticky = b != 0 && (w[wi] & ((uint64_t{1} << b) - 1)) != 0;
    for (int i = 0; i < wi; ++i) sticky = sticky || w[i] != 0;
    mant |= sticky ? 1u : 0u;
  }
  // (T)mant rounds to nearest-even; the scaling is exact (normal results only: the
  // format's LSB and range are within T's normal exponents).
  static_assert(F::kLsbExponent >= -126 && F::kMaxExponent <= 127, "normal in float");
  const T r = static_cast<T>(mant) * Pow2Of<T>(shift + F::kLsbExponent);
  return negative ? -r : r;
}

template <class T>
absl::Status AddValues(absl::Span<const T> values, absl::Span<int64_t> limbs, int64_t* rejected) {
  if (rejected == nullptr) return absl::InvalidArgumentError("exact::Add: null rejected count");
  if (limbs.size() != values.size() * kLimbs) {
    return absl::InvalidArgumentError(absl::StrCat("exact::Add: ", values.size(), " values need ",
                                                   values.size() * kLimbs, " limbs, got ",
                                                   limbs.size()));
  }
  // Split<GradFormat> for every element, as core/exact_add.inc's per-ISA builds (baseline,
  // AVX2, AVX-512, picked at run time): the same integers, wider vectors than the pair
  // loop SSE2 allows (reproducible mode adds every contribution through here).
  const internal::AddKernels& k = internal::SelectedAddKernels();
  if constexpr (std::is_same_v<T, float>) {
    *rejected += k.add_floats(values.data(), values.size(), limbs.data());
  } else {
    *rejected += k.add_doubles(values.data(), values.size(), limbs.data());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AddFloats(absl::Span<const float> values, absl::Span<int64_t> limbs,
                       int64_t* rejected) {
  return AddValues(values, limbs, rejected);
}

absl::Status AddDoubles(absl::Span<const double> values, absl::Span<int64_t> limbs,
                        int64_t* rejected) {
  return AddValues(values, limbs, rejected);
}

absl::Status AddLimbs(absl::Span<const int64_t> in, absl::Span<int64_t> acc) {
  if (in.size() != acc.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("exact::AddLimbs: ", in.size(), " limbs into ", acc.size()));
  }
  for (size_t i = 0; i < in.size(); ++i) acc[i] += in[i];
  return absl::OkStatus();
}

absl::Status Normalize(absl::Span<int64_t> limbs) {
  if (limbs.size() % kLimbs != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("exact::Normalize: ", limbs.size(), " limbs is not a multiple of ", kLimbs));
  }
  for (size_t i = 0; i < limbs.size(); i += kLimbs) NormalizeElement<GradFormat>(&limbs[i]);
  return absl::OkStatus();
}

absl::Status ToFloats(absl::Span<const int64_t> limbs, int64_t rejected, absl::Span<float> out) {
  if (limbs.size() != out.size() * kLimbs) {
    return absl::InvalidArgumentError(
        absl::StrCat("exact::ToFloats: ", limbs.size(), " limbs for ", out.size(), " floats"));
  }
  if (rejected != 0) {
    for (float& f : out) f = std::numeric_limits<float>::quiet_NaN();
    return absl::OkStatus();
  }
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = ElementTo<GradFormat, float>(&limbs[i * kLimbs]);
  }
  return absl::OkStatus();
}

double ToDouble(absl::Span<const int64_t> element_limbs, int64_t rejected) {
  if (rejected != 0 || element_limbs.size() != static_cast<size_t>(kLimbs)) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  return ElementTo<GradFormat, double>(element_limbs.data());
}

// ---- ExactScalar ----

void ExactScalar::CountAdd() {
  if (++adds_since_normalize_ >= WideFormat::kMaxAddsBetweenNormalize) Normalize();
}

void ExactScalar::Add(double v) {
  int64_t q[kLimbs];
  if (Split<WideFormat>(v, q) == 0) {
    ++words_[kLimbs];
    return;
  }
  for (int k = 0; k < kLimbs; ++k) words_[k] += q[k];
  CountAdd();
}

void ExactScalar::AddSquares(absl::Span<const float> v) {
  // Two squares at a time into per-lane limb sums, folded into words_ every 2^20 pairs:
  // a lane then holds at most 2^20 limbs of magnitude <= 2^40, so the two lanes and the
  // normalised words add without overflow.
  constexpr int64_t kFoldEvery = int64_t{1} << 20;
  size_t i = 0;
  while (i + 2 <= v.size()) {
    V2i acc[kLimbs] = {};
    V2i accepted = {0, 0};  // minus the accepted count per lane
    int64_t pairs = 0;
    for (; i + 2 <= v.size() && pairs < kFoldEvery; i += 2, ++pairs) {
      const V2d sq = {static_cast<double>(v[i]) * v[i], static_cast<double>(v[i + 1]) * v[i + 1]};
      V2i q[kLimbs];
      accepted += Split<WideFormat>(sq, q);
      for (int k = 0; k < kLimbs; ++k) acc[k] += q[k];
    }
    Normalize();
    for (int k = 0; k < kLimbs; ++k) words_[k] += acc[k][0] + acc[k][1];
    words_[kLimbs] += 2 * pairs + accepted[0] + accepted[1];
    Normalize();
  }
  for (; i < v.size(); ++i) Add(static_cast<double>(v[i]) * v[i]);
}

void ExactScalar::Add(const ExactScalar& other) {
  ExactScalar o = other;
  o.Normalize();
  for (int k = 0; k < kWords; ++k) words_[k] += o.words_[k];
  CountAdd();
}

void ExactScalar::Normalize() {
  NormalizeElement<WideFormat>(words_.data());
  adds_since_normalize_ = 0;
}

double ExactScalar::ToDouble() const {
  if (rejected() != 0) return std::numeric_limits<double>::quiet_NaN();
  return ElementTo<WideFormat, double>(words_.data());
}

bool ExactScalar::IsZero() const {
  int64_t c[kLimbs];
  std::memcpy(c, words_.data(), sizeof(c));
  NormalizeElement<WideFormat>(c);
  for (int64_t v : c) {
    if (v != 0) return false;
  }
  return rejected() == 0;
}

}  // namespace gradsum::exact
