#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "core/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/reference.h"
#include "moe/test_util.h"

namespace gradsum::moe {
namespace {

using ::testing::HasSubstr;

reference::LayerConfig RefConfig(const RouterConfig& c) {
  reference::LayerConfig r;
  r.d_model = static_cast<int>(c.d_model);
  r.num_experts = c.num_experts;
  r.top_k = c.top_k;
  r.norm_topk_prob = c.norm_topk_prob;
  r.router_scale = c.router_scale;
  return r;
}

// (norm_topk_prob, router_scale, top_k)
class RouterParamTest : public ::testing::TestWithParam<std::tuple<bool, float, int>> {
 protected:
  RouterConfig Config() const {
    RouterConfig c;
    c.d_model = 8;
    c.num_experts = 6;
    c.norm_topk_prob = std::get<0>(GetParam());
    c.router_scale = std::get<1>(GetParam());
    c.top_k = std::get<2>(GetParam());
    return c;
  }
};

TEST_P(RouterParamTest, ForwardMatchesDoubleReference) {
  const RouterConfig config = Config();
  const int T = 13, D = 8, E = 6, K = config.top_k;
  const std::vector<double> a = test::RandomFp32Values(T * D, 1.0, 1);
  const std::vector<double> wr = test::RandomFp32Values(D * E, 1.0, 2);
  std::vector<uint8_t> mask(T, 1);
  mask[3] = mask[10] = 0;

  absl::StatusOr<RouterOutput> out =
      RouterForward(config, test::ToFloat(a), test::ToFloat(wr), mask);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->num_tokens, T);
  EXPECT_EQ(out->local_routed_tokens, T - 2);

  const reference::LayerConfig rc = RefConfig(config);
  std::vector<int64_t> counts(E, 0);
  std::vector<double> gating(E, 0.0);
  for (int t = 0; t < T; ++t) {
    if (!mask[t]) {
      for (int e = 0; e < E; ++e) {
        EXPECT_EQ(out->logits[t * E + e], 0.0f);
        EXPECT_EQ(out->probs[t * E + e], 0.0f);
      }
      for (int k = 0; k < K; ++k) {
        EXPECT_EQ(out->expert_index[t * K + k], -1);
        EXPECT_EQ(out->combine_weight[t * K + k], 0.0f);
      }
      EXPECT_EQ(out->routed[t], 0);
      continue;
    }
    EXPECT_EQ(out->routed[t], 1);
    reference::TokenRoute r = reference::RouteToken(rc, &a[t * D], wr);
    for (int e = 0; e < E; ++e) {
      EXPECT_NEAR(out->logits[t * E + e], r.logits[e], 1e-5) << "t=" << t << " e=" << e;
      EXPECT_NEAR(out->probs[t * E + e], r.probs[e], 1e-6) << "t=" << t << " e=" << e;
      gating[e] += r.probs[e];
    }
    for (int k = 0; k < K; ++k) {
      EXPECT_EQ(out->expert_index[t * K + k], r.experts[k]) << "t=" << t << " k=" << k;
      EXPECT_NEAR(out->combine_weight[t * K + k], r.weights[k], 1e-6) << "t=" << t << " k=" << k;
      ++counts[r.experts[k]];
    }
  }
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(out->local_expert_counts[e], counts[e]) << "e=" << e;
    EXPECT_NEAR(out->local_gating_sums[e], gating[e], 1e-5) << "e=" << e;
  }
}

// Loss used for the backward checks: a fixed linear function of every router output, so
// each gradient path (combine weights, probabilities, gating sums, logits) is exercised.
struct LossCoefficients {
  std::vector<double> cw;  // [T, K]
  std::vector<double> cp;  // [T, E]
  std::vector<double> cg;  // [E]
  std::vector<double> cu;  // [T, E]
};

