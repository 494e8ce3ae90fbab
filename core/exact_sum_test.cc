// exact_sum against an independent reference (testing/exact_sum_reference.h: integer
// rounding of frexp's mantissa, __int128 sums, the compiler's conversions). Accuracy is
// also checked against long-double sums.
#include "core/exact_sum.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "testing/exact_sum_reference.h"

namespace gradsum::exact {
namespace {

using exact_reference::i128;
using RefUnitsFn = i128 (*)(double, int);
constexpr RefUnitsFn RefUnits = exact_reference::Units;
float RefFloat(i128 v, int lsb) { return exact_reference::ToFloat(v, lsb); }
double RefDouble(i128 v, int lsb) { return exact_reference::ToDouble(v, lsb); }

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Floats spread over the whole accepted range (and below the LSB), both signs.
std::vector<float> RandomFloats(size_t n, uint32_t seed, int min_exp = -80, int max_exp = 28) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(min_exp, max_exp);
  std::vector<float> v(n);
  for (float& x : v) {
    x = std::ldexp(mant(rng), ex(rng));
    if (rng() & 1) x = -x;
  }
  return v;
}

// Sums `values` (n elements per contribution row) the way a caller would: each row added
// into `acc`, normalised now and then.
std::vector<float> ExactSumRows(const std::vector<std::vector<float>>& rows, size_t n) {
  std::vector<int64_t> acc(n * kLimbs, 0);
  int64_t rejected = 0;
  for (const auto& r : rows) EXPECT_TRUE(AddFloats(r, absl::MakeSpan(acc), &rejected).ok());
  EXPECT_TRUE(Normalize(absl::MakeSpan(acc)).ok());
  std::vector<float> out(n);
  EXPECT_TRUE(ToFloats(acc, rejected, absl::MakeSpan(out)).ok());
  return out;
}

TEST(ExactSumTest, FormatConstants) {
  EXPECT_EQ(kLimbs, 2);
  EXPECT_EQ(kLsbExponent, -62);
  EXPECT_EQ(kMaxExponent, 29);
  EXPECT_EQ(kMaxAbs, std::ldexp(1.0, 29));
  EXPECT_EQ(kMaxAddsBetweenNormalize, int64_t{1} << 16);
}

TEST(ExactSumTest, SingleValuesRoundTripAndRoundToTheLsb) {
  const std::vector<double> cases = {
      0.0,
      1.0,
      -1.0,
      3.5,
      1e-3,
      -7.25e5,
      std::ldexp(1.0, -62),
      std::ldexp(3.0, -62),
      std::ldexp(1.0, -63),                        // half an LSB: ties to even -> 0
      std::ldexp(3.0, -63),                        // 1.5 LSB -> 2 LSB
      std::ldexp(5.0, -63),                        // 2.5 LSB -> 2 LSB
      -std::ldexp(3.0, -63),                       // -1.5 LSB -> -2 LSB
      std::ldexp(1.0, -70),                        // below the LSB -> 0
      1e-40,                                       // a float denormal -> 0
      std::ldexp(1.0, 29) - std::ldexp(1.0, 5),    // just inside the range
      -(std::ldexp(1.0, 29) - 64.0),               // a float too
      std::ldexp(1.0, 17) + std::ldexp(1.0, -40),  // crosses the limb boundary (2^-16)
  };
  for (double x : cases) {
    std::vector<int64_t> limbs(kLimbs, 0);
    int64_t rejected = 0;
    const float xf = static_cast<float>(x);
    ASSERT_TRUE(AddDoubles({&x, 1}, absl::MakeSpan(limbs), &rejected).ok());
    EXPECT_EQ(rejected, 0);
    EXPECT_EQ(ToDouble(limbs), RefDouble(RefUnits(x, -62), -62)) << x;
    std::vector<int64_t> flimbs(kLimbs, 0);
    ASSERT_TRUE(AddFloats({&xf, 1}, absl::MakeSpan(flimbs), &rejected).ok());
    float out;
    ASSERT_TRUE(ToFloats(flimbs, rejected, {&out, 1}).ok());
    EXPECT_EQ(Bits(out), Bits(RefFloat(RefUnits(xf, -62), -62))) << x;
  }
  // Spot values stated by hand, independent of the reference.
  auto one = [](double x) {
    std::vector<int64_t> l(kLimbs, 0);
    int64_t r = 0;
    EXPECT_TRUE(AddDoubles({&x, 1}, absl::MakeSpan(l), &r).ok());
    return ToDouble(l);
  };
  EXPECT_EQ(one(std::ldexp(1.0, -63)), 0.0);
  EXPECT_EQ(one(std::ldexp(3.0, -63)), std::ldexp(2.0, -62));
  EXPECT_EQ(one(std::ldexp(5.0, -63)), std::ldexp(2.0, -62));
  EXPECT_EQ(one(std::ldexp(7.0, -63)), std::ldexp(4.0, -62));
  EXPECT_EQ(one(-std::ldexp(3.0, -63)), -std::ldexp(2.0, -62));
  EXPECT_EQ(one(0.1), std::ldexp(std::nearbyint(std::ldexp(0.1, 62)), -62));
}

TEST(ExactSumTest, RejectsNonFiniteAndOutOfRange) {
  const std::vector<float> bad = {std::numeric_limits<float>::quiet_NaN(),
                                  std::numeric_limits<float>::infinity(),
                                  -std::numeric_limits<float>::infinity(),
                                  std::ldexp(1.0f, 29),
                                  -std::ldexp(1.0f, 29),
                                  1e30f};
  for (float b : bad) {
    for (int pos = 0; pos < 5; ++pos) {  // in either lane of a pair, and in the odd tail
      std::vector<float> v = {1.0f, 2.0f, 3.0f, 4.0f, 5.0f};
      v[pos] = b;
      std::vector<int64_t> limbs(5 * kLimbs, 0);
      int64_t rejected = 5;  // accumulates, is not reset
      ASSERT_TRUE(AddFloats(v, absl::MakeSpan(limbs), &rejected).ok());
      EXPECT_EQ(rejected, 6) << b << " at " << pos;
      std::vector<float> out(5);
      ASSERT_TRUE(ToFloats(limbs, rejected, absl::MakeSpan(out)).ok());
      for (float o : out) EXPECT_TRUE(std::isnan(o)) << b;  // the whole tensor reads NaN
      // The other elements were still added (the count, not the limbs, carries the flag).
      ASSERT_TRUE(ToFloats(limbs, 0, absl::MakeSpan(out)).ok());
      for (int i = 0; i < 5; ++i) EXPECT_EQ(out[i], i == pos ? 0.0f : i + 1.0f) << b << " " << pos;
    }
  }
}

TEST(ExactSumTest, SumOverflowReadsAsSignedInfinity) {
  const double big = std::ldexp(1.0, 28) * 1.5;  // in range; two of them are not
  std::vector<double> v = {big, big};
  std::vector<int64_t> acc(kLimbs, 0);
  int64_t rejected = 0;
  ASSERT_TRUE(AddDoubles({&v[0], 1}, absl::MakeSpan(acc), &rejected).ok());
  ASSERT_TRUE(AddDoubles({&v[1], 1}, absl::MakeSpan(acc), &rejected).ok());
  EXPECT_EQ(rejected, 0);
  EXPECT_EQ(ToDouble(acc), std::numeric_limits<double>::infinity());
  std::vector<int64_t> neg(kLimbs, 0);
  const double nb = -big;
  ASSERT_TRUE(AddDoubles({&nb, 1}, absl::MakeSpan(neg), &rejected).ok());
  ASSERT_TRUE(AddDoubles({&nb, 1}, absl::MakeSpan(neg), &rejected).ok());
  EXPECT_EQ(ToDouble(neg), -std::numeric_limits<double>::infinity());
  // Back in range after a cancelling contribution: exact again, whatever came between.
  ASSERT_TRUE(AddDoubles({&nb, 1}, absl::MakeSpan(acc), &rejected).ok());
  EXPECT_EQ(ToDouble(acc), big);
}

TEST(ExactSumTest, RandomSumsMatchTheReferenceBitForBit) {
  const size_t n = 257, rows = 40;
  std::vector<std::vector<float>> contrib;
  // Up to 2^23 each: the sums of 40 stay inside the range (2^29).
  for (size_t r = 0; r < rows; ++r) contrib.push_back(RandomFloats(n, 100 + r, -80, 22));
  const std::vector<float> got = ExactSumRows(contrib, n);
  for (size_t i = 0; i < n; ++i) {
    i128 v = 0;
    long double ld = 0;
    for (size_t r = 0; r < rows; ++r) {
      v += RefUnits(contrib[r][i], -62);
      ld += contrib[r][i];
    }
    ASSERT_EQ(Bits(got[i]), Bits(RefFloat(v, -62))) << i;
    // Accuracy: within half an fp32 ulp of the exact sum plus the per-term LSB rounding.
    const long double tol = std::fabs(ld) * std::ldexp(1.0L, -24) + rows * std::ldexp(1.0L, -63);
    EXPECT_LE(std::fabs(static_cast<long double>(got[i]) - ld), tol) << i;
  }
}

TEST(ExactSumTest, DoublesRoundTripThroughToDouble) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<int64_t> acc(kLimbs, 0);
  int64_t rejected = 0;
  i128 ref = 0;
  for (int i = 0; i < 5000; ++i) {
    const double x = std::ldexp(u(rng), static_cast<int>(rng() % 80) - 55);
    ASSERT_TRUE(AddDoubles({&x, 1}, absl::MakeSpan(acc), &rejected).ok());
    ref += RefUnits(x, -62);
  }
  EXPECT_EQ(ToDouble(acc), RefDouble(ref, -62));
}

