// The CE options of SEMANTICS.md §3.2 (label smoothing, logit softcap, output z-loss) in the
// CE kernel and the fused linear CE, against an independent fp64 reference written here, and
// finite differences of that reference at a few elements.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "core/half.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "losses/cross_entropy.h"
#include "losses/linear_cross_entropy.h"
#include "losses/test_util.h"

namespace gradsum::losses {
namespace {

using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Opts {
  double eps = 0.0, cap = 0.0, alpha = 0.0;
};

CrossEntropyOptions CeOptions(const Opts& o) {
  CrossEntropyOptions c;
  c.ce.label_smoothing = o.eps;
  c.ce.logit_softcap = o.cap;
  c.ce.alpha_lse = o.alpha;
  return c;
}

// fp64 loss of one row of raw logits x (§3.2), written straight from the definitions:
// z = c tanh(x / c), CE = -(1 - eps) log p_y - eps mean_j log p_j, plus alpha lse^2.
double RowLoss(const double* x, int64_t v, int64_t y, const Opts& o) {
  std::vector<double> z(v);
  for (int64_t j = 0; j < v; ++j) z[j] = o.cap > 0 ? o.cap * std::tanh(x[j] / o.cap) : x[j];
  double mx = -INFINITY;
  for (double e : z) mx = std::max(mx, e);
  double s = 0.0;
  for (double e : z) s += std::exp(e - mx);
  const double lse = mx + std::log(s);
  double mean_logp = 0.0;
  for (double e : z) mean_logp += (e - lse) / v;
  return -(1.0 - o.eps) * (z[y] - lse) - o.eps * mean_logp + o.alpha * lse * lse;
}

// Its analytic gradient, derived independently of the kernel's (the softmax form of §3.2).
void RowGrad(const double* x, int64_t v, int64_t y, const Opts& o, double scale, double* g) {
  std::vector<double> z(v), f(v, 1.0);
  for (int64_t j = 0; j < v; ++j) {
    if (o.cap > 0) {
      const double t = std::tanh(x[j] / o.cap);
      z[j] = o.cap * t;
      f[j] = 1.0 - t * t;
    } else {
      z[j] = x[j];
    }
  }
  double mx = -INFINITY;
  for (double e : z) mx = std::max(mx, e);
  double s = 0.0;
  for (double e : z) s += std::exp(e - mx);
  const double lse = mx + std::log(s);
  for (int64_t j = 0; j < v; ++j) {
    const double p = std::exp(z[j] - lse);
    // d/dz of -(1-eps) log p_y: (1-eps)(p - [j==y]); of -eps mean log p: eps (p - 1/V);
    // of alpha lse^2: 2 alpha lse p.
    const double dz =
        (1.0 - o.eps) * (p - (j == y ? 1.0 : 0.0)) + o.eps * (p - 1.0 / v) + 2 * o.alpha * lse * p;
    g[j] = scale * dz * f[j];
  }
}

struct Ref {
  double loss = 0.0;
  std::vector<double> grad;
};

Ref Reference(const std::vector<double>& x, int64_t n, int64_t v, const std::vector<int64_t>& y,
              const std::vector<float>& w, double d, const Opts& o) {
  Ref r;
  r.grad.assign(n * v, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    const double wt = y[t] == -100 ? 0.0 : (w.empty() ? 1.0 : w[t]);
    if (wt == 0.0) continue;
    r.loss += wt * RowLoss(&x[t * v], v, y[t], o) / d;
    RowGrad(&x[t * v], v, y[t], o, wt / d, &r.grad[t * v]);
  }
  return r;
}

struct Problem {
  int64_t n, v;
  std::vector<float> x;
  std::vector<int64_t> y;
  std::vector<float> w;
  double d;
};

Problem MakeProblem(int64_t n, int64_t v, uint32_t seed, bool weighted) {
  Problem p{n, v, RandomNormal(n * v, seed, 3.0f), {}, {}, 0.0};
  std::mt19937 rng(seed + 1);
  std::uniform_int_distribution<int64_t> cls(0, v - 1);
  std::uniform_real_distribution<float> wd(0.25f, 2.0f);
  for (int64_t t = 0; t < n; ++t) {
    p.y.push_back(t % 5 == 3 ? -100 : cls(rng));
    if (weighted) p.w.push_back(t % 7 == 2 ? 0.0f : wd(rng));
  }
  for (int64_t t = 0; t < n; ++t) {
    if (p.y[t] != -100) p.d += weighted ? p.w[t] : 1.0;
  }
  p.d *= 1.5;  // D is global: larger than this call's share
  return p;
}

const Opts kCases[] = {{0.1, 0, 0}, {0, 5.0, 0}, {0, 0, 1e-2}, {0.2, 4.0, 3e-2}};

TEST(CrossEntropyOptions, F32MatchesFp64Reference) {
  for (const Opts& o : kCases) {
    for (int64_t v : {7, 1000, 3000}) {  // 3000: several 1024-column tiles
      for (bool weighted : {false, true}) {
        Problem p = MakeProblem(23, v, static_cast<uint32_t>(v), weighted);
        const std::vector<double> xd(p.x.begin(), p.x.end());
        const Ref ref = Reference(xd, p.n, v, p.y, p.w, p.d, o);
        std::vector<float> grad(p.n * v, 7.0f);
        absl::StatusOr<CrossEntropyResult> r =
            CrossEntropyForwardBackward(F32Matrix(p.x.data(), p.n, v), p.y, p.w, p.d,
                                        F32Matrix(grad.data(), p.n, v), CeOptions(o));
        ASSERT_TRUE(r.ok()) << r.status();
        SCOPED_TRACE(::testing::Message() << "eps " << o.eps << " cap " << o.cap << " alpha "
                                          << o.alpha << " V " << v << " weighted " << weighted);
        EXPECT_NEAR(r->local_loss, ref.loss, 1e-5 * std::abs(ref.loss));
        EXPECT_NEAR(r->local_loss,
                    (r->local_weighted_ce_sum + o.alpha * r->local_weighted_lse_sq_sum) / p.d,
                    1e-12 * std::abs(r->local_loss));
        double max_err = 0.0, max_ref = 0.0;
        for (int64_t i = 0; i < p.n * v; ++i) {
          max_err = std::max(max_err, std::abs(grad[i] - ref.grad[i]));
          max_ref = std::max(max_ref, std::abs(ref.grad[i]));
        }
        EXPECT_LE(max_err, 2e-6 * max_ref + 1e-9);
        // Forward only: the same loss, bit for bit.
        absl::StatusOr<CrossEntropyResult> f =
            CrossEntropyForward(F32Matrix(p.x.data(), p.n, v), p.y, p.w, p.d, CeOptions(o));
        ASSERT_TRUE(f.ok()) << f.status();
        EXPECT_EQ(f->local_loss, r->local_loss);
        // In place: the same gradient, bit for bit.
        std::vector<float> inplace = p.x;
        ASSERT_TRUE(CrossEntropyForwardBackward(F32Matrix(inplace.data(), p.n, v), p.y, p.w, p.d,
                                                F32Matrix(inplace.data(), p.n, v), CeOptions(o))
                        .ok());
        EXPECT_EQ(0, std::memcmp(inplace.data(), grad.data(), grad.size() * sizeof(float)));
      }
    }
  }
}

TEST(CrossEntropyOptions, GradientMatchesFiniteDifferences) {
  Problem p = MakeProblem(5, 40, 11, /*weighted=*/true);
  std::vector<double> xd(p.x.begin(), p.x.end());
  for (const Opts& o : kCases) {
    std::vector<float> grad(p.n * p.v);
    ASSERT_TRUE(CrossEntropyForwardBackward(F32Matrix(p.x.data(), p.n, p.v), p.y, p.w, p.d,
                                            F32Matrix(grad.data(), p.n, p.v), CeOptions(o))
                    .ok());
    // A few elements, the targets among them.
    for (int64_t t : {0, 1, 4}) {
      if (p.y[t] == -100) continue;
      for (int64_t j : {int64_t{0}, p.y[t], int64_t{17}}) {
        const int64_t i = t * p.v + j;
        const double h = 1e-5, x0 = xd[i];
        xd[i] = x0 + h;
        const double lp = Reference(xd, p.n, p.v, p.y, p.w, p.d, o).loss;
        xd[i] = x0 - h;
        const double lm = Reference(xd, p.n, p.v, p.y, p.w, p.d, o).loss;
        xd[i] = x0;
        EXPECT_NEAR(grad[i], (lp - lm) / (2 * h), 1e-6)
            << "eps " << o.eps << " cap " << o.cap << " alpha " << o.alpha << " at " << t << ","
            << j;
      }
    }
  }
}

TEST(CrossEntropyOptions, Bf16MatchesReferenceOfRoundedLogits) {
  const Opts o{0.1, 5.0, 1e-2};
  Problem p = MakeProblem(16, 1500, 5, /*weighted=*/false);
  std::vector<uint16_t> xb(p.x.size()), gb(p.x.size());
  std::vector<double> xd(p.x.size());
  for (size_t i = 0; i < p.x.size(); ++i) {
    xb[i] = BF16::FromFloat(p.x[i]).bits;
    xd[i] = BF16::FromBits(xb[i]).ToFloat();
  }
  const Ref ref = Reference(xd, p.n, p.v, p.y, p.w, p.d, o);
  absl::StatusOr<CrossEntropyResult> r = CrossEntropyForwardBackward(
      *TensorView::Create(xb.data(), DType::kBF16, {p.n, p.v}), p.y, {}, p.d,
      *TensorView::Create(gb.data(), DType::kBF16, {p.n, p.v}), CeOptions(o));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->local_loss, ref.loss, 1e-5 * std::abs(ref.loss));
  double max_ref = 0.0;
  for (double g : ref.grad) max_ref = std::max(max_ref, std::abs(g));
  // bf16 keeps 8 bits: 2^-8 of each element, plus fp32 rounding where p_j - eps / V cancels.
  for (size_t i = 0; i < gb.size(); ++i) {
    const double g = BF16::FromBits(gb[i]).ToFloat();
    ASSERT_NEAR(g, ref.grad[i], 4e-3 * std::abs(ref.grad[i]) + 1e-6 * max_ref) << i;
  }
}

TEST(CrossEntropyOptions, OptionsOffAreThePlainKernelBitForBit) {
  // Explicit zeros are the defaults: the same code path, the same bits.
  Problem p = MakeProblem(9, 2100, 3, /*weighted=*/true);
  std::vector<float> g0(p.x.size()), g1(p.x.size());
  CrossEntropyOptions zeros;
  zeros.ce.label_smoothing = 0.0;
  zeros.ce.logit_softcap = 0.0;
  zeros.ce.alpha_lse = 0.0;
  absl::StatusOr<CrossEntropyResult> a = CrossEntropyForwardBackward(
      F32Matrix(p.x.data(), p.n, p.v), p.y, p.w, p.d, F32Matrix(g0.data(), p.n, p.v));
  absl::StatusOr<CrossEntropyResult> b = CrossEntropyForwardBackward(
      F32Matrix(p.x.data(), p.n, p.v), p.y, p.w, p.d, F32Matrix(g1.data(), p.n, p.v), zeros);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->local_loss, b->local_loss);
  EXPECT_EQ(b->local_weighted_lse_sq_sum, 0.0);
  EXPECT_EQ(0, std::memcmp(g0.data(), g1.data(), g0.size() * sizeof(float)));
}

