// The kernels of core/vec_math.h against the same functions in double: exp and sigmoid over a
// sweep of the floats in the accurate range (every 61st bit pattern) with the error bounds
// the header states and their special values, SwiGLU and RMSNorm rows on random inputs; and
// every build this CPU runs against the generic build bit for bit.
#include "core/vec_math.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/cpu_isa.h"
#include "gtest/gtest.h"

namespace gradsum::vec {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}
uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// |approx - ref| in units of the fp32 ulp at ref (ref a normal float's magnitude).
double UlpError(float approx, double ref) {
  int exponent = 0;
  std::frexp(ref, &exponent);  // ref = m 2^exponent, m in [0.5, 1)
  return std::fabs(static_cast<double>(approx) - ref) / std::ldexp(1.0, exponent - 24);
}

std::vector<const VecKernels*> Builds() {
  std::vector<const VecKernels*> builds;
  for (const char* isa : {"generic", "avx2", "avx512"}) {
    if (const VecKernels* k = VecKernelsFor(isa); k != nullptr) builds.push_back(k);
  }
  return builds;
}

// Every 61st float in [lo, hi] (both signs handled by bit order), plus lo and hi.
std::vector<float> Sweep(float lo, float hi) {
  std::vector<float> xs = {lo, hi};
  if (lo < 0.0f) {
    for (uint32_t b = Bits(-0.0f); b <= Bits(lo); b += 61) xs.push_back(FromBits(b));
  }
  for (uint32_t b = Bits(lo > 0.0f ? lo : 0.0f); b <= Bits(hi); b += 61) {
    xs.push_back(FromBits(b));
  }
  return xs;
}

// The largest UlpError of one build's kernel `fn` over xs against ref(x) in double; prints it
// with where it happened.
template <typename Ref>
double WorstUlp(const VecKernels& k, void (*fn)(const float*, float*, int64_t), const char* what,
                const std::vector<float>& xs, Ref ref) {
  std::vector<float> y(xs.size());
  fn(xs.data(), y.data(), static_cast<int64_t>(xs.size()));
  double worst = 0.0;
  float worst_x = 0.0f;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double e = UlpError(y[i], ref(static_cast<double>(xs[i])));
    if (e > worst) worst = e, worst_x = xs[i];
  }
  std::printf("%s (%s): max error %.3f ulp at x=%.9g\n", what, k.isa, worst, worst_x);
  return worst;
}

TEST(VecMathTest, ExpWithinTwoUlpOfDoubleExp) {
  const std::vector<float> xs = Sweep(-86.0f, 88.7228f);
  ASSERT_GT(xs.size(), 30'000'000u);
  for (const VecKernels* k : Builds()) {
    EXPECT_LE(WorstUlp(*k, k->exp, "exp", xs, [](double x) { return std::exp(x); }), 2.0) << k->isa;
  }
}

// The whole sweep bit for bit: the builds' explicit fused multiply-adds (FMA instructions in
// the AVX2 / AVX-512 builds, an exact emulation in the generic one) must round alike.
TEST(VecMathTest, ExpSweepGivesTheGenericBitsInEveryBuild) {
  const std::vector<float> xs = Sweep(-90.0f, 90.0f);
  const std::vector<const VecKernels*> builds = Builds();
  std::vector<float> want(xs.size());
  builds[0]->exp(xs.data(), want.data(), static_cast<int64_t>(xs.size()));
  for (size_t b = 1; b < builds.size(); ++b) {
    std::vector<float> got(xs.size());
    builds[b]->exp(xs.data(), got.data(), static_cast<int64_t>(xs.size()));
    size_t differ = 0;
    for (size_t i = 0; i < xs.size(); ++i) differ += Bits(got[i]) != Bits(want[i]) ? 1 : 0;
    EXPECT_EQ(differ, 0u) << builds[b]->isa;
  }
}