TEST(ExactSumTest, PermutationsAndGroupingsGiveIdenticalBits) {
  const size_t n = 64, rows = 48;
  std::vector<std::vector<float>> contrib;
  for (size_t r = 0; r < rows; ++r) contrib.push_back(RandomFloats(n, 900 + r));
  const std::vector<float> base = ExactSumRows(contrib, n);
  std::mt19937 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<size_t> order(rows);
    for (size_t i = 0; i < rows; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    // Random groups ("ranks" / micro-batches), each summed and normalised on its own, then
    // combined in a shuffled order, some normalised, some not.
    std::vector<std::vector<int64_t>> groups;
    int64_t rejected = 0;
    for (size_t i = 0; i < rows;) {
      const size_t len = 1 + rng() % 7;
      std::vector<int64_t> g(n * kLimbs, 0);
      for (size_t j = i; j < std::min(rows, i + len); ++j) {
        ASSERT_TRUE(AddFloats(contrib[order[j]], absl::MakeSpan(g), &rejected).ok());
      }
      if (rng() & 1) {
        ASSERT_TRUE(Normalize(absl::MakeSpan(g)).ok());
      }
      groups.push_back(std::move(g));
      i += len;
    }
    std::shuffle(groups.begin(), groups.end(), rng);
    std::vector<int64_t> acc(n * kLimbs, 0);
    for (const auto& g : groups) ASSERT_TRUE(AddLimbs(g, absl::MakeSpan(acc)).ok());
    std::vector<float> out(n);
    ASSERT_TRUE(ToFloats(acc, rejected, absl::MakeSpan(out)).ok());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(Bits(out[i]), Bits(base[i])) << trial << " " << i;
  }
  // And the naive fp32 sum in these orders does differ somewhere (the test has teeth).
  bool differs = false;
  for (size_t i = 0; i < n && !differs; ++i) {
    float fwd = 0, bwd = 0;
    for (size_t r = 0; r < rows; ++r) fwd += contrib[r][i];
    for (size_t r = rows; r-- > 0;) bwd += contrib[r][i];
    differs = Bits(fwd) != Bits(bwd);
  }
  EXPECT_TRUE(differs);
}

