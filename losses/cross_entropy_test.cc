#include "losses/cross_entropy.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/half.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "losses/token_weights.h"

namespace gradsum::losses {
namespace {

using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TensorView View(void* data, DType dtype, int64_t n, int64_t v) {
  return *TensorView::Create(data, dtype, {n, v});
}

std::vector<float> RandomLogits(int64_t n, int64_t v, uint32_t seed, float scale = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(n * v));
  for (float& e : x) e = dist(rng);
  return x;
}

std::vector<int64_t> RandomLabels(int64_t n, int64_t v, uint32_t seed, double ignore_fraction) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> cls(0, v - 1);
  std::bernoulli_distribution ignore(ignore_fraction);
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (int64_t& e : y) e = ignore(rng) ? -100 : cls(rng);
  return y;
}

// Plain double-precision reference of SEMANTICS.md §3 for one micro-batch.
struct Reference {
  double loss = 0.0;
  std::vector<double> grad;
};

Reference ReferenceCe(const std::vector<double>& z, int64_t n, int64_t v,
                      const std::vector<int64_t>& labels, const std::vector<double>& w, double d) {
  Reference ref;
  ref.grad.assign(static_cast<size_t>(n * v), 0.0);
  for (int64_t t = 0; t < n; ++t) {
    if (labels[t] == -100 || w[t] == 0.0 || d == 0.0) continue;
    double mx = -INFINITY;
    for (int64_t j = 0; j < v; ++j) mx = std::max(mx, z[t * v + j]);
    double s = 0.0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(z[t * v + j] - mx);
    const double lse = mx + std::log(s);
    ref.loss += w[t] * (lse - z[t * v + labels[t]]) / d;
    for (int64_t j = 0; j < v; ++j) {
      ref.grad[t * v + j] = w[t] / d * (std::exp(z[t * v + j] - lse) - (j == labels[t] ? 1 : 0));
    }
  }
  return ref;
}

std::vector<double> ToDouble(const std::vector<float>& x) { return {x.begin(), x.end()}; }

std::vector<double> Ones(const std::vector<int64_t>& labels) {
  std::vector<double> w(labels.size());
  for (size_t t = 0; t < labels.size(); ++t) w[t] = labels[t] == -100 ? 0.0 : 1.0;
  return w;
}

double Sum(const std::vector<double>& x) {
  double s = 0;
  for (double e : x) s += e;
  return s;
}

TEST(CrossEntropyTest, F32MatchesDoubleReferenceTokenMode) {
  const int64_t n = 37, v = 1003;  // v not a multiple of the tile or lane width
  std::vector<float> z = RandomLogits(n, v, 1);
  std::vector<int64_t> y = RandomLabels(n, v, 2, 0.25);
  const std::vector<double> w = Ones(y);
  const double d = Sum(w) * 3.0;  // as if two other micro-batches held the rest of D
  std::vector<float> grad(z.size(), kNaN);
  auto r = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, {}, d,
                                       View(grad.data(), DType::kF32, n, v));
  ASSERT_TRUE(r.ok()) << r.status();
  const Reference ref = ReferenceCe(ToDouble(z), n, v, y, w, d);
  EXPECT_NEAR(r->local_loss, ref.loss, 1e-6 * std::abs(ref.loss));
  EXPECT_NEAR(r->local_weighted_ce_sum, ref.loss * d, 1e-6 * std::abs(ref.loss * d));
  EXPECT_DOUBLE_EQ(r->local_weight_sum, Sum(w));
  EXPECT_EQ(r->local_valid_tokens, static_cast<int64_t>(Sum(w)));
  for (size_t i = 0; i < grad.size(); ++i) {
    ASSERT_NEAR(grad[i], ref.grad[i], 2e-7 / d + 1e-6 * std::abs(ref.grad[i])) << "element " << i;
  }
}

