#include "losses/linear_cross_entropy.h"

#include <cmath>
#include <cstdint>
#include <limits>
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

// Double-precision reference: logits = H W, the §3 loss, dH = dZ W^T, dW = H^T dZ.
struct Reference {
  double loss = 0.0;
  std::vector<double> grad_hidden, grad_head;
};

Reference ReferenceLinearCe(const std::vector<float>& h, const std::vector<float>& w, int64_t n,
                            int64_t dm, int64_t v, const std::vector<int64_t>& y,
                            const std::vector<float>& weights, double d) {
  Reference ref;
  ref.grad_hidden.assign(n * dm, 0.0);
  ref.grad_head.assign(dm * v, 0.0);
  std::vector<double> z(v), dz(v);
  for (int64_t t = 0; t < n; ++t) {
    const double wt = y[t] == -100 ? 0.0 : (weights.empty() ? 1.0 : weights[t]);
    if (wt == 0.0 || d == 0.0) continue;
    for (int64_t j = 0; j < v; ++j) {
      double acc = 0.0;
      for (int64_t k = 0; k < dm; ++k) acc += static_cast<double>(h[t * dm + k]) * w[k * v + j];
      z[j] = acc;
    }
    double mx = -INFINITY;
    for (double e : z) mx = std::max(mx, e);
    double s = 0.0;
    for (double e : z) s += std::exp(e - mx);
    const double lse = mx + std::log(s);
    ref.loss += wt * (lse - z[y[t]]) / d;
    for (int64_t j = 0; j < v; ++j) dz[j] = wt / d * (std::exp(z[j] - lse) - (j == y[t] ? 1 : 0));
    for (int64_t k = 0; k < dm; ++k) {
      double acc = 0.0;
      for (int64_t j = 0; j < v; ++j) acc += dz[j] * w[k * v + j];
      ref.grad_hidden[t * dm + k] = acc;
      for (int64_t j = 0; j < v; ++j) ref.grad_head[k * v + j] += h[t * dm + k] * dz[j];
    }
  }
  return ref;
}

struct Problem {
  int64_t n, dm, v;
  std::vector<float> h, w;
  std::vector<int64_t> y;
};

Problem MakeProblem(int64_t n, int64_t dm, int64_t v, uint32_t seed, double ignore_fraction) {
  Problem p{n, dm, v, RandomNormal(n * dm, seed, 1.0f), RandomNormal(dm * v, seed + 1, 0.5f), {}};
  std::mt19937 rng(seed + 2);
  std::uniform_int_distribution<int64_t> cls(0, v - 1);
  std::bernoulli_distribution ignore(ignore_fraction);
  for (int64_t t = 0; t < n; ++t) p.y.push_back(ignore(rng) ? -100 : cls(rng));
  return p;
}

TEST(LinearCrossEntropyTest, MatchesDoubleReferenceForEveryChunking) {
  Problem p = MakeProblem(29, 16, 301, 1, 0.2);
  std::vector<float> weights = RandomNormal(p.n, 4, 1.0f);
  for (float& e : weights) e = std::abs(e);
  double d = 0.0;
  for (int64_t t = 0; t < p.n; ++t) d += p.y[t] == -100 ? 0.0 : weights[t];
  d *= 1.5;  // other micro-batches hold the rest
  const Reference ref = ReferenceLinearCe(p.h, p.w, p.n, p.dm, p.v, p.y, weights, d);
  const std::vector<float> head_before = RandomNormal(p.dm * p.v, 5, 0.1f);
  for (int64_t chunk : {0, 1, 3, 7, 29, 100}) {
    std::vector<float> gh(p.n * p.dm, std::nanf("")), gw = head_before;
    LinearCrossEntropyOptions opt;
    opt.chunk_rows = chunk;
    auto r = LinearCrossEntropyForwardBackward(
        F32Matrix(p.h.data(), p.n, p.dm), F32Matrix(p.w.data(), p.dm, p.v), p.y, weights, d,
        F32Matrix(gh.data(), p.n, p.dm), F32Matrix(gw.data(), p.dm, p.v), opt);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->ce.local_loss, ref.loss, 1e-6 * ref.loss) << "chunk " << chunk;
    EXPECT_EQ(r->chunk_rows, chunk == 0 || chunk > p.n ? p.n : chunk);
    for (size_t i = 0; i < gh.size(); ++i) {
      ASSERT_NEAR(gh[i], ref.grad_hidden[i], 1e-5 * (1 + std::abs(ref.grad_hidden[i])))
          << "chunk " << chunk << " element " << i;
    }
    for (size_t i = 0; i < gw.size(); ++i) {
      ASSERT_NEAR(gw[i], head_before[i] + ref.grad_head[i], 1e-5) << "chunk " << chunk << " " << i;
    }
  }
}