TEST(CrossEntropyOptions, BadValuesAreInvalidArgumentNamingTheValue) {
  Problem p = MakeProblem(4, 8, 1, /*weighted=*/false);
  std::vector<float> grad(p.x.size());
  struct Bad {
    Opts o;
    const char* text;
  };
  const Bad bad[] = {
      {{-0.1, 0, 0}, "label_smoothing -0.1"}, {{1.0, 0, 0}, "label_smoothing 1"},
      {{kNaN, 0, 0}, "label_smoothing nan"},  {{0, -2.0, 0}, "logit_softcap -2"},
      {{0, kNaN, 0}, "logit_softcap nan"},    {{0, INFINITY, 0}, "logit_softcap inf"},
      {{0, 0, -1e-3}, "alpha_lse -0.001"},    {{0, 0, kNaN}, "alpha_lse nan"}};
  for (const Bad& b : bad) {
    absl::StatusOr<CrossEntropyResult> r =
        CrossEntropyForwardBackward(F32Matrix(p.x.data(), p.n, p.v), p.y, {}, p.d,
                                    F32Matrix(grad.data(), p.n, p.v), CeOptions(b.o));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << b.text;
    EXPECT_THAT(r.status().message(), HasSubstr(b.text));
    std::vector<float> h = RandomNormal(p.n * 3, 2, 1.0f), w = RandomNormal(3 * p.v, 3, 1.0f);
    std::vector<float> gh(h.size()), gw(w.size());
    LinearCrossEntropyOptions lo;
    lo.ce.label_smoothing = b.o.eps;
    lo.ce.logit_softcap = b.o.cap;
    lo.ce.alpha_lse = b.o.alpha;
    absl::StatusOr<LinearCrossEntropyResult> l = LinearCrossEntropyForwardBackward(
        F32Matrix(h.data(), p.n, 3), F32Matrix(w.data(), 3, p.v), p.y, {}, p.d,
        F32Matrix(gh.data(), p.n, 3), F32Matrix(gw.data(), 3, p.v), lo);
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << b.text;
    EXPECT_THAT(l.status().message(), HasSubstr(b.text));
  }
}

