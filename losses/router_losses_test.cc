#include "losses/router_losses.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "losses/test_util.h"

namespace gradsum::losses {
namespace {

using ::testing::HasSubstr;

std::vector<double> Softmax(const float* u, int64_t e) {
  std::vector<double> p(e);
  double mx = -INFINITY, s = 0;
  for (int64_t j = 0; j < e; ++j) mx = std::max(mx, double{u[j]});
  for (int64_t j = 0; j < e; ++j) s += p[j] = std::exp(u[j] - mx);
  for (double& x : p) x /= s;
  return p;
}

double Lse(const float* u, int64_t e) {
  double s = 0;
  for (int64_t j = 0; j < e; ++j) s += std::exp(double{u[j]});
  return std::log(s);
}

// Top-k experts of a row by probability, ties to the lower index (SEMANTICS §10).
std::vector<int64_t> TopK(const float* u, int64_t e, int k) {
  std::vector<int64_t> idx(e);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return u[a] > u[b]; });
  idx.resize(k);
  return idx;
}

TEST(RouterZLossTest, MatchesReferenceAndAddsIntoGradient) {
  const int64_t t = 7, e = 5;
  std::vector<float> u = RandomNormal(t * e, 1, 2.0f);
  u[3 * e + 2] = std::numeric_limits<float>::quiet_NaN();  // padding row: never read
  const std::vector<uint8_t> mask = {1, 1, 1, 0, 1, 0, 1};
  const int64_t n = 40;  // global routed tokens of the step
  const double alpha = 0.01;
  std::vector<float> du(t * e, 0.5f);
  auto r = RouterZLossForwardBackward(F32Matrix(u.data(), t, e), mask, n, alpha,
                                      F32Matrix(du.data(), t, e));
  ASSERT_TRUE(r.ok()) << r.status();
  double ref = 0;
  for (int64_t i = 0; i < t; ++i) {
    if (!mask[i]) {
      for (int64_t j = 0; j < e; ++j) EXPECT_EQ(du[i * e + j], 0.5f);
      continue;
    }
    const double lse = Lse(&u[i * e], e);
    ref += alpha * lse * lse / n;
    const std::vector<double> p = Softmax(&u[i * e], e);
    for (int64_t j = 0; j < e; ++j) {
      EXPECT_NEAR(du[i * e + j], 0.5 + alpha * 2 * lse * p[j] / n, 1e-7);
    }
  }
  EXPECT_NEAR(*r, ref, 1e-12);
}

TEST(RouterZLossTest, GradientMatchesCentralFiniteDifferences) {
  const int64_t t = 4, e = 6;
  std::vector<float> u = RandomNormal(t * e, 2, 1.5f);
  std::vector<float> du(t * e, 0.0f);
  ASSERT_TRUE(
      RouterZLossForwardBackward(F32Matrix(u.data(), t, e), {}, 9, 0.3, F32Matrix(du.data(), t, e))
          .ok());
  for (size_t i = 0; i < u.size(); ++i) {
    std::vector<float> up = u, um = u, scratch(t * e);
    up[i] += 1e-2f;
    um[i] -= 1e-2f;
    const double lp = *RouterZLossForwardBackward(F32Matrix(up.data(), t, e), {}, 9, 0.3,
                                                  F32Matrix(scratch.data(), t, e));
    const double lm = *RouterZLossForwardBackward(F32Matrix(um.data(), t, e), {}, 9, 0.3,
                                                  F32Matrix(scratch.data(), t, e));
    EXPECT_NEAR(du[i], (lp - lm) / (double{up[i]} - um[i]), 1e-5) << i;
  }
}

// The global formula of §5 for one layer and micro-step, written directly.
double ReferenceBalancing(const std::vector<float>& u, int64_t t, int64_t e,
                          const std::vector<uint8_t>& mask, const std::vector<int64_t>& c, int k,
                          int g, double alpha) {
  const double n = std::accumulate(c.begin(), c.end(), 0.0) / k;
  if (n == 0) return 0.0;
  std::vector<double> sum_p(e, 0.0);
  for (int64_t i = 0; i < t; ++i) {
    if (!mask.empty() && !mask[i]) continue;
    const std::vector<double> p = Softmax(&u[i * e], e);
    for (int64_t j = 0; j < e; ++j) sum_p[j] += p[j];
  }
  double l = 0;
  for (int64_t j = 0; j < e; ++j) l += (c[j] / (n * k)) * sum_p[j] / n;
  return alpha / g * e * l;
}

