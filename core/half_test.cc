// bf16 / f16 conversions against an independent exact reference.
//
// The reference never calls the code under test: it decodes bit patterns with ldexp
// and rounds by comparing exact distances (in double) to the two neighbouring
// representable values, ties to the even one, with +-Inf standing for 2^128 (bf16)
// and 2^16 (f16) as IEEE 754's overflow rule says.
#include "core/half.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace gradsum {
namespace {

// Exact value of a bf16 bit pattern (finite only), decoded by formula.
double RefBF16Value(uint16_t b) {
  const int sign = b >> 15;
  const int exp = (b >> 7) & 0xff;
  const int mant = b & 0x7f;
  double v = exp == 0 ? std::ldexp(mant, -126 - 7) : std::ldexp(128 + mant, exp - 127 - 7);
  return sign ? -v : v;
}

double RefF16Value(uint16_t h) {
  const int sign = h >> 15;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  double v = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 15 - 10);
  return sign ? -v : v;
}

bool IsNanBF16(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }
bool IsNanF16(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

// Reference rounding of a finite, non-negative double `x` onto a sorted list of
// non-negative representable magnitudes `grid` (grid.back() stands for +Inf at the
// overflow threshold). Returns the index; ties go to the even index (even mantissa).
size_t RefRoundIndex(const std::vector<double>& grid, double x) {
  auto it = std::lower_bound(grid.begin(), grid.end(), x);
  if (it == grid.end()) return grid.size() - 1;
  size_t hi = static_cast<size_t>(it - grid.begin());
  if (grid[hi] == x || hi == 0) return hi;
  size_t lo = hi - 1;
  const double dlo = x - grid[lo], dhi = grid[hi] - x;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo % 2 == 0) ? lo : hi;
}

// Non-negative bf16 magnitudes 0x0000..0x7f7f, then Inf as 2^128.
std::vector<double> BF16Grid() {
  std::vector<double> g;
  for (uint32_t b = 0; b <= 0x7f7f; ++b) g.push_back(RefBF16Value(static_cast<uint16_t>(b)));
  g.push_back(std::ldexp(1.0, 128));
  return g;
}

std::vector<double> F16Grid() {
  std::vector<double> g;
  for (uint32_t h = 0; h <= 0x7bff; ++h) g.push_back(RefF16Value(static_cast<uint16_t>(h)));
  g.push_back(std::ldexp(1.0, 16));
  return g;
}

TEST(BF16, EveryBitPatternRoundTrips) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float f = BF16::FromBits(bits).ToFloat();
    const uint16_t back = BF16::FromFloat(f).bits;
    if (IsNanBF16(bits)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << b;
      ASSERT_TRUE(IsNanBF16(back)) << std::hex << b;
      ASSERT_EQ(back & 0x8000, bits & 0x8000) << "NaN sign lost for " << std::hex << b;
    } else {
      ASSERT_EQ(back, bits) << std::hex << b;
      if ((bits & 0x7f80) != 0x7f80) {
        ASSERT_EQ(static_cast<double>(f), RefBF16Value(bits)) << std::hex << b;
      } else {
        ASSERT_TRUE(std::isinf(f)) << std::hex << b;
      }
    }
  }
}

void CheckBF16Rounding(float f, const std::vector<double>& grid) {
  const uint16_t got = BF16::FromFloat(f).bits;
  if (std::isnan(f)) {
    ASSERT_TRUE(IsNanBF16(got)) << f;
    return;
  }
  const double x = std::fabs(static_cast<double>(f));
  const size_t idx = std::isinf(f) ? grid.size() - 1 : RefRoundIndex(grid, x);
  const uint16_t mag = idx == grid.size() - 1 ? 0x7f80 : static_cast<uint16_t>(idx);
  const uint16_t want = static_cast<uint16_t>(mag | (std::signbit(f) ? 0x8000 : 0));
  ASSERT_EQ(got, want) << "float bits " << std::hex << FloatBits(f);
}

TEST(BF16, RoundsToNearestEvenOnEveryTieAndNeighbours) {
  const std::vector<double> grid = BF16Grid();
  int checked = 0;
  for (uint32_t hi = 0; hi <= 0xffff; ++hi) {
    // The exact midpoint between bf16 patterns hi and hi+1, and its float neighbours.
    const uint32_t mid = (hi << 16) | 0x8000u;
    for (uint32_t u : {mid - 1, mid, mid + 1, hi << 16, (hi << 16) | 0x1u, (hi << 16) | 0xffffu}) {
      CheckBF16Rounding(BitsToFloat(u), grid);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6 * 65536);
}

TEST(BF16, RoundsCorrectlyOnAStrideOfAllFloats) {
  const std::vector<double> grid = BF16Grid();
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) {
    CheckBF16Rounding(BitsToFloat(static_cast<uint32_t>(u)), grid);
  }
}