TEST(CrossEntropyOptions, NonFiniteRows) {
  const int64_t v = 6;
  std::vector<float> x = RandomNormal(2 * v, 4, 1.0f), grad(2 * v);
  const std::vector<int64_t> y = {1, 2};
  // +inf and -inf under the cap are finite (+-c) and fine; the factor there is 0.
  x[3] = kInf;
  x[v + 4] = -kInf;
  absl::StatusOr<CrossEntropyResult> r =
      CrossEntropyForwardBackward(F32Matrix(x.data(), 2, v), y, {}, 2.0,
                                  F32Matrix(grad.data(), 2, v), CeOptions({0.1, 3.0, 0.01}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(std::isfinite(r->local_loss));
  EXPECT_EQ(grad[3], 0.0f);
  // Without the cap, a -inf anywhere with smoothing is an error naming the row.
  x[3] = 0.5f;
  r = CrossEntropyForwardBackward(F32Matrix(x.data(), 2, v), y, {}, 2.0,
                                  F32Matrix(grad.data(), 2, v), CeOptions({0.1, 0, 0}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("row 1"));
  EXPECT_THAT(r.status().message(), HasSubstr("label smoothing"));
  // ... and fine with the z-loss alone.
  EXPECT_TRUE(CrossEntropyForwardBackward(F32Matrix(x.data(), 2, v), y, {}, 2.0,
                                          F32Matrix(grad.data(), 2, v), CeOptions({0, 0, 0.01}))
                  .ok());
  // NaN is an error with the cap.
  x[2] = std::numeric_limits<float>::quiet_NaN();
  r = CrossEntropyForwardBackward(F32Matrix(x.data(), 2, v), y, {}, 2.0,
                                  F32Matrix(grad.data(), 2, v), CeOptions({0, 3.0, 0}));
  EXPECT_THAT(r.status().message(), HasSubstr("row 0"));
  EXPECT_THAT(r.status().message(), HasSubstr("NaN"));
}

TEST(CrossEntropyOptions, ZeroGlobalWeightSumGivesZero) {
  const int64_t v = 5;
  std::vector<float> x = RandomNormal(3 * v, 6, 1.0f), grad(3 * v, 9.0f);
  const std::vector<int64_t> y = {-100, -100, -100};
  absl::StatusOr<CrossEntropyResult> r = CrossEntropyForwardBackward(
      F32Matrix(x.data(), 3, v), y, {}, 0.0, F32Matrix(grad.data(), 3, v), CeOptions({0.1, 2, 1}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->local_loss, 0.0);
  for (float g : grad) EXPECT_EQ(g, 0.0f);
}

TEST(LinearCrossEntropyOptions, MatchesFp64Reference) {
  const int64_t n = 37, dm = 6, v = 1100;
  Problem p = MakeProblem(n, v, 21, /*weighted=*/true);
  const std::vector<float> h = RandomNormal(n * dm, 22, 1.0f), w = RandomNormal(dm * v, 23, 1.0f);
  std::vector<double> z(n * v, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < v; ++j) {
      for (int64_t k = 0; k < dm; ++k)
        z[t * v + j] += static_cast<double>(h[t * dm + k]) * w[k * v + j];
    }
  }
  for (const Opts& o : kCases) {
    const Ref ref = Reference(z, n, v, p.y, p.w, p.d, o);
    std::vector<double> ref_gh(n * dm, 0.0), ref_gw(dm * v, 0.0);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t k = 0; k < dm; ++k) {
        for (int64_t j = 0; j < v; ++j) {
          ref_gh[t * dm + k] += ref.grad[t * v + j] * w[k * v + j];
          ref_gw[k * v + j] += h[t * dm + k] * ref.grad[t * v + j];
        }
      }
    }
    std::vector<float> gh(n * dm), gw(dm * v, 0.0f);
    LinearCrossEntropyOptions lo;
    lo.ce.label_smoothing = o.eps;
    lo.ce.logit_softcap = o.cap;
    lo.ce.alpha_lse = o.alpha;
    lo.chunk_rows = 8;
    std::vector<float> hc = h, wc = w;
    absl::StatusOr<LinearCrossEntropyResult> r = LinearCrossEntropyForwardBackward(
        F32Matrix(hc.data(), n, dm), F32Matrix(wc.data(), dm, v), p.y, p.w, p.d,
        F32Matrix(gh.data(), n, dm), F32Matrix(gw.data(), dm, v), lo);
    ASSERT_TRUE(r.ok()) << r.status();
    SCOPED_TRACE(::testing::Message()
                 << "eps " << o.eps << " cap " << o.cap << " alpha " << o.alpha);
    EXPECT_NEAR(r->ce.local_loss, ref.loss, 1e-5 * std::abs(ref.loss));
    for (int64_t i = 0; i < n * dm; ++i) ASSERT_NEAR(gh[i], ref_gh[i], 1e-5) << i;
    for (int64_t i = 0; i < dm * v; ++i) ASSERT_NEAR(gw[i], ref_gw[i], 1e-5) << i;
  }
}

}  // namespace
}  // namespace gradsum::losses