TEST(VecMathTest, ExpSpecialValues) {
  const float nan_payload = FromBits(0x7fc12345u), neg_nan = FromBits(0xffd00001u);
  const std::vector<float> x = {-kInf, -1e30f,   -86.5f, -86.0f, 0.0f, -0.0f,       1.0f,
                                88.0f, 88.7228f, 88.73f, 1e30f,  kInf, nan_payload, neg_nan};
  for (const VecKernels* k : Builds()) {
    std::vector<float> y(x.size());
    k->exp(x.data(), y.data(), static_cast<int64_t>(x.size()));
    EXPECT_EQ(Bits(y[0]), 0u) << k->isa;  // +0, exactly
    EXPECT_EQ(y[1], 0.0f) << k->isa;
    EXPECT_EQ(y[2], 0.0f) << k->isa;
    EXPECT_GT(y[3], 0.0f) << k->isa;
    EXPECT_EQ(y[4], 1.0f) << k->isa;
    EXPECT_EQ(y[5], 1.0f) << k->isa;
    EXPECT_NEAR(y[6], std::exp(1.0), 2.4e-7) << k->isa;
    EXPECT_LT(y[8], kInf) << k->isa;  // exp(88.7228) < FLT_MAX
    EXPECT_GT(y[8], 3.4e38f) << k->isa;
    EXPECT_EQ(y[9], kInf) << k->isa;
    EXPECT_EQ(y[10], kInf) << k->isa;
    EXPECT_EQ(y[11], kInf) << k->isa;
    EXPECT_TRUE(std::isnan(y[12])) << k->isa;
    EXPECT_TRUE(std::isnan(y[13])) << k->isa;
  }
}

TEST(VecMathTest, SigmoidWithinFourUlpOfDouble) {
  const std::vector<float> xs = Sweep(-86.0f, 40.0f);
  for (const VecKernels* k : Builds()) {
    EXPECT_LE(WorstUlp(*k, k->sigmoid, "sigmoid", xs,
                       [](double x) { return 1.0 / (1.0 + std::exp(-x)); }),
              4.0)
        << k->isa;
  }
}

TEST(VecMathTest, SigmoidSpecialValues) {
  const std::vector<float> x = {-kInf, -200.0f, -87.0f, 0.0f,
                                -0.0f, 200.0f,  kInf,   std::numeric_limits<float>::quiet_NaN()};
  for (const VecKernels* k : Builds()) {
    std::vector<float> y(x.size());
    k->sigmoid(x.data(), y.data(), static_cast<int64_t>(x.size()));
    EXPECT_EQ(y[0], 0.0f) << k->isa;
    EXPECT_EQ(y[1], 0.0f) << k->isa;
    EXPECT_LT(y[2], 4.5e-38f) << k->isa;  // true value 1.6e-38
    EXPECT_EQ(y[3], 0.5f) << k->isa;
    EXPECT_EQ(y[4], 0.5f) << k->isa;
    EXPECT_EQ(y[5], 1.0f) << k->isa;
    EXPECT_EQ(y[6], 1.0f) << k->isa;
    EXPECT_TRUE(std::isnan(y[7])) << k->isa;
  }
}