TEST(LoadBalancingLossTest, MatchesReferenceAndFiniteDifferences) {
  const int64_t t = 6, e = 4;
  const int k = 2, g = 3;
  const double alpha = 0.5;
  std::vector<float> u = RandomNormal(t * e, 3, 1.0f);
  const std::vector<uint8_t> mask = {1, 0, 1, 1, 1, 1};
  const std::vector<int64_t> c = {9, 3, 6, 4};  // global: 11 tokens over all ranks, K = 2
  std::vector<float> du(t * e, 0.0f);
  auto r = LoadBalancingLossForwardBackward(F32Matrix(u.data(), t, e), mask, c, k, g, alpha,
                                            F32Matrix(du.data(), t, e));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(*r, ReferenceBalancing(u, t, e, mask, c, k, g, alpha), 1e-12);
  for (int64_t j = 0; j < e; ++j) EXPECT_EQ(du[1 * e + j], 0.0f);  // padding row
  for (size_t i = 0; i < u.size(); ++i) {
    std::vector<float> up = u, um = u;
    up[i] += 1e-2f;
    um[i] -= 1e-2f;
    const double fd = (ReferenceBalancing(up, t, e, mask, c, k, g, alpha) -
                       ReferenceBalancing(um, t, e, mask, c, k, g, alpha)) /
                      (double{up[i]} - um[i]);
    EXPECT_NEAR(du[i], fd, 1e-6) << i;
  }
}

// From the probabilities: the same value, dL/dp = g_e on routed rows, and through the
// softmax's Jacobian the logits form's gradient; checked like the logits form.
TEST(LoadBalancingLossTest, FromProbabilitiesMatchesTheLogitsForm) {
  const int64_t t = 6, e = 4;
  const int k = 2, g = 3;
  const double alpha = 0.5;
  std::vector<float> u = RandomNormal(t * e, 8, 1.0f);
  const std::vector<uint8_t> mask = {1, 1, 0, 1, 1, 1};
  const std::vector<int64_t> c = {9, 3, 6, 4};
  std::vector<float> p(t * e), dp(t * e, 0.25f), du(t * e, 0.0f);
  for (int64_t i = 0; i < t; ++i) {
    const std::vector<double> row = Softmax(&u[i * e], e);
    for (int64_t j = 0; j < e; ++j) p[i * e + j] = static_cast<float>(row[j]);
  }
  p[2 * e + 1] = std::numeric_limits<float>::quiet_NaN();  // a padding row is never read
  auto from_p = LoadBalancingLossFromProbsForwardBackward(F32Matrix(p.data(), t, e), mask, c, k, g,
                                                          alpha, F32Matrix(dp.data(), t, e));
  ASSERT_TRUE(from_p.ok()) << from_p.status();
  auto from_u = LoadBalancingLossForwardBackward(F32Matrix(u.data(), t, e), mask, c, k, g, alpha,
                                                 F32Matrix(du.data(), t, e));
  ASSERT_TRUE(from_u.ok());
  EXPECT_NEAR(*from_p, *from_u, 1e-7 * *from_u);
  const double n = 11.0;  // sum c / K
  for (int64_t i = 0; i < t; ++i) {
    double gp = 0.0;
    for (int64_t j = 0; j < e; ++j) {
      const double g_j = alpha * e * c[j] / (g * k * n * n);
      EXPECT_FLOAT_EQ(dp[i * e + j], mask[i] ? 0.25 + g_j : 0.25) << i << " " << j;
      gp += g_j * p[i * e + j];
    }
    for (int64_t j = 0; mask[i] && j < e; ++j) {  // chain rule through the softmax
      const double g_j = alpha * e * c[j] / (g * k * n * n);
      EXPECT_NEAR(du[i * e + j], p[i * e + j] * (g_j - gp), 1e-9) << i << " " << j;
    }
  }
  p[3 * e] = std::numeric_limits<float>::infinity();
  absl::Status bad =
      LoadBalancingLossFromProbsForwardBackward(F32Matrix(p.data(), t, e), mask, c, k, g, alpha,
                                                F32Matrix(dp.data(), t, e))
          .status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("router probabilities row 3"));
  EXPECT_EQ(LoadBalancingLossFromProbsForwardBackward(F32Matrix(p.data(), t, e), mask, {1, 1, 0, 0},
                                                      k, g, alpha, F32Matrix(dp.data(), t, e))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(LoadBalancingLossTest, ZeroRoutedMicroStepContributesZero) {
  const int64_t t = 3, e = 4;
  std::vector<float> u = RandomNormal(t * e, 4, 1.0f);
  std::vector<float> du(t * e, 1.0f);
  const std::vector<uint8_t> mask = {0, 0, 0};
  auto r = LoadBalancingLossForwardBackward(F32Matrix(u.data(), t, e), mask, {0, 0, 0, 0}, 2, 1,
                                            0.1, F32Matrix(du.data(), t, e));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, 0.0);
  for (float x : du) EXPECT_EQ(x, 1.0f);
  auto z = RouterZLossForwardBackward(F32Matrix(u.data(), t, e), mask, 0, 0.1,
                                      F32Matrix(du.data(), t, e));
  ASSERT_TRUE(z.ok());
  EXPECT_EQ(*z, 0.0);
  for (float x : du) EXPECT_EQ(x, 1.0f);
}