TEST(ExactSumTest, MaxAddsBetweenNormalizeStaysExact) {
  // kMaxAddsBetweenNormalize contributions whose low limb is 2^46 - 1 and top limb is big.
  const double x =
      std::ldexp(static_cast<double>((int64_t{1} << 46) - 1), -62) + std::ldexp(1.0, 12);
  std::vector<int64_t> acc(kLimbs, 0);
  int64_t rejected = 0;
  for (int64_t i = 0; i < kMaxAddsBetweenNormalize; ++i) {
    ASSERT_TRUE(AddDoubles({&x, 1}, absl::MakeSpan(acc), &rejected).ok());
  }
  EXPECT_EQ(ToDouble(acc), RefDouble(RefUnits(x, -62) * kMaxAddsBetweenNormalize, -62));
}

TEST(ExactSumTest, ConversionIsCorrectlyRoundedFromLimbs) {
  // Limb patterns whose value needs more than 53 (and 24) bits: ties and near-ties.
  std::mt19937_64 rng(11);
  for (int i = 0; i < 20000; ++i) {
    int64_t l[kLimbs];
    l[0] = static_cast<int64_t>(rng() >> 17);                       // [0, 2^47): non-canonical
    l[1] = static_cast<int64_t>(rng() >> 20) - (int64_t{1} << 43);  // |top| < 2^44
    if (i % 3 == 0) l[0] = (int64_t{1} << 45) * (i % 2);            // exact ties for double
    const i128 v = static_cast<i128>(l[1]) * (static_cast<i128>(1) << 46) + l[0];
    ASSERT_EQ(ToDouble({l, kLimbs}), RefDouble(v, -62)) << i;
    float f;
    ASSERT_TRUE(ToFloats({l, kLimbs}, 0, {&f, 1}).ok());
    ASSERT_EQ(Bits(f), Bits(RefFloat(v, -62))) << i;
  }
}