TEST(CrossEntropyTest, SampleAndSquareModeWeightsMatchReference) {
  // Three samples with 3, 1 and 2 valid tokens; padding/ignored tokens carry -100.
  const std::vector<int64_t> y = {4, 1, -100, 0, 2, -100, 3, 3};
  const std::vector<int64_t> sid = {7, 7, 7, 7, 9, 9, 5, 5};
  auto ws = ComputeTokenWeights(y, sid, CeWeightMode::kSample);
  ASSERT_TRUE(ws.ok()) << ws.status();
  const std::vector<float> expect_sample = {1 / 3.f, 1 / 3.f, 0, 1 / 3.f, 1, 0, 0.5f, 0.5f};
  EXPECT_EQ(*ws, expect_sample);
  auto wq = ComputeTokenWeights(y, sid, CeWeightMode::kSquare);
  ASSERT_TRUE(wq.ok());
  const float r3 = static_cast<float>(1 / std::sqrt(3.0)),
              r2 = static_cast<float>(1 / std::sqrt(2.0));
  const std::vector<float> expect_square = {r3, r3, 0, r3, 1, 0, r2, r2};
  EXPECT_EQ(*wq, expect_square);
  auto wt = ComputeTokenWeights(y, {}, CeWeightMode::kToken);
  ASSERT_TRUE(wt.ok());
  EXPECT_EQ(*wt, (std::vector<float>{1, 1, 0, 1, 1, 0, 1, 1}));

  const int64_t n = 8, v = 5;
  std::vector<float> z = RandomLogits(n, v, 3);
  for (const std::vector<float>* wf : {&*ws, &*wq}) {
    std::vector<double> wd(wf->begin(), wf->end());
    const double d = Sum(wd);
    std::vector<float> grad(z.size());
    auto r = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, *wf, d,
                                         View(grad.data(), DType::kF32, n, v));
    ASSERT_TRUE(r.ok()) << r.status();
    const Reference ref = ReferenceCe(ToDouble(z), n, v, y, wd, d);
    EXPECT_NEAR(r->local_loss, ref.loss, 1e-6 * ref.loss);
    for (size_t i = 0; i < grad.size(); ++i) EXPECT_NEAR(grad[i], ref.grad[i], 1e-6);
  }
}

TEST(CrossEntropyTest, TokenWeightErrors) {
  auto bad = ComputeTokenWeights({1, 2}, {0}, CeWeightMode::kSample);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("1 sample ids for 2 labels"));
  auto mode = ComputeTokenWeights({1}, {0}, static_cast<CeWeightMode>(9));
  EXPECT_EQ(mode.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CrossEntropyTest, Bf16MatchesReferenceOnRoundedLogits) {
  const int64_t n = 19, v = 2500;
  std::vector<float> zf = RandomLogits(n, v, 4);
  std::vector<BF16> z(zf.size());
  std::vector<double> zd(zf.size());
  for (size_t i = 0; i < zf.size(); ++i) {
    z[i] = BF16::FromFloat(zf[i]);
    zd[i] = z[i].ToFloat();
  }
  std::vector<int64_t> y = RandomLabels(n, v, 5, 0.2);
  const std::vector<double> w = Ones(y);
  const double d = Sum(w);
  std::vector<BF16> grad(z.size());
  auto r = CrossEntropyForwardBackward(View(z.data(), DType::kBF16, n, v), y, {}, d,
                                       View(grad.data(), DType::kBF16, n, v));
  ASSERT_TRUE(r.ok()) << r.status();
  const Reference ref = ReferenceCe(zd, n, v, y, w, d);
  EXPECT_NEAR(r->local_loss, ref.loss, 1e-6 * ref.loss);  // fp32 math on the bf16 inputs
  for (size_t i = 0; i < grad.size(); ++i) {
    // One bf16 rounding of the fp32 gradient: relative 2^-8, plus fp32 noise.
    ASSERT_NEAR(grad[i].ToFloat(), ref.grad[i], std::abs(ref.grad[i]) * 0.0040 + 1e-8) << i;
  }
}

