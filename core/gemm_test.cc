#include "core/gemm.h"

#include <cblas.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace gradsum {
namespace {

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Straightforward double-precision C = alpha op(A) op(B) + beta C.
std::vector<double> Reference(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha,
                              const std::vector<float>& a, int64_t lda, const std::vector<float>& b,
                              int64_t ldb, double beta, const std::vector<float>& c, int64_t ldc) {
  std::vector<double> out(c.begin(), c.end());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = ta ? a[p * lda + i] : a[i * lda + p];
        const double bv = tb ? b[j * ldb + p] : b[p * ldb + j];
        sum += av * bv;
      }
      out[i * ldc + j] = alpha * sum + beta * c[i * ldc + j];
    }
  }
  return out;
}

struct Case {
  bool ta, tb;
  int64_t m, n, k;
  int pad;  // extra columns in every leading dimension
  int threads;
};

TEST(GemmTest, MatchesDoubleReference) {
  const std::vector<Case> cases = {
      {false, false, 7, 5, 3, 0, 1},      {true, false, 33, 17, 9, 2, 1},
      {false, true, 64, 65, 31, 1, 2},    {true, true, 5, 130, 70, 3, 3},
      {false, false, 257, 96, 128, 0, 4}, {true, false, 128, 128, 300, 0, 2},
  };
  uint32_t seed = 1;
  for (const Case& t : cases) {
    const int64_t a_rows = t.ta ? t.k : t.m, a_cols = t.ta ? t.m : t.k;
    const int64_t b_rows = t.tb ? t.n : t.k, b_cols = t.tb ? t.k : t.n;
    const int64_t lda = a_cols + t.pad, ldb = b_cols + t.pad, ldc = t.n + t.pad;
    const std::vector<float> a = Random(a_rows * lda, seed++);
    const std::vector<float> b = Random(b_rows * ldb, seed++);
    std::vector<float> c = Random(t.m * ldc, seed++);
    const std::vector<double> want =
        Reference(t.ta, t.tb, t.m, t.n, t.k, 0.5, a, lda, b, ldb, -2.0, c, ldc);
    absl::Status s =
        Sgemm(t.ta ? Trans::kYes : Trans::kNo, t.tb ? Trans::kYes : Trans::kNo, t.m, t.n, t.k, 0.5f,
              a, lda, b, ldb, -2.0f, absl::MakeSpan(c), ldc, t.threads);
    ASSERT_TRUE(s.ok()) << s;
    for (int64_t i = 0; i < t.m; ++i) {
      for (int64_t j = 0; j < ldc; ++j) {
        const int64_t at = i * ldc + j;
        // fp32 accumulation over k terms of size <= 1.
        ASSERT_NEAR(c[at], want[at], 1e-5 * (t.k + 4)) << i << "," << j << " m=" << t.m;
      }
    }
  }
}

TEST(GemmTest, BetaZeroOverwritesNaN) {
  const std::vector<float> a = {1, 2}, b = {3, 4};
  std::vector<float> c = {NAN, NAN, NAN, NAN};
  ASSERT_TRUE(
      Sgemm(Trans::kNo, Trans::kNo, 2, 2, 1, 1.0f, a, 1, b, 2, 0.0f, absl::MakeSpan(c), 2).ok());
  EXPECT_EQ(c, (std::vector<float>{3, 4, 6, 8}));
}

TEST(GemmTest, EmptyShapes) {
  std::vector<float> c = {5, 6};
  // k = 0: C = beta C.
  ASSERT_TRUE(
      Sgemm(Trans::kNo, Trans::kNo, 1, 2, 0, 1.0f, {}, 1, {}, 2, 2.0f, absl::MakeSpan(c), 2).ok());
  EXPECT_EQ(c, (std::vector<float>{10, 12}));
  EXPECT_TRUE(Sgemm(Trans::kNo, Trans::kNo, 0, 0, 5, 1.0f, {}, 5, {}, 1, 0.0f, {}, 1).ok());
}

// The same product split over 1..4 threads, against the one-thread result: the split only
// assigns bands of C to threads, so the values agree to rounding.
TEST(GemmTest, ThreadSplitAgrees) {
  const int64_t m = 300, n = 200, k = 64;
  const std::vector<float> a = Random(m * k, 7), b = Random(k * n, 8);
  std::vector<float> one(m * n);
  ASSERT_TRUE(
      Sgemm(Trans::kNo, Trans::kNo, m, n, k, 1.0f, a, k, b, n, 0.0f, absl::MakeSpan(one), n, 1)
          .ok());
  const std::vector<double> want =
      Reference(false, false, m, n, k, 1.0, a, k, b, n, 0.0, std::vector<float>(m * n, 0.0f), n);
  for (int threads : {2, 3, 4}) {
    std::vector<float> c(m * n, 1.0f);
    ASSERT_TRUE(Sgemm(Trans::kNo, Trans::kNo, m, n, k, 1.0f, a, k, b, n, 0.0f, absl::MakeSpan(c), n,
                      threads)
                    .ok());
    for (int64_t i = 0; i < m * n; ++i) ASSERT_NEAR(c[i], want[i], 1e-4) << i;
  }
}