// head_transposed: the head and its gradient stored [V, Dm] (torch.nn.Linear's layout).
TEST(LinearCrossEntropyTest, TransposedHeadMatchesDoubleReference) {
  Problem p = MakeProblem(37, 12, 173, 21, 0.2);
  double d = 0.0;
  for (int64_t t = 0; t < p.n; ++t) d += p.y[t] == -100 ? 0.0 : 1.0;
  const Reference ref = ReferenceLinearCe(p.h, p.w, p.n, p.dm, p.v, p.y, {}, d);
  std::vector<float> w_t(p.v * p.dm);  // [V, Dm]
  for (int64_t k = 0; k < p.dm; ++k) {
    for (int64_t j = 0; j < p.v; ++j) w_t[j * p.dm + k] = p.w[k * p.v + j];
  }
  for (int64_t chunk : {0, 5}) {
    std::vector<float> gh(p.n * p.dm, std::nanf("")), gw_t(p.v * p.dm, 0.5f);
    LinearCrossEntropyOptions opt;
    opt.chunk_rows = chunk;
    opt.head_transposed = true;
    auto r = LinearCrossEntropyForwardBackward(
        F32Matrix(p.h.data(), p.n, p.dm), F32Matrix(w_t.data(), p.v, p.dm), p.y, {}, d,
        F32Matrix(gh.data(), p.n, p.dm), F32Matrix(gw_t.data(), p.v, p.dm), opt);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->ce.local_loss, ref.loss, 1e-6 * ref.loss) << "chunk " << chunk;
    for (size_t i = 0; i < gh.size(); ++i) {
      ASSERT_NEAR(gh[i], ref.grad_hidden[i], 1e-5 * (1 + std::abs(ref.grad_hidden[i])))
          << "chunk " << chunk << " element " << i;
    }
    for (int64_t k = 0; k < p.dm; ++k) {
      for (int64_t j = 0; j < p.v; ++j) {
        ASSERT_NEAR(gw_t[j * p.dm + k], 0.5 + ref.grad_head[k * p.v + j], 1e-5)
            << "chunk " << chunk << " head row " << j << " col " << k;
      }
    }
  }
  // The [Dm, V] shapes are refused in this layout (unless Dm == V), naming the layout.
  std::vector<float> gh(p.n * p.dm), gw(p.dm * p.v);
  LinearCrossEntropyOptions opt;
  opt.head_transposed = true;
  absl::Status s = LinearCrossEntropyForwardBackward(
                       F32Matrix(p.h.data(), p.n, p.dm), F32Matrix(p.w.data(), p.dm, p.v), p.y, {},
                       d, F32Matrix(gh.data(), p.n, p.dm), F32Matrix(gw.data(), p.dm, p.v), opt)
                       .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("transposed"));
}