double ReferenceLoss(const reference::LayerConfig& rc, const std::vector<double>& a,
                     const std::vector<double>& wr, const std::vector<uint8_t>& mask,
                     const LossCoefficients& c) {
  const int D = rc.d_model, E = rc.num_experts, K = rc.top_k;
  const int T = static_cast<int>(a.size()) / D;
  double loss = 0.0;
  for (int t = 0; t < T; ++t) {
    if (!mask[t]) continue;
    reference::TokenRoute r = reference::RouteToken(rc, &a[t * D], wr);
    for (int k = 0; k < K; ++k) loss += c.cw[t * K + k] * r.weights[k];
    for (int e = 0; e < E; ++e) {
      loss += c.cp[t * E + e] * r.probs[e] + c.cg[e] * r.probs[e] + c.cu[t * E + e] * r.logits[e];
    }
  }
  return loss;
}

TEST_P(RouterParamTest, BackwardMatchesFiniteDifferencesOfReference) {
  const RouterConfig config = Config();
  const int T = 9, D = 8, E = 6, K = config.top_k;
  std::vector<double> a = test::RandomFp32Values(T * D, 1.0, 11);
  std::vector<double> wr = test::RandomFp32Values(D * E, 1.0, 12);
  std::vector<uint8_t> mask(T, 1);
  mask[4] = 0;
  LossCoefficients c{test::RandomFp32Values(T * K, 1.0, 13), test::RandomFp32Values(T * E, 1.0, 14),
                     test::RandomFp32Values(E, 1.0, 15), test::RandomFp32Values(T * E, 0.3, 16)};

  absl::StatusOr<RouterOutput> out =
      RouterForward(config, test::ToFloat(a), test::ToFloat(wr), mask);
  ASSERT_TRUE(out.ok()) << out.status();
  const std::vector<float> cw = test::ToFloat(c.cw), cp = test::ToFloat(c.cp),
                           cu = test::ToFloat(c.cu);
  RouterOutputGrads grads;
  grads.d_combine_weight = cw;
  grads.d_probs = cp;
  grads.d_gating_sums = c.cg;
  grads.d_logits = cu;
  // Start from non-zero buffers: the gradients must be added, not written.
  const std::vector<double> dwr0 = test::RandomFp32Values(D * E, 1.0, 17);
  const std::vector<double> da0 = test::RandomFp32Values(T * D, 1.0, 18);
  std::vector<float> dwr = test::ToFloat(dwr0), da = test::ToFloat(da0);
  ASSERT_TRUE(RouterBackward(config, test::ToFloat(a), test::ToFloat(wr), *out, grads,
                             absl::MakeSpan(dwr), absl::MakeSpan(da))
                  .ok());

  const reference::LayerConfig rc = RefConfig(config);
  auto loss = [&] { return ReferenceLoss(rc, a, wr, mask, c); };
  for (int i = 0; i < D * E; ++i) {
    const double fd = reference::CentralDifference(loss, &wr[i], 1e-6);
    EXPECT_NEAR(dwr[i] - dwr0[i], fd, 2e-4 * (1.0 + std::abs(fd))) << "dWr[" << i << "]";
  }
  for (int i = 0; i < T * D; ++i) {
    const double fd = reference::CentralDifference(loss, &a[i], 1e-6);
    EXPECT_NEAR(da[i] - da0[i], fd, 2e-4 * (1.0 + std::abs(fd))) << "da[" << i << "]";
    if (!mask[i / D]) {
      EXPECT_EQ(da[i], static_cast<float>(da0[i])) << "padding row touched";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, RouterParamTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(1.0f, 2.5f),
                                            ::testing::Values(1, 2, 6)));

// Central differences of the fp32 code itself (the loss evaluated from RouterForward's
// combine weights and probabilities, with `bias` for the selection) against its own
// RouterBackward: T = 6 tokens, D = 5, E = 4, K = 2.
void ExpectBackwardMatchesFiniteDifferencesOfFp32Forward(const RouterConfig& config,
                                                         absl::Span<const float> bias,
                                                         uint32_t seed) {
  const int T = 6, D = 5, E = 4, K = 2;
  std::vector<float> a = test::ToFloat(test::RandomFp32Values(T * D, 1.0, seed));
  std::vector<float> wr = test::ToFloat(test::RandomFp32Values(D * E, 1.0, seed + 1));
  const std::vector<double> cw = test::RandomFp32Values(T * K, 1.0, seed + 2);
  const std::vector<double> cp = test::RandomFp32Values(T * E, 1.0, seed + 3);
  auto loss = [&]() {
    absl::StatusOr<RouterOutput> o = RouterForward(config, a, wr, {}, bias);
    double l = 0.0;
    for (int i = 0; i < T * K; ++i) l += cw[i] * o->combine_weight[i];
    for (int i = 0; i < T * E; ++i) l += cp[i] * o->probs[i];
    return l;
  };
  absl::StatusOr<RouterOutput> out = RouterForward(config, a, wr, {}, bias);
  ASSERT_TRUE(out.ok());
  const std::vector<float> cwf = test::ToFloat(cw), cpf = test::ToFloat(cp);
  RouterOutputGrads grads;
  grads.d_combine_weight = cwf;
  grads.d_probs = cpf;
  std::vector<float> dwr(D * E, 0.0f), da(T * D, 0.0f);
  ASSERT_TRUE(
      RouterBackward(config, a, wr, *out, grads, absl::MakeSpan(dwr), absl::MakeSpan(da)).ok());
  const float h = 1e-2f;
  auto fd = [&](float* x) {
    const float saved = *x;
    *x = saved + h;
    const double plus = loss();
    *x = saved - h;
    const double minus = loss();
    *x = saved;
    return (plus - minus) / (2.0 * h);
  };
  for (int i = 0; i < D * E; ++i) EXPECT_NEAR(dwr[i], fd(&wr[i]), 3e-3) << "dWr[" << i << "]";
  for (int i = 0; i < T * D; ++i) EXPECT_NEAR(da[i], fd(&a[i]), 3e-3) << "da[" << i << "]";
}

// Softmax scores: only the combine-weight and probability paths, with renormalisation.
TEST(RouterTest, BackwardMatchesFiniteDifferencesOfFp32Forward) {
  ExpectBackwardMatchesFiniteDifferencesOfFp32Forward(
      {.d_model = 5, .num_experts = 4, .top_k = 2, .norm_topk_prob = true, .router_scale = 1.5f},
      {}, 21);
}

// Reproducible mode (RouterConfig::row_block): the logits, the input gradient and each
// block's router-weight contribution of a block are the bits of that block run alone,
// whatever the other blocks and the thread count; the contributions sum to the normal
// mode's gradient.
TEST(RouterTest, RowBlocksComputeEachBlockAsIfAlone) {
  class Recording : public ExactGradSink {
   public:
    absl::Status Add(int64_t offset, absl::Span<const float> c) override {
      EXPECT_EQ(offset, 0);
      adds.emplace_back(c.begin(), c.end());
      return absl::OkStatus();
    }
    std::vector<std::vector<float>> adds;
  };
  const int S = 37, blocks = 3, T = S * blocks, D = 48, E = 8, K = 2;
  RouterConfig config{.d_model = D, .num_experts = E, .top_k = K, .norm_topk_prob = true};
  RouterConfig blocked = config;
  blocked.row_block = S;
  const std::vector<float> a = test::ToFloat(test::RandomFp32Values(T * D, 1.0, 31));
  const std::vector<float> wr = test::ToFloat(test::RandomFp32Values(D * E, 0.5, 32));
  const std::vector<float> cw = test::ToFloat(test::RandomFp32Values(T * K, 1.0, 33));
  std::vector<uint8_t> mask(T, 1);
  mask[5] = mask[S + 1] = 0;
  auto run = [&](const RouterConfig& c, int64_t r0, int64_t rows, int threads,
                 std::vector<float>* logits, std::vector<float>* da, Recording* sink,
                 std::vector<float>* dwr) {
    ScopedComputeThreads budget(threads);
    const auto ab = absl::MakeConstSpan(a).subspan(r0 * D, rows * D);
    absl::StatusOr<RouterOutput> out =
        RouterForward(c, ab, wr, absl::MakeConstSpan(mask).subspan(r0, rows));
    ASSERT_TRUE(out.ok()) << out.status();
    *logits = out->logits;
    RouterOutputGrads g;
    g.d_combine_weight = absl::MakeConstSpan(cw).subspan(r0 * K, rows * K);
    da->assign(rows * D, 0.0f);
    ASSERT_TRUE(
        RouterBackward(c, ab, wr, *out, g, absl::MakeSpan(*dwr), absl::MakeSpan(*da), sink).ok());
  };
  std::vector<float> logits, da, unused;
  Recording sink;
  run(blocked, 0, T, 2, &logits, &da, &sink, &unused);
  ASSERT_EQ(sink.adds.size(), static_cast<size_t>(blocks));
  std::vector<double> sum(D * E, 0.0);
  for (int b = 0; b < blocks; ++b) {
    std::vector<float> lb, dab;
    Recording alone;
    run(config, b * S, S, 1, &lb, &dab, &alone, &unused);
    ASSERT_EQ(alone.adds.size(), 1u);
    EXPECT_EQ(alone.adds[0], sink.adds[b]) << "block " << b;
    for (int i = 0; i < S * E; ++i) ASSERT_EQ(lb[i], logits[b * S * E + i]) << "block " << b;
    for (int i = 0; i < S * D; ++i) ASSERT_EQ(dab[i], da[b * S * D + i]) << "block " << b;
    for (int i = 0; i < D * E; ++i) sum[i] += sink.adds[b][i];
  }
  std::vector<float> l2, da2, dwr(D * E, 0.0f);
  run(config, 0, T, 1, &l2, &da2, nullptr, &dwr);
  for (int i = 0; i < D * E; ++i) EXPECT_NEAR(sum[i], dwr[i], 1e-5 * (1 + std::abs(dwr[i]))) << i;
}

TEST(RouterTest, TiesGoToTheLowerExpertIndex) {
  const int D = 3, E = 5, T = 2;
  std::vector<float> a = {1.0f, 0.5f, 0.25f, 0.5f, 1.0f, 2.0f};
  {
    // Wr = 0: every probability is 1/E, so the top-K are experts 0..K-1 in order.
    RouterConfig config{.d_model = D, .num_experts = E, .top_k = 3};
    std::vector<float> wr(D * E, 0.0f);
    absl::StatusOr<RouterOutput> out = RouterForward(config, a, wr);
    ASSERT_TRUE(out.ok());
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < 3; ++k) {
        EXPECT_EQ(out->expert_index[t * 3 + k], k);
        EXPECT_FLOAT_EQ(out->combine_weight[t * 3 + k], 1.0f / E);
      }
    }
  }
  {
    // Columns 4 and 1 are equal and largest, columns 3 and 2 equal and next: 1, 4, 2 in order.
    RouterConfig config{.d_model = D, .num_experts = E, .top_k = 3, .norm_topk_prob = true};
    std::vector<float> wr(D * E, 0.0f);
    for (int d = 0; d < D; ++d) {
      wr[d * E + 1] = wr[d * E + 4] = 1.0f;
      wr[d * E + 2] = wr[d * E + 3] = 0.5f;
    }
    absl::StatusOr<RouterOutput> out = RouterForward(config, a, wr);
    ASSERT_TRUE(out.ok());
    for (int t = 0; t < T; ++t) {
      EXPECT_EQ(out->expert_index[t * 3 + 0], 1);
      EXPECT_EQ(out->expert_index[t * 3 + 1], 4);
      EXPECT_EQ(out->expert_index[t * 3 + 2], 2);
      EXPECT_FLOAT_EQ(out->combine_weight[t * 3 + 0], out->combine_weight[t * 3 + 1]);
    }
  }
}

