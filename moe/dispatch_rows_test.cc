// Every build of the dispatch's row kernels (moe/dispatch_rows.h) against plain scalar loops,
// bit for bit: the dot products' fp64 sums in increasing d, and the elementwise rows.

#include "moe/dispatch_rows.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace gradsum::moe::internal {
namespace {

std::vector<const RowKernels*> Builds() {
  std::vector<const RowKernels*> builds;
  for (const char* isa : {"generic", "avx2", "avx512"}) {
    if (const RowKernels* k = RowKernelsFor(isa); k != nullptr) builds.push_back(k);
  }
  return builds;
}

// Random floats over many binades, with zeros of both signs and subnormals mixed in.
std::vector<float> Values(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> exponent(-30, 30), sign(-1, 1);
  std::uniform_int_distribution<int> special(0, 40);
  std::vector<float> v(n);
  for (float& x : v) {
    switch (special(gen)) {
      case 0:
        x = 0.0f;
        break;
      case 1:
        x = -0.0f;
        break;
      case 2:
        x = std::numeric_limits<float>::denorm_min() * 3;
        break;
      default:
        x = static_cast<float>(std::copysign(std::exp2(exponent(gen)), sign(gen)));
    }
  }
  return v;
}

uint64_t Bits(double x) {
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

TEST(DispatchRowsTest, TheWidestBuildThisCpuRunsIsSelected) {
  const std::vector<const RowKernels*> builds = Builds();
  ASSERT_FALSE(builds.empty());
  if (std::getenv("GRADSUM_DISPATCH_ISA") == nullptr) {
    EXPECT_STREQ(SelectedRowKernels().isa, builds.back()->isa);
  }
}

TEST(DispatchRowsTest, DotRowsAddInIncreasingOrderInEveryBuild) {
  for (const RowKernels* k : Builds()) {
    for (int64_t n : {0, 1, 3, 4, 7, 8, 9, 16, 31, 128, 131, 512}) {
      for (int rows = 1; rows <= kDotRowsMax; ++rows) {
        std::vector<std::vector<float>> a, b;
        std::vector<const float*> pa, pb;
        for (int i = 0; i < rows; ++i) {
          a.push_back(Values(n, 1000 * n + 2 * i + 1));
          b.push_back(Values(n, 1000 * n + 2 * i + 2));
        }
        for (int i = 0; i < rows; ++i) pa.push_back(a[i].data()), pb.push_back(b[i].data());
        std::vector<double> dot(kDotRowsMax, -1.0);
        k->dot_rows(pa.data(), pb.data(), n, rows, dot.data());
        for (int i = 0; i < rows; ++i) {
          double want = 0.0;
          for (int64_t d = 0; d < n; ++d) want += static_cast<double>(a[i][d]) * b[i][d];
          EXPECT_EQ(Bits(dot[i]), Bits(want)) << k->isa << " n=" << n << " rows=" << rows << " row "
                                              << i << ": " << dot[i] << " vs " << want;
        }
        for (int i = rows; i < kDotRowsMax; ++i) EXPECT_EQ(dot[i], -1.0) << "wrote past rows";
      }
    }
  }
}

TEST(DispatchRowsTest, ElementwiseRowsMatchScalarLoopsInEveryBuild) {
  for (const RowKernels* k : Builds()) {
    for (int64_t n : {1, 5, 16, 37, 512}) {
      const std::vector<float> src = Values(n, 7 * n + 1), base = Values(n, 7 * n + 2);
      for (float w : {0.37f, -1.5f, 0.0f, -0.0f}) {
        std::vector<float> got(n), want(n);
        k->set_scaled(got.data(), w, src.data(), n);
        for (int64_t d = 0; d < n; ++d) want[d] = 0.0f + w * src[d];
        for (int64_t d = 0; d < n; ++d) ASSERT_EQ(Bits(got[d]), Bits(want[d])) << k->isa;
        got = base, want = base;
        k->add_scaled(got.data(), w, src.data(), n);
        for (int64_t d = 0; d < n; ++d) want[d] += w * src[d];
        for (int64_t d = 0; d < n; ++d) ASSERT_EQ(Bits(got[d]), Bits(want[d])) << k->isa;
        k->scale(got.data(), w, src.data(), n);
        for (int64_t d = 0; d < n; ++d) want[d] = w * src[d];
        for (int64_t d = 0; d < n; ++d) ASSERT_EQ(Bits(got[d]), Bits(want[d])) << k->isa;
        got = base, want = base;
        k->add(got.data(), src.data(), n);
        for (int64_t d = 0; d < n; ++d) want[d] += src[d];
        for (int64_t d = 0; d < n; ++d) ASSERT_EQ(Bits(got[d]), Bits(want[d])) << k->isa;
      }
    }
  }
}

}  // namespace
}  // namespace gradsum::moe::internal