// The bf16 kernel widens its logits exactly and runs the fp32 row code, so its gradient is
// the fp32 kernel's gradient on the widened logits, rounded once by BF16::FromFloat
// (core/half.h): bit for bit, tiny entries included (weights 0 and 2^-20 to 2^28, so
// entries span from subnormal to order 1).
TEST(CrossEntropyTest, Bf16GradientIsTheF32GradientRoundedOnce) {
  const int64_t n = 17, v = 3001;
  std::vector<float> zf = RandomLogits(n, v, 8, 30.0f);  // probabilities down to subnormal
  std::vector<BF16> z(zf.size());
  for (size_t i = 0; i < zf.size(); ++i) {
    z[i] = BF16::FromFloat(zf[i]);
    zf[i] = z[i].ToFloat();
  }
  std::vector<int64_t> y = RandomLabels(n, v, 9, 0.2);
  std::vector<float> w(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    w[r] = r % 3 == 0 ? 0.0f : std::ldexp(1.0f, -20 + 3 * static_cast<int>(r));
  }
  double d = 0.0;
  for (float x : w) d += x;
  std::vector<float> gf(zf.size());
  std::vector<BF16> gb(z.size());
  auto a = CrossEntropyForwardBackward(View(zf.data(), DType::kF32, n, v), y, w, d,
                                       View(gf.data(), DType::kF32, n, v));
  auto b = CrossEntropyForwardBackward(View(z.data(), DType::kBF16, n, v), y, w, d,
                                       View(gb.data(), DType::kBF16, n, v));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->local_weighted_ce_sum, b->local_weighted_ce_sum);
  int64_t subnormal = 0;
  for (size_t i = 0; i < gf.size(); ++i) {
    ASSERT_EQ(gb[i].bits, BF16::FromFloat(gf[i]).bits) << i << ": " << gf[i];
    subnormal += gf[i] != 0.0f && std::abs(gf[i]) < 1.17549435e-38f ? 1 : 0;
  }
  EXPECT_GT(subnormal, 0);  // the small end was exercised
}

TEST(CrossEntropyTest, InPlaceEqualsOutOfPlaceBitwise) {
  const int64_t n = 23, v = 3001;
  std::vector<int64_t> y = RandomLabels(n, v, 6, 0.3);
  {
    std::vector<float> z = RandomLogits(n, v, 7);
    std::vector<float> grad(z.size());
    auto a = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, {}, 100.0,
                                         View(grad.data(), DType::kF32, n, v));
    ASSERT_TRUE(a.ok());
    auto b = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, {}, 100.0,
                                         View(z.data(), DType::kF32, n, v));
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(a->local_loss, b->local_loss);
    EXPECT_EQ(z, grad);
  }
  {
    std::vector<float> zf = RandomLogits(n, v, 8);
    std::vector<uint16_t> z(zf.size());
    for (size_t i = 0; i < zf.size(); ++i) z[i] = BF16::FromFloat(zf[i]).bits;
    std::vector<uint16_t> grad(z.size());
    auto a = CrossEntropyForwardBackward(View(z.data(), DType::kBF16, n, v), y, {}, 100.0,
                                         View(grad.data(), DType::kBF16, n, v));
    ASSERT_TRUE(a.ok());
    auto b = CrossEntropyForwardBackward(View(z.data(), DType::kBF16, n, v), y, {}, 100.0,
                                         View(z.data(), DType::kBF16, n, v));
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(a->local_loss, b->local_loss);
    EXPECT_EQ(z, grad);
  }
}