double SigmoidD(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// SwiGLU forward and backward against double, on random g (including the zero of SiLU' near
// g = -1.28, where d_gate cancels), u and d. Bounds from the header's: sigmoid <= 4 ulp, then
// a few correctly rounded products, each relative to the size of its terms (for d_gate that
// includes g * s: the error of s, carried through 1 - s and scaled by g).
TEST(VecMathTest, SwiGluMatchesDouble) {
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> wide(-30.0f, 30.0f);
  const int64_t n = 100'003;
  std::vector<float> g(n), u(n), d(n);
  for (int64_t i = 0; i < n; ++i) {
    g[i] =
        i % 3 == 0 ? wide(gen) : (i % 3 == 1 ? 4.0f * normal(gen) : -1.2785f + 0.01f * normal(gen));
    u[i] = normal(gen);
    d[i] = normal(gen);
  }
  const double eps = std::ldexp(1.0, -24);
  for (const VecKernels* k : Builds()) {
    std::vector<float> a(n), a2(n), dg(d), du(n);
    k->swiglu(g.data(), u.data(), a.data(), n);
    k->swiglu_backward(g.data(), u.data(), dg.data(), du.data(), a2.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const double gi = g[i], ui = u[i], di = d[i], s = SigmoidD(gi);
      const double a_ref = gi * s * ui;
      ASSERT_LE(std::fabs(a[i] - a_ref), 12 * eps * std::fabs(a_ref) + 1e-37)
          << k->isa << " a at g=" << g[i] << " u=" << u[i];
      ASSERT_EQ(Bits(a2[i]), Bits(a[i])) << k->isa << ": the backward's recomputed forward";
      const double du_ref = di * gi * s;
      ASSERT_LE(std::fabs(du[i] - du_ref), 12 * eps * std::fabs(du_ref) + 1e-37)
          << k->isa << " d_up at g=" << g[i];
      const double dg_ref = di * ui * s * (1.0 + gi * (1.0 - s));
      // 1 - s loses s's absolute error (a few ulp of s) when s is near 1, and g scales it.
      const double size =
          std::fabs(di * ui * s) * (1.0 + std::fabs(gi * (1.0 - s)) + std::fabs(gi) * s);
      ASSERT_LE(std::fabs(dg[i] - dg_ref), 16 * eps * size + 1e-37)
          << k->isa << " d_gate at g=" << g[i];
    }
  }
}

// RMSNorm rows against double (the normalised values and the gradients: relative to the size
// of their terms), for lengths with and without the 8-lane body and a tail.
TEST(VecMathTest, RmsNormRowsMatchDouble) {
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const float eps = 1e-6f;
  const double tol = std::ldexp(1.0, -20);  // a few fp32 roundings
  for (int64_t n : {1, 5, 8, 13, 128, 133}) {
    std::vector<float> x(n), gain(n), da(n);
    for (int64_t i = 0; i < n; ++i) {
      x[i] = normal(gen), gain[i] = 1.0f + 0.1f * normal(gen), da[i] = normal(gen);
    }
    double ms = 0.0;
    for (float v : x) ms += static_cast<double>(v) * v;
    const double r = 1.0 / std::sqrt(ms / n + eps);
    double dot = 0.0;
    for (int64_t i = 0; i < n; ++i) dot += static_cast<double>(da[i]) * gain[i] * x[i];
    for (const VecKernels* k : Builds()) {
      std::vector<float> y(n), dx(n, 0.25f);
      std::vector<double> dgain(n, -1.0);
      const float rf = k->rms_norm_row(x.data(), gain.data(), eps, y.data(), n);
      ASSERT_NEAR(rf, r, tol * r) << k->isa << " n=" << n;
      k->rms_norm_backward_row(x.data(), da.data(), gain.data(), rf, dgain.data(), dx.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_NEAR(y[i], x[i] * r * gain[i], tol * std::fabs(x[i] * r * gain[i]) + 1e-30)
            << k->isa << " n=" << n << " i=" << i;
        ASSERT_NEAR(dgain[i], -1.0 + da[i] * x[i] * r, tol * (1.0 + std::fabs(da[i] * x[i] * r)))
            << k->isa << " n=" << n << " i=" << i;
        const double t1 = r * gain[i] * da[i], t2 = r * r * r * dot / n * x[i];
        ASSERT_NEAR(dx[i], 0.25 + t1 - t2, tol * (0.25 + std::fabs(t1) + std::fabs(t2)))
            << k->isa << " n=" << n << " i=" << i;
      }
    }
  }
}

// Random and special inputs, lengths that exercise 4-, 8- and 16-wide bodies and tails, and
// an aliased exp: every build gives the generic build's bits.
TEST(VecMathTest, EveryBuildGivesTheGenericBits) {
  const std::vector<const VecKernels*> builds = Builds();
  ASSERT_STREQ(builds[0]->isa, "generic");
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 8.0f);
  for (int64_t n : {1, 3, 4, 7, 8, 15, 16, 17, 33, 1000, 4099}) {
    std::vector<float> x(n), u(n), d(n);
    for (int64_t i = 0; i < n; ++i) x[i] = normal(gen), u[i] = normal(gen), d[i] = normal(gen);
    const float specials[] = {-kInf,  kInf,   0.0f,  -0.0f,
                              1e-40f, -90.0f, 89.0f, std::numeric_limits<float>::quiet_NaN()};
    for (int64_t i = 0; i < n && i < 8; ++i) x[(i * 5) % n] = specials[i];
    struct Out {
      std::vector<float> exp, sig, a, a2, dg, du, norm, dx;
      std::vector<double> dgain;
      float r = 0.0f;
    };
    auto run = [&](const VecKernels& k) {
      Out o{x,
            std::vector<float>(n),
            std::vector<float>(n),
            std::vector<float>(n),
            d,
            std::vector<float>(n),
            std::vector<float>(n),
            d,
            std::vector<double>(n, 0.5)};
      k.exp(o.exp.data(), o.exp.data(), n);  // in place
      k.sigmoid(x.data(), o.sig.data(), n);
      k.swiglu(x.data(), u.data(), o.a.data(), n);
      k.swiglu_backward(x.data(), u.data(), o.dg.data(), o.du.data(), o.a2.data(), n);
      // RMSNorm rows on finite inputs: u as the row, d as gain and as dL/dy.
      o.r = k.rms_norm_row(u.data(), d.data(), 1e-6f, o.norm.data(), n);
      k.rms_norm_backward_row(u.data(), d.data(), d.data(), o.r, o.dgain.data(), o.dx.data(), n);
      return o;
    };
    const Out want = run(*builds[0]);
    for (size_t b = 1; b < builds.size(); ++b) {
      const Out got = run(*builds[b]);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(Bits(got.exp[i]), Bits(want.exp[i])) << builds[b]->isa << " exp n=" << n;
        ASSERT_EQ(Bits(got.sig[i]), Bits(want.sig[i])) << builds[b]->isa << " sigmoid n=" << n;
        ASSERT_EQ(Bits(got.a[i]), Bits(want.a[i])) << builds[b]->isa << " swiglu n=" << n;
        ASSERT_EQ(Bits(got.a2[i]), Bits(want.a2[i])) << builds[b]->isa << " n=" << n;
        ASSERT_EQ(Bits(got.dg[i]), Bits(want.dg[i])) << builds[b]->isa << " d_gate n=" << n;
        ASSERT_EQ(Bits(got.du[i]), Bits(want.du[i])) << builds[b]->isa << " d_up n=" << n;
        ASSERT_EQ(Bits(got.norm[i]), Bits(want.norm[i])) << builds[b]->isa << " norm n=" << n;
        ASSERT_EQ(Bits(got.dx[i]), Bits(want.dx[i])) << builds[b]->isa << " norm dx n=" << n;
        ASSERT_EQ(got.dgain[i], want.dgain[i]) << builds[b]->isa << " dgain n=" << n;
      }
      ASSERT_EQ(Bits(got.r), Bits(want.r)) << builds[b]->isa << " inv_rms n=" << n;
    }
  }
}

// The choice itself (PickIsaBuild) is tested in cpu_isa_test.
TEST(VecMathTest, BuildsExistWhereTheCpuRunsThem) {
  ASSERT_NE(VecKernelsFor("generic"), nullptr);
  EXPECT_EQ(VecKernelsFor("sse9"), nullptr);
  EXPECT_EQ(VecKernelsFor("avx2") != nullptr, CpuHasAvx2Fma());
  EXPECT_EQ(VecKernelsFor("avx512") != nullptr, CpuHasAvx512());
  const char* forced = std::getenv("GRADSUM_VEC_ISA");
  if (forced == nullptr && CpuHasAvx512()) {
    EXPECT_STREQ(SelectedVecKernels().isa, "avx512");
  }
}

}  // namespace
}  // namespace gradsum::vec