TEST(BF16, SpecialValues) {
  EXPECT_EQ(BF16::FromFloat(0.0f).bits, 0x0000);
  EXPECT_EQ(BF16::FromFloat(-0.0f).bits, 0x8000);
  EXPECT_EQ(BF16::FromFloat(1.0f).bits, 0x3f80);
  EXPECT_EQ(BF16::FromFloat(std::numeric_limits<float>::infinity()).bits, 0x7f80);
  EXPECT_EQ(BF16::FromFloat(-std::numeric_limits<float>::infinity()).bits, 0xff80);
  EXPECT_EQ(BF16::FromFloat(std::numeric_limits<float>::max()).bits, 0x7f80);  // overflow
  // A NaN whose payload lives only in the low 16 bits must not become Inf.
  EXPECT_TRUE(std::isnan(BF16::FromFloat(BitsToFloat(0x7f800001u)).ToFloat()));
  EXPECT_TRUE(std::isnan(BF16::FromFloat(BitsToFloat(0xff800001u)).ToFloat()));
  // Smallest float subnormal rounds to zero; bf16 subnormals survive.
  EXPECT_EQ(BF16::FromFloat(BitsToFloat(0x00000001u)).bits, 0x0000);
  EXPECT_EQ(BF16::FromFloat(BitsToFloat(0x00010000u)).bits, 0x0001);
}

TEST(F16, EveryBitPatternRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = F16::FromBits(bits).ToFloat();
    const uint16_t back = F16::FromFloat(f).bits;
    if (IsNanF16(bits)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(IsNanF16(back)) << std::hex << h;
      ASSERT_EQ(back & 0x8000, bits & 0x8000) << std::hex << h;
    } else {
      ASSERT_EQ(back, bits) << std::hex << h;
      if ((bits & 0x7c00) != 0x7c00) {
        ASSERT_EQ(static_cast<double>(f), RefF16Value(bits)) << std::hex << h;
      } else {
        ASSERT_TRUE(std::isinf(f)) << std::hex << h;
      }
    }
  }
}

void CheckF16Rounding(float f, const std::vector<double>& grid) {
  const uint16_t got = F16::FromFloat(f).bits;
  if (std::isnan(f)) {
    ASSERT_TRUE(IsNanF16(got)) << f;
    return;
  }
  const double x = std::fabs(static_cast<double>(f));
  const size_t idx = std::isinf(f) ? grid.size() - 1 : RefRoundIndex(grid, x);
  const uint16_t mag = idx == grid.size() - 1 ? 0x7c00 : static_cast<uint16_t>(idx);
  const uint16_t want = static_cast<uint16_t>(mag | (std::signbit(f) ? 0x8000 : 0));
  ASSERT_EQ(got, want) << "float " << f << " bits " << std::hex << FloatBits(f);
}

TEST(F16, RoundsToNearestEvenOnEveryTieAndNeighbours) {
  const std::vector<double> grid = F16Grid();
  for (size_t i = 0; i + 1 < grid.size(); ++i) {
    const float mid = static_cast<float>((grid[i] + grid[i + 1]) / 2);  // exact in float
    ASSERT_EQ(static_cast<double>(mid), (grid[i] + grid[i + 1]) / 2);
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f), -mid}) {
      CheckF16Rounding(f, grid);
    }
  }
  // Below half the smallest subnormal: zero; exactly half: ties to even (zero).
  CheckF16Rounding(std::ldexp(1.0f, -25), grid);
  CheckF16Rounding(std::nextafter(std::ldexp(1.0f, -25), 1.0f), grid);
}

TEST(F16, RoundsCorrectlyOnAStrideOfAllFloats) {
  const std::vector<double> grid = F16Grid();
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) {
    CheckF16Rounding(BitsToFloat(static_cast<uint32_t>(u)), grid);
  }
}

TEST(F16, SpecialValues) {
  EXPECT_EQ(F16::FromFloat(1.0f).bits, 0x3c00);
  EXPECT_EQ(F16::FromFloat(65504.0f).bits, 0x7bff);
  EXPECT_EQ(F16::FromFloat(65519.0f).bits, 0x7bff);
  EXPECT_EQ(F16::FromFloat(65520.0f).bits, 0x7c00);  // the tie above max goes to Inf
  EXPECT_EQ(F16::FromFloat(-1e9f).bits, 0xfc00);
  EXPECT_EQ(F16::FromFloat(std::ldexp(1.0f, -24)).bits, 0x0001);
  EXPECT_TRUE(std::isnan(F16::FromFloat(std::nanf("")).ToFloat()));
  EXPECT_TRUE(std::isnan(F16::FromFloat(BitsToFloat(0x7f800001u)).ToFloat()));
}

}  // namespace
}  // namespace gradsum