TEST(CrossEntropyTest, GradientMatchesCentralFiniteDifferences) {
  const int64_t n = 5, v = 11;
  std::vector<float> z = RandomLogits(n, v, 9, 1.0f);
  const std::vector<int64_t> y = {3, -100, 10, 0, 7};
  const std::vector<float> w = {0.5f, 2.0f, 1.0f, 0.25f, 1.5f};
  const double d = 4.0;
  std::vector<float> grad(z.size());
  auto r = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, w, d,
                                       View(grad.data(), DType::kF32, n, v));
  ASSERT_TRUE(r.ok()) << r.status();
  const float h = 1e-2f;
  for (size_t i = 0; i < z.size(); ++i) {
    std::vector<float> zp = z, zm = z;
    zp[i] += h;
    zm[i] -= h;
    auto lp = CrossEntropyForward(View(zp.data(), DType::kF32, n, v), y, w, d);
    auto lm = CrossEntropyForward(View(zm.data(), DType::kF32, n, v), y, w, d);
    ASSERT_TRUE(lp.ok() && lm.ok());
    const double fd = (lp->local_loss - lm->local_loss) / (static_cast<double>(zp[i]) - zm[i]);
    EXPECT_NEAR(grad[i], fd, 1e-4) << "element " << i;
  }
}

TEST(CrossEntropyTest, ZeroDivisorGivesZeroLossAndExactlyZeroGradient) {
  const int64_t n = 6, v = 9;
  std::vector<float> z = RandomLogits(n, v, 10);
  z[0] = kNaN;  // ignored rows are never read
  const std::vector<int64_t> y(n, -100);
  std::vector<float> grad(z.size(), kNaN);
  auto r = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, {}, 0.0,
                                       View(grad.data(), DType::kF32, n, v));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->local_loss, 0.0);
  EXPECT_EQ(r->local_valid_tokens, 0);
  for (float g : grad) EXPECT_EQ(g, 0.0f);
  // Zero rows: also fine.
  auto empty = CrossEntropyForward(View(nullptr, DType::kF32, 0, v), {}, {}, 0.0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->local_loss, 0.0);
}

TEST(CrossEntropyTest, ZeroWeightRowsAndNegInfEntries) {
  const int64_t n = 3, v = 4;
  std::vector<float> z = {1, 2, 3, 4, -kInf, 0, -kInf, 1, 5, 5, 5, 5};
  const std::vector<int64_t> y = {2, 1, 0};
  const std::vector<float> w = {0.0f, 1.0f, 1.0f};
  std::vector<float> grad(z.size(), kNaN);
  auto r = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, w, 2.0,
                                       View(grad.data(), DType::kF32, n, v));
  ASSERT_TRUE(r.ok()) << r.status();
  for (int j = 0; j < 4; ++j) EXPECT_EQ(grad[j], 0.0f);
  EXPECT_EQ(grad[4], 0.0f);  // exp(-inf) is exactly 0
  EXPECT_EQ(grad[6], 0.0f);
  const double lse1 = std::log(1.0 + std::exp(1.0));
  const double lse2 = 5.0 + std::log(4.0);
  EXPECT_NEAR(r->local_loss, ((lse1 - 0.0) + (lse2 - 5.0)) / 2.0, 1e-7);
  EXPECT_NEAR(grad[5], 0.5 * (1.0 / (1.0 + std::exp(1.0)) - 1.0), 1e-7);
  EXPECT_NEAR(grad[8], 0.5 * (0.25 - 1.0), 1e-7);
  EXPECT_EQ(r->local_valid_tokens, 3);
  EXPECT_EQ(r->local_weight_sum, 2.0);
}

TEST(CrossEntropyTest, LargeMagnitudesAndGrowingMaxAcrossTiles) {
  // The row maximum keeps growing from tile to tile, so the running sum is rescaled.
  const int64_t n = 2, v = 5000;
  std::vector<float> z(n * v);
  for (int64_t j = 0; j < v; ++j) {
    z[j] = 1e4f + 0.01f * static_cast<float>(j);
    z[v + j] = -3e4f + 0.02f * static_cast<float>(v - j);
  }
  const std::vector<int64_t> y = {17, 4999};
  std::vector<float> grad(z.size());
  auto r = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, {}, 2.0,
                                       View(grad.data(), DType::kF32, n, v));
  ASSERT_TRUE(r.ok()) << r.status();
  const Reference ref = ReferenceCe(ToDouble(z), n, v, y, {1.0, 1.0}, 2.0);
  EXPECT_NEAR(r->local_loss, ref.loss, 1e-6 * ref.loss);
  for (size_t i = 0; i < grad.size(); ++i) ASSERT_NEAR(grad[i], ref.grad[i], 1e-6) << i;
}