TEST(RouterTest, AllPaddingAndEmptyInputRouteNothing) {
  RouterConfig config{.d_model = 2, .num_experts = 3, .top_k = 2};
  std::vector<float> wr(6, 0.5f), a = {1, 2, 3, 4};
  std::vector<uint8_t> mask = {0, 0};
  absl::StatusOr<RouterOutput> out = RouterForward(config, a, wr, mask);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->local_routed_tokens, 0);
  for (int e = 0; e < 3; ++e) {
    EXPECT_EQ(out->local_expert_counts[e], 0);
    EXPECT_EQ(out->local_gating_sums[e], 0.0);
  }
  absl::StatusOr<RouterOutput> empty = RouterForward(config, {}, wr);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->num_tokens, 0);
  std::vector<float> dwr(6, 0.0f);
  EXPECT_TRUE(RouterBackward(config, {}, wr, *empty, {}, absl::MakeSpan(dwr), {}).ok());
}

TEST(RouterTest, BadConfigsAreInvalidArgument) {
  std::vector<float> a(8, 1.0f), wr(8, 0.0f);
  struct Case {
    RouterConfig config;
    std::string message;
  };
  const Case cases[] = {
      {{.d_model = 2, .num_experts = 4, .top_k = 5}, "K=5"},
      {{.d_model = 2, .num_experts = 4, .top_k = 0}, "K=0"},
      {{.d_model = 2, .num_experts = 0, .top_k = 1}, "E=0"},
      {{.d_model = 0, .num_experts = 4, .top_k = 1}, "D=0"},
      {{.d_model = 2,
        .num_experts = 4,
        .top_k = 1,
        .router_scale = std::numeric_limits<float>::infinity()},
       "router_scale"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<RouterOutput> out = RouterForward(c.config, a, wr);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(out.status().message(), HasSubstr(c.message));
  }
}

TEST(RouterTest, BadShapesAndValuesAreInvalidArgument) {
  RouterConfig config{.d_model = 2, .num_experts = 4, .top_k = 2};
  std::vector<float> a(6, 1.0f), wr(8, 0.1f);
  auto status_of = [&](absl::Span<const float> aa, absl::Span<const float> ww,
                       absl::Span<const uint8_t> m) {
    return RouterForward(config, aa, ww, m).status();
  };
  EXPECT_THAT(status_of(std::vector<float>(5, 1.0f), wr, {}).message(),
              HasSubstr("not a multiple of D=2"));
  EXPECT_THAT(status_of(a, std::vector<float>(7, 0.0f), {}).message(), HasSubstr("Wr has 7"));
  EXPECT_THAT(status_of(a, wr, std::vector<uint8_t>(2, 1)).message(), HasSubstr("mask has 2"));
  EXPECT_THAT(status_of(a, wr, std::vector<uint8_t>{1, 2, 1}).message(), HasSubstr("mask[1] is 2"));
  std::vector<float> nan_a = a;
  nan_a[3] = std::numeric_limits<float>::quiet_NaN();
  absl::Status nan_status = status_of(nan_a, wr, {});
  EXPECT_EQ(nan_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(nan_status.message(), HasSubstr("token 1"));

  absl::StatusOr<RouterOutput> out = RouterForward(config, a, wr);
  ASSERT_TRUE(out.ok());
  std::vector<float> dwr(8), da(6), bad(5);
  RouterOutputGrads g;
  g.d_combine_weight = bad;
  absl::Status s = RouterBackward(config, a, wr, *out, g, absl::MakeSpan(dwr), absl::MakeSpan(da));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("d_combine_weight has 5"));
  g = {};
  EXPECT_THAT(
      RouterBackward(config, a, wr, *out, g, absl::MakeSpan(bad), absl::MakeSpan(da)).message(),
      HasSubstr("d_router_weight has 5"));
  EXPECT_THAT(
      RouterBackward(config, a, wr, *out, g, absl::MakeSpan(dwr), absl::MakeSpan(bad)).message(),
      HasSubstr("d_a has 5"));
  // A forward output from other inputs.
  EXPECT_THAT(RouterBackward(config, std::vector<float>(4, 1.0f), wr, *out, g, absl::MakeSpan(dwr),
                             absl::MakeSpan(da))
                  .message(),
              HasSubstr("does not match"));
}

}  // namespace