TEST(ExactSumTest, SimulatedRanksSplitAndMerge) {
  // n elements, contributions split over R "ranks" in different ways; each rank
  // normalises its buffer (as before a SUM collective), the SUM adds them, a
  // reduce-scatter's owner reads only its slice: every split gives the reference bits.
  const size_t n = 37, rows = 24;
  std::vector<std::vector<float>> contrib;
  for (size_t r = 0; r < rows; ++r) contrib.push_back(RandomFloats(n, 4000 + r, -60, 20));
  std::vector<float> ref(n);
  for (size_t i = 0; i < n; ++i) {
    i128 v = 0;
    for (size_t r = 0; r < rows; ++r) v += RefUnits(contrib[r][i], -62);
    ref[i] = RefFloat(v, -62);
  }
  for (int ranks : {1, 2, 3, 8}) {
    std::vector<std::vector<int64_t>> bufs(ranks, std::vector<int64_t>(n * kLimbs, 0));
    int64_t rejected = 0;
    for (size_t r = 0; r < rows; ++r) {
      ASSERT_TRUE(
          AddFloats(contrib[r], absl::MakeSpan(bufs[(r * 7 + ranks) % ranks]), &rejected).ok());
    }
    std::vector<int64_t> sum(n * kLimbs, 0);
    for (auto& b : bufs) {
      ASSERT_TRUE(Normalize(absl::MakeSpan(b)).ok());
      ASSERT_TRUE(AddLimbs(b, absl::MakeSpan(sum)).ok());
    }
    const size_t shard = (n + ranks - 1) / ranks;
    for (int q = 0; q < ranks; ++q) {
      const size_t begin = std::min(n, q * shard), end = std::min(n, begin + shard);
      std::vector<float> out(end - begin);
      ASSERT_TRUE(ToFloats(absl::MakeConstSpan(sum).subspan(begin * kLimbs, out.size() * kLimbs),
                           rejected, absl::MakeSpan(out))
                      .ok());
      for (size_t i = begin; i < end; ++i) ASSERT_EQ(Bits(out[i - begin]), Bits(ref[i]));
    }
  }
}