TEST(CrossEntropyTest, ThreadCountDoesNotChangeResults) {
  const int64_t n = 64, v = 4099;
  std::vector<float> z = RandomLogits(n, v, 11);
  std::vector<int64_t> y = RandomLabels(n, v, 12, 0.1);
  std::vector<float> g1(z.size()), g2(z.size());
  CrossEntropyOptions one;
  one.num_threads = 1;
  CrossEntropyOptions two;
  two.num_threads = 2;
  auto a = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, {}, 64.0,
                                       View(g1.data(), DType::kF32, n, v), one);
  auto b = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, {}, 64.0,
                                       View(g2.data(), DType::kF32, n, v), two);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->local_loss, b->local_loss);
  EXPECT_EQ(g1, g2);
}

TEST(CrossEntropyTest, CustomIgnoreIndex) {
  const int64_t n = 2, v = 3;
  std::vector<float> z = {1, 2, 3, 3, 2, 1};
  CrossEntropyOptions opt;
  opt.ignore_index = 2;
  const std::vector<int64_t> y = {2, 0};  // row 0 ignored
  auto r = CrossEntropyForward(View(z.data(), DType::kF32, n, v), y, {}, 1.0, opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->local_valid_tokens, 1);
  EXPECT_NEAR(r->local_loss, std::log(std::exp(3.0) + std::exp(2.0) + std::exp(1.0)) - 3.0, 1e-7);
  const std::vector<int64_t> bad = {-100, 0};  // -100 is an ordinary label now
  EXPECT_EQ(
      CrossEntropyForward(View(z.data(), DType::kF32, n, v), bad, {}, 1.0, opt).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// ---- Error paths. ----

absl::Status RunF32(std::vector<float>& z, int64_t n, int64_t v, const std::vector<int64_t>& y,
                    const std::vector<float>& w, double d) {
  std::vector<float> grad(z.size());
  return CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, w, d,
                                     View(grad.data(), DType::kF32, n, v))
      .status();
}

TEST(CrossEntropyErrorsTest, OutOfRangeLabelNamesRowAndLabelAndLeavesLogitsUntouched) {
  const int64_t n = 3, v = 4;
  std::vector<float> z = RandomLogits(n, v, 13);
  const std::vector<float> before = z;
  for (int64_t bad : {int64_t{4}, int64_t{-1}, int64_t{1} << 40}) {
    const std::vector<int64_t> y = {0, 1, bad};
    auto r = CrossEntropyForwardBackward(View(z.data(), DType::kF32, n, v), y, {}, 3.0,
                                         View(z.data(), DType::kF32, n, v));  // in place
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()),
                HasSubstr(absl::StrCat("label ", bad, " at row 2")));
    EXPECT_EQ(z, before);
  }
}