// ---- The expert bias and sigmoid scores (SEMANTICS.md §5.1). ----

// An independent double-precision router: scores (softmax or sigmoid) of u = a Wr, the
// top-K of score + bias (stable: lower index first on equal keys), weights of the UNBIASED
// scores.
struct BiasedRoute {
  std::vector<int> experts;     // [T, K]
  std::vector<double> weights;  // [T, K]
  std::vector<double> scores;   // [T, E]
};
BiasedRoute ReferenceBiasedRoute(int T, int D, int E, int K, bool sigmoid, bool norm, double scale,
                                 const std::vector<double>& a, const std::vector<double>& wr,
                                 const std::vector<double>& bias) {
  BiasedRoute r;
  for (int t = 0; t < T; ++t) {
    std::vector<double> u(E, 0.0), s(E), key(E);
    for (int d = 0; d < D; ++d) {
      for (int e = 0; e < E; ++e) u[e] += a[t * D + d] * wr[d * E + e];
    }
    double mx = u[0], z = 0.0;
    for (double v : u) mx = std::max(mx, v);
    for (int e = 0; e < E; ++e) z += std::exp(u[e] - mx);
    for (int e = 0; e < E; ++e) {
      s[e] = sigmoid ? 1.0 / (1.0 + std::exp(-u[e])) : std::exp(u[e] - mx) / z;
      key[e] = s[e] + (bias.empty() ? 0.0 : bias[e]);
      r.scores.push_back(s[e]);
    }
    std::vector<int> order(E);
    for (int e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return key[x] > key[y]; });
    double sum = 0.0;
    for (int k = 0; k < K; ++k) sum += s[order[k]];
    for (int k = 0; k < K; ++k) {
      r.experts.push_back(order[k]);
      r.weights.push_back(s[order[k]] / (norm ? sum : 1.0) * scale);
    }
  }
  return r;
}