TEST(ExactSumTest, BadSizesAreInvalidArgument) {
  std::vector<float> v(3);
  std::vector<int64_t> limbs(5);
  int64_t rejected = 0;
  EXPECT_EQ(AddFloats(v, absl::MakeSpan(limbs), &rejected).code(),
            absl::StatusCode::kInvalidArgument);
  limbs.resize(6);
  EXPECT_EQ(AddFloats(v, absl::MakeSpan(limbs), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AddLimbs(std::vector<int64_t>(4), absl::MakeSpan(limbs)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Normalize(absl::MakeSpan(limbs).subspan(0, 5)).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> out(2);
  EXPECT_EQ(ToFloats(limbs, 0, absl::MakeSpan(out)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::isnan(ToDouble(absl::MakeConstSpan(limbs).subspan(0, 3))));
}

// ---- ExactScalar (WideFormat: 4 x 40 bits, LSB 2^-100) ----

TEST(ExactScalarTest, SumsDoublesExactlyInAnyOrder) {
  std::mt19937_64 rng(21);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(3000);
  // Magnitudes in [2^-90, 2^15] with 50-bit mantissas: every value is a multiple of 2^-140
  // (so some round to the LSB) and the sum of units stays inside __int128.
  for (double& x : v) {
    x = std::ldexp(std::round(std::ldexp(u(rng), 50)), static_cast<int>(rng() % 55) - 90);
  }
  i128 ref = 0;
  for (double x : v) ref += RefUnits(x, -100);
  ExactScalar a;
  for (double x : v) a.Add(x);
  EXPECT_EQ(a.ToDouble(), RefDouble(ref, -100));
  // Shuffled and split into parts that meet through words() (a SUM collective).
  std::shuffle(v.begin(), v.end(), rng);
  ExactScalar parts[3];
  for (size_t i = 0; i < v.size(); ++i) parts[i % 3].Add(v[i]);
  std::vector<int64_t> wire(ExactScalar::kWords, 0);
  for (auto& p : parts) {
    p.Normalize();
    for (int k = 0; k < ExactScalar::kWords; ++k) wire[k] += p.words()[k];
  }
  ExactScalar b;
  std::copy(wire.begin(), wire.end(), b.words().begin());
  EXPECT_EQ(b.ToDouble(), a.ToDouble());
  ExactScalar c;
  for (auto& p : parts) c.Add(p);
  EXPECT_EQ(c.ToDouble(), a.ToDouble());
}

TEST(ExactScalarTest, LargeIntegersUseTheTopLimbs) {
  // Integers up to 2^52 (units up to 2^152: the top limb is in use), summed exactly by a
  // long double (64-bit mantissa) as long as the sum stays below 2^58.
  std::mt19937_64 rng(8);
  ExactScalar s;
  long double ref = 0;
  for (int i = 0; i < 50; ++i) {
    const double x = static_cast<double>(static_cast<int64_t>(rng() >> 12) - (int64_t{1} << 51));
    s.Add(x);
    ref += x;
  }
  EXPECT_EQ(s.ToDouble(), static_cast<double>(ref));
}

TEST(ExactScalarTest, SquaresMatchLongDouble) {
  const std::vector<float> g = RandomFloats(100000, 5, -30, 10);
  ExactScalar s;
  s.AddSquares(g);
  long double ref = 0;
  for (float x : g) ref += static_cast<long double>(x) * x;
  EXPECT_NEAR(static_cast<double>(s.ToDouble() / ref), 1.0, 1e-15);
  // The same squares added in reverse give the same bits.
  std::vector<float> r(g.rbegin(), g.rend());
  ExactScalar t;
  for (size_t i = 0; i < r.size(); i += 1000) {
    t.AddSquares(absl::MakeConstSpan(r).subspan(i, std::min<size_t>(1000, r.size() - i)));
  }
  EXPECT_EQ(t.ToDouble(), s.ToDouble());
}

TEST(ExactScalarTest, SquaresRejectInEveryPosition) {
  for (int pos = 0; pos < 5; ++pos) {
    std::vector<float> v = {1.0f, 2.0f, 3.0f, 4.0f, 5.0f};
    v[pos] = std::numeric_limits<float>::infinity();
    ExactScalar s;
    s.AddSquares(v);
    EXPECT_EQ(s.rejected(), 1) << pos;
    EXPECT_TRUE(std::isnan(s.ToDouble()));
    ExactScalar ok;
    v[pos] = 0.0f;
    ok.AddSquares(v);
    double want = 55.0 - (pos + 1.0) * (pos + 1.0);
    EXPECT_EQ(ok.ToDouble(), want) << pos;
  }
}

TEST(ExactScalarTest, NonFiniteAndOverflow) {
  ExactScalar s;
  EXPECT_TRUE(s.IsZero());
  EXPECT_EQ(s.ToDouble(), 0.0);
  s.Add(1.0);
  s.Add(std::numeric_limits<double>::infinity());
  EXPECT_EQ(s.rejected(), 1);
  EXPECT_TRUE(std::isnan(s.ToDouble()));
  ExactScalar big;
  big.Add(std::ldexp(1.0, 58) * 1.5);
  big.Add(std::ldexp(1.0, 58) * 1.5);
  EXPECT_EQ(big.ToDouble(), std::numeric_limits<double>::infinity());
  ExactScalar too_big;
  too_big.Add(std::ldexp(1.0, 59));
  EXPECT_EQ(too_big.rejected(), 1);
}

}  // namespace
}  // namespace gradsum::exact