// Splitting a step's tokens over W ranks and G micro-batches: the sum over ranks and
// micro-batches of each rank's router-weight gradient equals the gradient of the global
// formula (double, central differences), and the local components add up to its value.
TEST(LoadBalancingLossTest, RankAndMicroBatchSplitSumsToGlobalGradient) {
  const int64_t dm = 3, e = 4;
  const int k = 2, world = 3, g = 2;
  const double alpha_b = 0.2, alpha_z = 0.05;
  std::vector<float> wr = RandomNormal(dm * e, 5, 1.0f);  // router weights: u = a @ wr
  // tokens[m][r]: uneven per-rank token counts, with some padding.
  std::vector<std::vector<std::vector<float>>> a(g, std::vector<std::vector<float>>(world));
  std::vector<std::vector<std::vector<uint8_t>>> mask(g, std::vector<std::vector<uint8_t>>(world));
  const int counts[2][3] = {{5, 0, 3}, {2, 4, 1}};
  uint32_t seed = 10;
  int64_t step_routed = 0;
  for (int m = 0; m < g; ++m) {
    for (int r = 0; r < world; ++r) {
      a[m][r] = RandomNormal(counts[m][r] * dm, seed++, 1.0f);
      for (int i = 0; i < counts[m][r]; ++i) mask[m][r].push_back(i % 4 == 3 ? 0 : 1);
      for (uint8_t x : mask[m][r]) step_routed += x;
    }
  }
  auto logits = [&](const std::vector<float>& w, int m, int r) {
    const int64_t t = counts[m][r];
    std::vector<float> u(t * e, 0.0f);
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < e; ++j) {
        double acc = 0;
        for (int64_t d = 0; d < dm; ++d) acc += double{a[m][r][i * dm + d]} * w[d * e + j];
        u[i * e + j] = static_cast<float>(acc);
      }
    return u;
  };
  // Detached global counts c[m] from the top-k of every routed token at micro-step m.
  std::vector<std::vector<int64_t>> c(g, std::vector<int64_t>(e, 0));
  for (int m = 0; m < g; ++m)
    for (int r = 0; r < world; ++r) {
      const std::vector<float> u = logits(wr, m, r);
      for (int i = 0; i < counts[m][r]; ++i)
        if (mask[m][r][i])
          for (int64_t x : TopK(&u[i * e], e, k)) ++c[m][x];
    }
  // Global single-process loss as a function of the router weights (c held fixed).
  auto global_loss = [&](const std::vector<float>& w) {
    double total = 0;
    for (int m = 0; m < g; ++m) {
      std::vector<float> all_u;
      std::vector<uint8_t> all_mask;
      for (int r = 0; r < world; ++r) {
        const std::vector<float> u = logits(w, m, r);
        all_u.insert(all_u.end(), u.begin(), u.end());
        all_mask.insert(all_mask.end(), mask[m][r].begin(), mask[m][r].end());
      }
      const int64_t t = static_cast<int64_t>(all_mask.size());
      total += ReferenceBalancing(all_u, t, e, all_mask, c[m], k, g, alpha_b);
      for (int64_t i = 0; i < t; ++i) {
        if (!all_mask[i]) continue;
        const double lse = Lse(&all_u[i * e], e);
        total += alpha_z * lse * lse / step_routed;
      }
    }
    return total;
  };
  // Local components and gradients, rank by rank and micro-batch by micro-batch.
  std::vector<double> grad_wr(dm * e, 0.0);
  double sum_local = 0;
  for (int m = 0; m < g; ++m)
    for (int r = 0; r < world; ++r) {
      const int64_t t = counts[m][r];
      std::vector<float> u = logits(wr, m, r), du(t * e, 0.0f);
      auto b = LoadBalancingLossForwardBackward(F32Matrix(u.data(), t, e), mask[m][r], c[m], k, g,
                                                alpha_b, F32Matrix(du.data(), t, e));
      auto z = RouterZLossForwardBackward(F32Matrix(u.data(), t, e), mask[m][r], step_routed,
                                          alpha_z, F32Matrix(du.data(), t, e));
      ASSERT_TRUE(b.ok() && z.ok()) << b.status() << z.status();
      sum_local += *b + *z;
      for (int64_t d = 0; d < dm; ++d)
        for (int64_t j = 0; j < e; ++j)
          for (int64_t i = 0; i < t; ++i) grad_wr[d * e + j] += a[m][r][i * dm + d] * du[i * e + j];
    }
  EXPECT_NEAR(sum_local, global_loss(wr), 1e-9 * global_loss(wr));
  for (size_t i = 0; i < wr.size(); ++i) {
    std::vector<float> wp = wr, wm = wr;
    wp[i] += 1e-2f;
    wm[i] -= 1e-2f;
    const double fd = (global_loss(wp) - global_loss(wm)) / (double{wp[i]} - wm[i]);
    EXPECT_NEAR(grad_wr[i], fd, 1e-5 * (1 + std::abs(fd))) << "router weight " << i;
  }
}