// (sigmoid scores, norm_topk_prob)
class RouterBiasTest : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(RouterBiasTest, BiasMovesTheSelectionAndTheWeightsStayUnbiased) {
  const auto [sigmoid, norm] = GetParam();
  const int T = 40, D = 8, E = 6, K = 2;
  RouterConfig config{.d_model = D,
                      .num_experts = E,
                      .top_k = K,
                      .norm_topk_prob = norm,
                      .router_scale = 1.5f,
                      .score = sigmoid ? RouterScore::kSigmoid : RouterScore::kSoftmax};
  const std::vector<double> a = test::RandomFp32Values(T * D, 1.0, 31);
  const std::vector<double> wr = test::RandomFp32Values(D * E, 1.0, 32);
  // Expert 5 pushed up hard, expert 0 pushed down hard, the rest small nudges.
  const std::vector<double> bias = {-4.0, 0.015625, -0.03125, 0.0, 0.0625, 4.0};
  absl::StatusOr<RouterOutput> out =
      RouterForward(config, test::ToFloat(a), test::ToFloat(wr), {}, test::ToFloat(bias));
  ASSERT_TRUE(out.ok()) << out.status();
  const BiasedRoute ref = ReferenceBiasedRoute(T, D, E, K, sigmoid, norm, 1.5, a, wr, bias);
  const BiasedRoute unbiased = ReferenceBiasedRoute(T, D, E, K, sigmoid, norm, 1.5, a, wr, {});
  std::vector<int64_t> counts(E, 0);
  int moved = 0;
  for (int t = 0; t < T; ++t) {
    EXPECT_EQ(out->expert_index[t * K], 5) << "token " << t;  // the +4 bias wins every token
    for (int k = 0; k < K; ++k) {
      EXPECT_EQ(out->expert_index[t * K + k], ref.experts[t * K + k]) << "token " << t;
      EXPECT_NE(out->expert_index[t * K + k], 0) << "token " << t;
      EXPECT_NEAR(out->combine_weight[t * K + k], ref.weights[t * K + k], 1e-6) << "token " << t;
      ++counts[ref.experts[t * K + k]];
      moved += ref.experts[t * K + k] != unbiased.experts[t * K + k];
    }
    for (int e = 0; e < E; ++e) {
      EXPECT_NEAR(out->probs[t * E + e], ref.scores[t * E + e], 1e-6);  // unbiased scores
    }
  }
  EXPECT_GT(moved, 0) << "the bias changed no selection; the test proves nothing";
  for (int e = 0; e < E; ++e) EXPECT_EQ(out->local_expert_counts[e], counts[e]) << e;
}