TEST(LinearCrossEntropyTest, GradientsMatchCentralFiniteDifferences) {
  Problem p = MakeProblem(6, 5, 9, 7, 0.0);
  p.y[2] = -100;
  const double d = 5.0;
  std::vector<float> gh(p.n * p.dm), gw(p.dm * p.v, 0.0f);
  LinearCrossEntropyOptions opt;
  opt.chunk_rows = 4;
  auto r = LinearCrossEntropyForwardBackward(
      F32Matrix(p.h.data(), p.n, p.dm), F32Matrix(p.w.data(), p.dm, p.v), p.y, {}, d,
      F32Matrix(gh.data(), p.n, p.dm), F32Matrix(gw.data(), p.dm, p.v), opt);
  ASSERT_TRUE(r.ok()) << r.status();
  auto loss = [&](const std::vector<float>& h, const std::vector<float>& w) {
    std::vector<float> sh(h.size()), sw(w.size(), 0.0f);
    std::vector<float> hc = h, wc = w;
    auto l = LinearCrossEntropyForwardBackward(
        F32Matrix(hc.data(), p.n, p.dm), F32Matrix(wc.data(), p.dm, p.v), p.y, {}, d,
        F32Matrix(sh.data(), p.n, p.dm), F32Matrix(sw.data(), p.dm, p.v), opt);
    EXPECT_TRUE(l.ok());
    return l->ce.local_loss;
  };
  const float eps = 1e-2f;
  for (size_t i = 0; i < p.h.size(); ++i) {
    std::vector<float> hp = p.h, hm = p.h;
    hp[i] += eps;
    hm[i] -= eps;
    const double fd = (loss(hp, p.w) - loss(hm, p.w)) / (static_cast<double>(hp[i]) - hm[i]);
    EXPECT_NEAR(gh[i], fd, 2e-4) << "hidden " << i;
  }
  for (size_t i = 0; i < p.w.size(); ++i) {
    std::vector<float> wp = p.w, wm = p.w;
    wp[i] += eps;
    wm[i] -= eps;
    const double fd = (loss(p.h, wp) - loss(p.h, wm)) / (static_cast<double>(wp[i]) - wm[i]);
    EXPECT_NEAR(gw[i], fd, 2e-4) << "head " << i;
  }
}

TEST(LinearCrossEntropyTest, InPlaceHiddenGradientEqualsOutOfPlace) {
  Problem p = MakeProblem(40, 12, 77, 11, 0.1);
  LinearCrossEntropyOptions opt;
  opt.chunk_rows = 9;
  std::vector<float> gh(p.n * p.dm), gw1(p.dm * p.v, 0.0f), gw2(p.dm * p.v, 0.0f);
  auto a = LinearCrossEntropyForwardBackward(
      F32Matrix(p.h.data(), p.n, p.dm), F32Matrix(p.w.data(), p.dm, p.v), p.y, {}, 40.0,
      F32Matrix(gh.data(), p.n, p.dm), F32Matrix(gw1.data(), p.dm, p.v), opt);
  ASSERT_TRUE(a.ok());
  std::vector<float> h = p.h;
  auto b = LinearCrossEntropyForwardBackward(
      F32Matrix(h.data(), p.n, p.dm), F32Matrix(p.w.data(), p.dm, p.v), p.y, {}, 40.0,
      F32Matrix(h.data(), p.n, p.dm), F32Matrix(gw2.data(), p.dm, p.v), opt);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(h, gh);
  EXPECT_EQ(gw1, gw2);
  EXPECT_EQ(a->ce.local_loss, b->ce.local_loss);
}

TEST(LinearCrossEntropyTest, AllIgnoredGivesZerosAndLeavesHeadGradientAlone) {
  Problem p = MakeProblem(10, 4, 13, 13, 0.0);
  const std::vector<int64_t> y(p.n, -100);
  std::vector<float> gh(p.n * p.dm, 7.0f), gw(p.dm * p.v, 3.0f);
  auto r = LinearCrossEntropyForwardBackward(
      F32Matrix(p.h.data(), p.n, p.dm), F32Matrix(p.w.data(), p.dm, p.v), y, {}, 0.0,
      F32Matrix(gh.data(), p.n, p.dm), F32Matrix(gw.data(), p.dm, p.v));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ce.local_loss, 0.0);
  EXPECT_EQ(r->peak_scratch_bytes, 0);
  for (float g : gh) EXPECT_EQ(g, 0.0f);
  for (float g : gw) EXPECT_EQ(g, 3.0f);
  // A rank with no valid tokens while D > 0 elsewhere: the same zeros.
  auto r2 = LinearCrossEntropyForwardBackward(
      F32Matrix(p.h.data(), p.n, p.dm), F32Matrix(p.w.data(), p.dm, p.v), y, {}, 17.0,
      F32Matrix(gh.data(), p.n, p.dm), F32Matrix(gw.data(), p.dm, p.v));
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->ce.local_loss, 0.0);
  for (float g : gh) EXPECT_EQ(g, 0.0f);
}