TEST(RouterLossErrorsTest, ArgumentsAreChecked) {
  const int64_t t = 3, e = 4;
  std::vector<float> u = RandomNormal(t * e, 6, 1.0f), du(t * e, 0.0f);
  const TensorView uv = F32Matrix(u.data(), t, e), dv = F32Matrix(du.data(), t, e);
  auto z = [&](const TensorView& a, absl::Span<const uint8_t> mask, int64_t n, double alpha,
               const TensorView& b) {
    return RouterZLossForwardBackward(a, mask, n, alpha, b).status();
  };
  auto bal = [&](absl::Span<const uint8_t> mask, std::vector<int64_t> c, int k, int g, double alpha,
                 const TensorView& a) {
    return LoadBalancingLossForwardBackward(a, mask, c, k, g, alpha, dv).status();
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_TRUE(z(uv, {}, 3, 0.1, dv).ok());
  EXPECT_EQ(z(F32Matrix(u.data(), t, e), {}, 2, 0.1, dv).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(z(uv, {}, 2, 0.1, dv).message()), HasSubstr("global N = 2"));
  EXPECT_EQ(z(uv, {}, -1, 0.1, dv).code(), kInvalid);
  EXPECT_EQ(z(uv, {}, 3, -0.1, dv).code(), kInvalid);
  EXPECT_EQ(z(uv, {}, 3, std::nan(""), dv).code(), kInvalid);
  EXPECT_EQ(z(uv, std::vector<uint8_t>{1, 1}, 3, 0.1, dv).code(), kInvalid);
  EXPECT_THAT(std::string(z(uv, std::vector<uint8_t>{1, 2, 1}, 3, 0.1, dv).message()),
              HasSubstr("input_mask[1] = 2"));
  EXPECT_EQ(z(uv, {}, 3, 0.1, uv).code(), kInvalid);                          // overlap
  EXPECT_EQ(z(uv, {}, 3, 0.1, F32Matrix(du.data(), e, t)).code(), kInvalid);  // shape
  std::vector<uint16_t> half(t * e);
  EXPECT_EQ(z(*TensorView::Create(half.data(), DType::kBF16, {t, e}), {}, 3, 0.1, dv).code(),
            kInvalid);
  std::vector<float> bad = u;
  bad[2 * e + 1] = std::numeric_limits<float>::infinity();
  absl::Status nonfinite = z(F32Matrix(bad.data(), t, e), {}, 3, 0.1, dv);
  EXPECT_EQ(nonfinite.code(), kInvalid);
  EXPECT_THAT(std::string(nonfinite.message()), HasSubstr("row 2"));

  EXPECT_TRUE(bal({}, {2, 2, 1, 1}, 2, 1, 0.1, uv).ok());
  EXPECT_EQ(bal({}, {2, 2, 1}, 2, 1, 0.1, uv).code(), kInvalid);
  EXPECT_EQ(bal({}, {2, 2, -1, 3}, 2, 1, 0.1, uv).code(), kInvalid);
  EXPECT_THAT(std::string(bal({}, {2, 2, 1, 2}, 2, 1, 0.1, uv).message()),
              HasSubstr("not a multiple of top_k = 2"));
  EXPECT_EQ(bal({}, {2, 2, 1, 1}, 0, 1, 0.1, uv).code(), kInvalid);
  EXPECT_EQ(bal({}, {2, 2, 1, 1}, 5, 1, 0.1, uv).code(), kInvalid);
  EXPECT_EQ(bal({}, {2, 2, 1, 1}, 2, 0, 0.1, uv).code(), kInvalid);
  EXPECT_EQ(bal({}, {2, 2, 1, 1}, 2, 1, -1.0, uv).code(), kInvalid);
  EXPECT_EQ(bal({}, {1, 1, 0, 0}, 2, 1, 0.1, uv).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(bal({}, {2, 2, 1, 1}, 2, 1, 0.1, F32Matrix(bad.data(), t, e)).code(), kInvalid);
}

}  // namespace
}  // namespace gradsum::losses