INSTANTIATE_TEST_SUITE_P(Scores, RouterBiasTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

// No bias and a bias of zeros route the same bits (u = 0 leaves today's results).
TEST(RouterTest, ZeroBiasIsBitIdenticalToNoBias) {
  RouterConfig config{.d_model = 8, .num_experts = 6, .top_k = 2, .norm_topk_prob = true};
  const std::vector<float> a = test::ToFloat(test::RandomFp32Values(13 * 8, 1.0, 41));
  const std::vector<float> wr = test::ToFloat(test::RandomFp32Values(8 * 6, 1.0, 42));
  absl::StatusOr<RouterOutput> plain = RouterForward(config, a, wr);
  absl::StatusOr<RouterOutput> zero = RouterForward(config, a, wr, {}, std::vector<float>(6, 0.f));
  ASSERT_TRUE(plain.ok() && zero.ok());
  EXPECT_EQ(plain->expert_index, zero->expert_index);
  EXPECT_EQ(plain->combine_weight, zero->combine_weight);
  EXPECT_EQ(plain->probs, zero->probs);
  EXPECT_EQ(plain->local_expert_counts, zero->local_expert_counts);
}

// Sigmoid scores: backward against central differences of the fp32 forward (combine weights
// with renormalisation, and the scores themselves), with a bias that moves the selection.
TEST(RouterTest, SigmoidBackwardMatchesFiniteDifferencesOfFp32Forward) {
  const std::vector<float> bias = {0.0f, 0.5f, -0.5f, 0.0f};
  ExpectBackwardMatchesFiniteDifferencesOfFp32Forward({.d_model = 5,
                                                       .num_experts = 4,
                                                       .top_k = 2,
                                                       .norm_topk_prob = true,
                                                       .router_scale = 1.5f,
                                                       .score = RouterScore::kSigmoid},
                                                      bias, 51);
}

TEST(RouterTest, BadBiasIsInvalidArgument) {
  RouterConfig config{.d_model = 2, .num_experts = 4, .top_k = 2};
  std::vector<float> a(6, 1.0f), wr(8, 0.1f);
  absl::Status short_bias = RouterForward(config, a, wr, {}, std::vector<float>(3, 0.f)).status();
  EXPECT_EQ(short_bias.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_bias.message(), HasSubstr("expert bias has 3"));
  std::vector<float> nan_bias(4, 0.0f);
  nan_bias[2] = std::numeric_limits<float>::quiet_NaN();
  absl::Status nan_status = RouterForward(config, a, wr, {}, nan_bias).status();
  EXPECT_EQ(nan_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(nan_status.message(), HasSubstr("expert bias[2]"));
}

}  // namespace gradsum::moe