TEST(LinearCrossEntropyTest, ScratchIsOneChunkOfLogits) {
  Problem p = MakeProblem(64, 8, 50, 17, 0.0);
  LinearCrossEntropyOptions opt;
  opt.chunk_rows = 16;
  std::vector<float> gh(p.n * p.dm), gw(p.dm * p.v, 0.0f);
  auto r = LinearCrossEntropyForwardBackward(
      F32Matrix(p.h.data(), p.n, p.dm), F32Matrix(p.w.data(), p.dm, p.v), p.y, {}, 64.0,
      F32Matrix(gh.data(), p.n, p.dm), F32Matrix(gw.data(), p.dm, p.v), opt);
  ASSERT_TRUE(r.ok());
  const int64_t full_logits_bytes = p.n * p.v * 4;
  EXPECT_GE(r->peak_scratch_bytes, 16 * p.v * 4);
  EXPECT_LE(r->peak_scratch_bytes * 3, full_logits_bytes);  // a quarter plus row scratch
}

TEST(LinearCrossEntropyErrorsTest, ArgumentsAreChecked) {
  Problem p = MakeProblem(8, 4, 6, 19, 0.0);
  std::vector<float> gh(p.n * p.dm), gw(p.dm * p.v);
  auto run = [&](const TensorView& h, const TensorView& w, const TensorView& g_h,
                 const TensorView& g_w, const std::vector<int64_t>& y,
                 LinearCrossEntropyOptions opt = {}) {
    return LinearCrossEntropyForwardBackward(h, w, y, {}, 8.0, g_h, g_w, opt).status();
  };
  const TensorView h = F32Matrix(p.h.data(), p.n, p.dm), w = F32Matrix(p.w.data(), p.dm, p.v);
  const TensorView g_h = F32Matrix(gh.data(), p.n, p.dm), g_w = F32Matrix(gw.data(), p.dm, p.v);
  ASSERT_TRUE(run(h, w, g_h, g_w, p.y).ok());
  std::vector<uint16_t> bf(p.n * p.dm);
  auto h_bf16 = *TensorView::Create(bf.data(), DType::kBF16, {p.n, p.dm});
  EXPECT_EQ(run(h_bf16, w, g_h, g_w, p.y).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(h, F32Matrix(p.w.data(), p.dm - 1, p.v), g_h, g_w, p.y).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(h, w, F32Matrix(gh.data(), p.n - 1, p.dm), g_w, p.y).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(h, w, g_h, F32Matrix(gw.data(), p.dm, p.v - 1), p.y).code(),
            absl::StatusCode::kInvalidArgument);
  // grad_head overlapping hidden; grad_hidden overlapping head.
  EXPECT_EQ(run(h, w, g_h, F32Matrix(p.h.data(), p.dm, p.v), p.y).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(h, w, F32Matrix(p.w.data() + 1, p.n, 2), g_w, p.y).code(),
            absl::StatusCode::kInvalidArgument);
  LinearCrossEntropyOptions neg;
  neg.chunk_rows = -1;
  EXPECT_EQ(run(h, w, g_h, g_w, p.y, neg).code(), absl::StatusCode::kInvalidArgument);
  // A bad label in the third chunk is named by its row in [0, N), before anything is written.
  std::vector<int64_t> bad = p.y;
  bad[5] = 6;
  LinearCrossEntropyOptions small;
  small.chunk_rows = 2;
  std::fill(gw.begin(), gw.end(), 1.0f);
  absl::Status s = run(h, w, g_h, g_w, bad, small);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("label 6 at row 5"));
  for (float g : gw) EXPECT_EQ(g, 1.0f);
  // A NaN hidden row makes a NaN logits row, reported with its row in [0, N).
  std::vector<float> hn = p.h;
  hn[6 * p.dm + 1] = std::numeric_limits<float>::quiet_NaN();
  s = run(F32Matrix(hn.data(), p.n, p.dm), w, g_h, g_w, p.y, small);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("row 6"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("NaN"));
  // A local D.
  EXPECT_EQ(LinearCrossEntropyForwardBackward(h, w, p.y, {}, 1.0, g_h, g_w).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace gradsum::losses