TEST(CrossEntropyErrorsTest, BadWeightsAndDivisor) {
  const int64_t n = 2, v = 3;
  std::vector<float> z = RandomLogits(n, v, 14);
  const std::vector<int64_t> y = {0, 1};
  auto code = [](const absl::Status& s) { return s.code(); };
  EXPECT_EQ(code(RunF32(z, n, v, y, {1.0f, -0.5f}, 2.0)), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(RunF32(z, n, v, y, {1.0f, -0.5f}, 2.0).message()),
              HasSubstr("token weight -0.5 at row 1"));
  EXPECT_EQ(code(RunF32(z, n, v, y, {kNaN, 1.0f}, 2.0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(RunF32(z, n, v, y, {kInf, 1.0f}, 2.0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(RunF32(z, n, v, y, {1.0f}, 2.0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(RunF32(z, n, v, {0}, {}, 2.0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(RunF32(z, n, v, y, {}, -1.0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(RunF32(z, n, v, y, {}, std::nan(""))), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(RunF32(z, n, v, y, {}, INFINITY)), absl::StatusCode::kInvalidArgument);
  // D = 1 while this call alone holds weight 2: a local D was passed.
  absl::Status local_d = RunF32(z, n, v, y, {}, 1.0);
  EXPECT_EQ(local_d.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(local_d.message()), HasSubstr("D = 1"));
  EXPECT_EQ(code(RunF32(z, n, v, y, {}, 0.0)), absl::StatusCode::kFailedPrecondition);
}

TEST(CrossEntropyErrorsTest, BadViews) {
  std::vector<float> z(12), g(12);
  std::vector<uint16_t> gh(12);
  const std::vector<int64_t> y = {0, 1, 2};
  auto v3 = *TensorView::Create(z.data(), DType::kF32, {3, 2, 2});
  EXPECT_EQ(CrossEntropyForward(v3, y, {}, 3.0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto f16 = *TensorView::Create(gh.data(), DType::kF16, {3, 4});
  EXPECT_EQ(CrossEntropyForward(f16, y, {}, 3.0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto cuda = *TensorView::Create(z.data(), DType::kF32, {3, 4}, DeviceRef{Device::kCuda, 0});
  EXPECT_EQ(CrossEntropyForward(cuda, y, {}, 3.0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto zv = View(z.data(), DType::kF32, 3, 4);
  EXPECT_EQ(CrossEntropyForwardBackward(zv, y, {}, 3.0, View(gh.data(), DType::kBF16, 3, 4))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CrossEntropyForwardBackward(zv, y, {}, 3.0, View(g.data(), DType::kF32, 4, 3))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  auto no_vocab = *TensorView::Create(z.data(), DType::kF32, {3, 0});
  EXPECT_EQ(CrossEntropyForward(no_vocab, {-100, -100, -100}, {}, 0.0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CrossEntropyErrorsTest, NonFiniteRowsAreReportedWithTheirRow) {
  const int64_t n = 4, v = 2000;
  struct Case {
    std::vector<int64_t> positions;  // within row 2
    float value;
    int64_t label;
    const char* text;
  };
  const std::vector<Case> cases = {
      {{1500}, kNaN, 3, "row 2 (label 3) contains NaN"},
      {{7}, kInf, 3, "row 2 (label 3) contains +inf"},
      {{}, -kInf, 3, "row 2 (label 3) is all -inf"},
      {{5}, -kInf, 5, "row 2 (label 5) has a -inf target logit"},
  };
  for (const Case& c : cases) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      std::vector<float> z = RandomLogits(n, v, 15);
      if (c.positions.empty()) {
        for (int64_t j = 0; j < v; ++j) z[2 * v + j] = c.value;
      }
      for (int64_t p : c.positions) z[2 * v + p] = c.value;
      const std::vector<int64_t> y = {0, 1, c.label, 2};
      absl::Status s;
      if (dt == DType::kF32) {
        s = RunF32(z, n, v, y, {}, 4.0);
      } else {
        std::vector<uint16_t> zb(z.size()), gb(z.size());
        for (size_t i = 0; i < z.size(); ++i) zb[i] = BF16::FromFloat(z[i]).bits;
        s = CrossEntropyForwardBackward(View(zb.data(), dt, n, v), y, {}, 4.0,
                                        View(gb.data(), dt, n, v))
                .status();
      }
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.text;
      EXPECT_THAT(std::string(s.message()), HasSubstr(c.text));
      // The same row with its label ignored is never read: no error.
      const std::vector<int64_t> y_ignored = {0, 1, -100, 2};
      if (dt == DType::kF32) {
        EXPECT_TRUE(RunF32(z, n, v, y_ignored, {}, 4.0).ok()) << c.text;
      }
    }
  }
}

}  // namespace
}  // namespace gradsum::losses
