#include "collectives/reduce_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/half.h"
#include "gtest/gtest.h"

namespace gradsum {
namespace {

TEST(ReduceKernelsTest, MaxPropagatesNanFromAnySource) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> a = {1, nan, 3, -1}, b = {nan, 2, 5, -2}, c = {0, 7, nan, -3};
  std::vector<float> out(4);
  std::vector<const void*> srcs = {a.data(), b.data(), c.data()};
  std::vector<void*> dsts = {out.data()};
  ReduceInto(DType::kF32, ReduceOp::kMax, srcs, 4, dsts);
  EXPECT_TRUE(std::isnan(out[0]));
  EXPECT_TRUE(std::isnan(out[1]));
  EXPECT_TRUE(std::isnan(out[2]));
  EXPECT_EQ(out[3], -1.0f);
}

// The kernel works in vectorized tiles of 64 elements plus a scalar tail: every position,
// in a full tile and in the tail, against a plain per-element loop (f32 SUM in source
// order; MAX with NaNs in both parts), three sources, two destinations.
TEST(ReduceKernelsTest, TilesAndTailMatchAPlainLoop) {
  const size_t n = 64 * 3 + 37;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::vector<float>> src(3, std::vector<float>(n));
  for (size_t p = 0; p < 3; ++p) {
    for (size_t i = 0; i < n; ++i) {
      // Values whose sum depends on the order (1e8 + 1 - 1e8 != 1 in f32).
      src[p][i] = p == 0 ? 1e8f : p == 1 ? static_cast<float>(i % 7) - 3.0f : -1e8f;
    }
  }
  std::vector<const void*> srcs = {src[0].data(), src[1].data(), src[2].data()};
  std::vector<float> out0(n), out1(n);
  std::vector<void*> dsts = {out0.data(), out1.data()};
  ReduceInto(DType::kF32, ReduceOp::kSum, srcs, n, dsts);
  for (size_t i = 0; i < n; ++i) {
    const float want = (src[0][i] + src[1][i]) + src[2][i];
    ASSERT_EQ(out0[i], want) << i;
    ASSERT_EQ(out1[i], want) << i;
  }
  src[1][5] = nan;            // in the first tile
  src[2][64 * 3 + 30] = nan;  // in the tail
  ReduceInto(DType::kF32, ReduceOp::kMax, srcs, n, dsts);
  for (size_t i = 0; i < n; ++i) {
    if (i == 5 || i == 64 * 3 + 30) {
      EXPECT_TRUE(std::isnan(out0[i]) && std::isnan(out1[i])) << i;
    } else {
      EXPECT_EQ(out0[i], std::max({src[0][i], src[1][i], src[2][i]})) << i;
      EXPECT_EQ(out1[i], out0[i]) << i;
    }
  }
}

TEST(ReduceKernelsTest, IntegerSumWrapsAndMaxIsSigned) {
  std::vector<int32_t> a = {std::numeric_limits<int32_t>::max(), -5}, b = {1, -7};
  std::vector<int32_t> sum(2), max(2);
  std::vector<const void*> srcs = {a.data(), b.data()};
  std::vector<void*> d1 = {sum.data()}, d2 = {max.data()};
  ReduceInto(DType::kI32, ReduceOp::kSum, srcs, 2, d1);
  ReduceInto(DType::kI32, ReduceOp::kMax, srcs, 2, d2);
  EXPECT_EQ(sum[0], std::numeric_limits<int32_t>::min());
  EXPECT_EQ(sum[1], -12);
  EXPECT_EQ(max[1], -5);
}

// f16: 2048 + 1 + 1 + 1. Rounding after each step sticks at 2048 (ulp 2, ties to even);
// fp32 accumulation gives 2051, rounded once to 2052.
TEST(ReduceKernelsTest, HalfAccumulatesInFloatAndRoundsOnce) {
  std::vector<F16> a = {F16::FromFloat(2048)}, one = {F16::FromFloat(1)};
  std::vector<F16> out(1);
  std::vector<const void*> srcs = {a.data(), one.data(), one.data(), one.data()};
  std::vector<void*> dsts = {out.data()};
  ReduceInto(DType::kF16, ReduceOp::kSum, srcs, 1, dsts);
  EXPECT_EQ(out[0].ToFloat(), 2052.0f);
}

TEST(ReduceKernelsTest, AvgDividesTheSumAndEveryDestinationGetsIt) {
  const size_t n = 10000;  // several internal blocks
  std::vector<double> a(n), b(n), c(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<double>(i);
    b[i] = 0.5;
    c[i] = -1.0;
  }
  std::vector<double> copy(n);
  // In place into a, plus a copy.
  std::vector<const void*> srcs = {a.data(), b.data(), c.data()};
  std::vector<void*> dsts = {a.data(), copy.data()};
  ReduceInto(DType::kF64, ReduceOp::kAvg, srcs, n, dsts);
  for (size_t i = 0; i < n; ++i) {
    const double want = (static_cast<double>(i) + 0.5 - 1.0) / 3.0;
    ASSERT_EQ(a[i], want) << i;
    ASSERT_EQ(copy[i], want) << i;
  }
}

}  // namespace
}  // namespace gradsum