TEST(GemmTest, RejectsBadShapes) {
  std::vector<float> a(6), b(6), c(4);
  auto call = [&](int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                  absl::Span<float> out) {
    return Sgemm(Trans::kNo, Trans::kNo, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, out, ldc);
  };
  EXPECT_TRUE(call(2, 2, 3, 3, 2, 2, absl::MakeSpan(c)).ok());
  absl::Status s = call(-1, 2, 3, 3, 2, 2, absl::MakeSpan(c));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("m=-1"), std::string::npos) << s;
  s = call(2, 2, 3, 2, 2, 2, absl::MakeSpan(c));  // lda < k
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("leading dimension of A is 2"), std::string::npos) << s;
  s = call(3, 2, 3, 3, 2, 2, absl::MakeSpan(c));  // A too short for 3 rows, C too
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("A holds 6 floats"), std::string::npos) << s;
  s = call(2, 2, 3, 3, 2, 2, absl::MakeSpan(c).subspan(1));
  EXPECT_NE(s.message().find("C holds 3 floats"), std::string::npos) << s;
  s = Sgemm(Trans::kYes, Trans::kNo, 2, 2, 3, 1.0f, a, 1, b, 2, 0.0f, absl::MakeSpan(c), 2);
  EXPECT_NE(s.message().find("leading dimension of A^T is 1"), std::string::npos) << s;
  s = Sgemm(Trans::kNo, Trans::kNo, 2, 2, 1, 1.0f, a, 1, b, 2, 0.0f, absl::MakeSpan(a), 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlaps"), std::string::npos) << s;
  s = call(int64_t{1} << 33, 1, 1, 1, 1, 1, absl::MakeSpan(c));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

// k = 1 with alpha = 1 and beta 0 or 1 does not go through the BLAS (core/gemm.h); its
// results must still be the BLAS's bit for bit, signed zeros included.
TEST(GemmTest, RankOneUpdatesMatchTheBlasBitForBit) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> exponent(-20, 20), sign(-1, 1);
  std::uniform_int_distribution<int> pick(0, 15);
  auto value = [&] {
    const int p = pick(rng);
    if (p < 2) return p == 0 ? 0.0f : -0.0f;
    return static_cast<float>(std::copysign(std::exp2(exponent(rng)), sign(rng)));
  };
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (float beta : {0.0f, 1.0f}) {
        for (int64_t m : {1, 3, 40, 257}) {
          for (int64_t n : {1, 7, 64, 130}) {
            const int64_t lda = (ta ? m : 1) + 2, ldb = (tb ? 1 : n) + 1, ldc = n + 3;
            std::vector<float> a((ta ? 1 : m) * lda), b((tb ? n : 1) * ldb), c(m * ldc);
            for (float& x : a) x = value();
            for (float& x : b) x = value();
            for (float& x : c) x = beta == 0.0f ? NAN : value();
            std::vector<float> want = c;
            cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                        tb ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n), 1,
                        1.0f, a.data(), static_cast<int>(lda), b.data(), static_cast<int>(ldb),
                        beta, want.data(), static_cast<int>(ldc));
            for (int threads : {1, 3}) {
              std::vector<float> got = c;
              ASSERT_TRUE(Sgemm(ta ? Trans::kYes : Trans::kNo, tb ? Trans::kYes : Trans::kNo, m, n,
                                1, 1.0f, a, lda, b, ldb, beta, absl::MakeSpan(got), ldc, threads)
                              .ok());
              for (int64_t i = 0; i < m; ++i) {
                for (int64_t j = 0; j < n; ++j) {
                  const int64_t at = i * ldc + j;
                  ASSERT_EQ(std::memcmp(&got[at], &want[at], sizeof(float)), 0)
                      << got[at] << " vs " << want[at] << " at " << i << "," << j << " ta=" << ta
                      << " tb=" << tb << " beta=" << beta << " m=" << m << " n=" << n;
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(GemmTest, NamesItsKernel) { EXPECT_STRNE(BlasCoreName(), ""); }

}  // namespace
}  // namespace gradsum
