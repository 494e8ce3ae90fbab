// FastExpFma (core/fast_exp.inc) as the generic build compiles it (no FMA instruction in the
// baseline x86-64 target: the exact emulation in double) against libm's correctly rounded
// fmaf, on random operands and on sums built to land exactly on, and one unit of the last
// place either side of, the midpoint between two floats (where rounding twice goes wrong);
// FastExpNonPositive against FastExp; and the AVX-512 form FastExpNonPositive16 against the
// scalar form as the generic build compiles it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/cpu_isa.h"
#include "gtest/gtest.h"

#if defined(GRADSUM_ISA_X86)
#include <immintrin.h>
#endif

namespace gradsum {
#if defined(GRADSUM_ISA_X86)
namespace fast_exp_avx512 {
#define GRADSUM_ISA_AVX512 1
#define GRADSUM_ISA_TARGET GRADSUM_ISA_TARGET_AVX512
#define GRADSUM_ISA_BODY "core/fast_exp_test_avx512.inc"
#include "core/isa_build.inc"
#undef GRADSUM_ISA_AVX512
#undef GRADSUM_ISA_AVX
}  // namespace fast_exp_avx512
#endif

namespace {

#include "core/fast_exp.inc"

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

TEST(FastExpFmaTest, RoundsOnceLikeLibmFmaf) {
  std::mt19937_64 gen(42);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  auto random_float = [&](int lo, int hi) {
    const float v = std::ldexp(mantissa(gen), lo + static_cast<int>(gen() % (hi - lo + 1)));
    return (gen() & 1) != 0 ? -v : v;
  };
  int64_t checked = 0, midpoints = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    const float a = random_float(-30, 10), b = random_float(-30, 10);
    float c;
    switch (i % 3) {
      case 0:  // unrelated magnitudes
        c = random_float(-40, 20);
        break;
      case 1: {  // cancellation against the rounded product
        c = -(a * b) * (1.0f + std::ldexp(1.0f, -static_cast<int>(gen() % 24)));
        break;
      }
      default: {  // a * b + c exactly halfway between two floats, or one double ulp off
        const double p = static_cast<double>(a) * static_cast<double>(b);
        const float f = static_cast<float>(p);
        const double half_ulp = std::ldexp(1.0, std::ilogb(f) - 24);
        c = static_cast<float>((static_cast<double>(f) + half_ulp) - p);
        if (gen() % 3 == 0) c = std::nextafterf(c, (gen() & 1) != 0 ? 1e30f : -1e30f);
        double s = p + static_cast<double>(c);
        uint64_t s_bits;
        std::memcpy(&s_bits, &s, sizeof(s_bits));
        midpoints += (static_cast<uint32_t>(s_bits) & 0x1FFFFFFFu) == 0x10000000u ? 1 : 0;
      }
    }
    const float want = std::fmaf(a, b, c);
    const float got = FastExpFma(a, b, c);
    ASSERT_EQ(Bits(got), Bits(want)) << std::hexfloat << a << " * " << b << " + " << c;
    ++checked;
  }
  EXPECT_GT(midpoints, 100'000);  // the hard case was exercised
  EXPECT_EQ(checked, 2'000'000);
}

// The inputs of FastExpNonPositive's tests: every 4099th bit pattern of the negative
// floats, from -0 through -inf to the negative NaNs, and fourteen edges (+0, NaNs of both
// signs, -86 and its neighbours, the smallest negative subnormal, about -ln 2).
constexpr int64_t kNonPositiveProbes = (0x80000000LL + 4098) / 4099 + 14;
std::vector<uint32_t> NonPositiveProbeBits() {
  std::vector<uint32_t> bits;
  for (uint64_t b = 0x80000000u; b <= 0xFFFFFFFFu; b += 4099)
    bits.push_back(static_cast<uint32_t>(b));
  for (uint32_t b : {0x00000000u, 0x80000000u, 0xFF800000u, 0xFF800001u, 0xFFC00000u, 0xFFFFFFFFu,
                     0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 0xC2AC0000u /* -86 */, 0xC2ABFFFFu,
                     0xC2AC0001u, 0x80000001u /* -subnormal */, 0xBF317218u}) {
    bits.push_back(b);
  }
  return bits;
}

// FastExpNonPositive drops only FastExp's overflow select, which no x <= 0 or NaN takes:
// the same bits on every such input.
TEST(FastExpNonPositiveTest, SameBitsAsFastExpOnNonPositiveInputs) {
  int64_t checked = 0;
  for (uint32_t bits : NonPositiveProbeBits()) {
    float x;
    std::memcpy(&x, &bits, sizeof(x));
    ASSERT_EQ(Bits(FastExpNonPositive(x)), Bits(FastExp(x))) << std::hexfloat << x;
    ++checked;
  }
  EXPECT_EQ(checked, kNonPositiveProbes);
}

// The AVX-512 form computes what the scalar one does, 16 lanes at a time: the same bits for
// every x <= 0 that is not NaN (the probes above), and a NaN for a NaN (its bits may
// differ). The lanes of one call hold unrelated values.
TEST(FastExpNonPositive16Test, SameBitsAsTheScalarFormOnNonPositiveInputs) {
#if defined(GRADSUM_ISA_X86)
  if (!CpuHasAvx512()) GTEST_SKIP() << "this CPU has no AVX-512";
  std::vector<uint32_t> bits = NonPositiveProbeBits();
  std::mt19937 gen(7);
  std::shuffle(bits.begin(), bits.end(), gen);
  while (bits.size() % 16 != 0) bits.push_back(0xBF800000u);  // -1
  int64_t numbers = 0, nans = 0, nonzero = 0;
  for (size_t i = 0; i < bits.size(); i += 16) {
    float x[16], got[16];
    std::memcpy(x, bits.data() + i, sizeof(x));
    fast_exp_avx512::ExpNonPositive16(x, got);
    for (int k = 0; k < 16; ++k) {
      if (std::isnan(x[k])) {
        ASSERT_TRUE(std::isnan(got[k])) << "lane " << k << ": " << got[k];
        ++nans;
      } else {
        ASSERT_EQ(Bits(got[k]), Bits(FastExpNonPositive(x[k]))) << std::hexfloat << x[k];
        ++numbers;
        nonzero += got[k] != 0.0f ? 1 : 0;
      }
    }
  }
  // The negative NaNs are 2^23 - 1 of the 2^31 patterns swept; the sweep covers both sides
  // of -86 (below it the answer is 0).
  EXPECT_GT(nans, 1000);
  EXPECT_GT(numbers, 500000);
  EXPECT_GT(nonzero, 1000);
  EXPECT_LT(nonzero, numbers);
#else
  GTEST_SKIP() << "the AVX-512 form is built on x86-64 only";
#endif
}

}  // namespace
}  // namespace gradsum
