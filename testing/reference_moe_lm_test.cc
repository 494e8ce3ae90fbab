#include "testing/reference_moe_lm.h"

#include <cmath>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::testing {
namespace {

using ::testing::HasSubstr;

NamedTensors RandomParams(const ReferenceConfig& c, uint32_t seed, double std) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, std);
  NamedTensors params;
  for (const auto& [name, shape] : ReferenceParamShapes(c)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<double>& t = params[name];
    t.resize(n);
    const bool gain = name.find("norm") != std::string::npos;
    for (double& x : t) x = gain ? 1.0 + normal(rng) : normal(rng);
  }
  return params;
}

// G micro-steps of `ranks` ranks, `n` tokens each; some padding, some ignored labels.
std::vector<std::vector<ReferenceMicroBatch>> RandomBatch(const ReferenceConfig& c, int G,
                                                          int ranks, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<ReferenceMicroBatch>> batch(G, std::vector<ReferenceMicroBatch>(ranks));
  for (int m = 0; m < G; ++m) {
    for (int r = 0; r < ranks; ++r) {
      ReferenceMicroBatch& mb = batch[m][r];
      const int pad = static_cast<int>(rng() % 3);  // padding at the end
      for (int t = 0; t < n; ++t) {
        mb.tokens.push_back(t < n - pad ? static_cast<int>(rng() % c.vocab) : 0);
        mb.mask.push_back(t < n - pad ? 1 : 0);
        const bool ignored = t >= n - pad || rng() % 4 == 0;
        mb.labels.push_back(ignored ? c.ignore_index : static_cast<int>(rng() % c.vocab));
        mb.sample_ids.push_back(t / 3);  // samples of 3 tokens (fewer valid ones)
      }
    }
  }
  return batch;
}

// With attention: micro-batches of `sequences` sequences of `seq_len` tokens, each packed
// with documents of 1 to 3 tokens (sample ids = documents) and 0 or 1 padding tokens at
// its end; some labels ignored.
std::vector<std::vector<ReferenceMicroBatch>> RandomSequences(const ReferenceConfig& c, int G,
                                                              int ranks, int sequences, int seq_len,
                                                              uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<ReferenceMicroBatch>> batch(G, std::vector<ReferenceMicroBatch>(ranks));
  int64_t sample = 0;
  for (int m = 0; m < G; ++m) {
    for (int r = 0; r < ranks; ++r) {
      ReferenceMicroBatch& mb = batch[m][r];
      mb.seq_len = seq_len;
      for (int q = 0; q < sequences; ++q) {
        const int used = seq_len - static_cast<int>(rng() % 2);
        int start = 0;
        for (int t = 0; t < seq_len; ++t) {
          if (t >= used) {
            mb.tokens.push_back(0);
            mb.mask.push_back(0);
            mb.labels.push_back(c.ignore_index);
            mb.sample_ids.push_back(-1);
            mb.doc_start.push_back(-1);
            continue;
          }
          if (t > start && rng() % 3 == 0) {
            start = t;  // a new document
            ++sample;
          }
          mb.tokens.push_back(static_cast<int>(rng() % c.vocab));
          mb.mask.push_back(1);
          mb.labels.push_back(rng() % 5 == 0 ? c.ignore_index : static_cast<int>(rng() % c.vocab));
          mb.sample_ids.push_back(sample);
          mb.doc_start.push_back(start);
        }
        ++sample;
      }
    }
  }
  return batch;
}

void FiniteDifferenceCheck(const ReferenceConfig& c) {
  const NamedTensors params = RandomParams(c, 5, 0.6);
  const auto batch = c.attention ? RandomSequences(c, /*G=*/2, /*ranks=*/2, /*sequences=*/2,
                                                   /*seq_len=*/4, 11)
                                 : RandomBatch(c, /*G=*/2, /*ranks=*/2, /*n=*/7, 11);
  absl::StatusOr<ReferenceResult> base = ReferenceLossAndGrads(c, params, batch);
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_GT(base->valid_tokens, 0);
  ASSERT_GT(base->bal, 0);
  ASSERT_GT(base->z, 0);
  const double eps = 1e-5;
  int checked = 0, skipped = 0;
  for (const auto& [name, shape] : ReferenceParamShapes(c)) {
    for (size_t i = 0; i < params.at(name).size(); ++i) {
      NamedTensors plus = params, minus = params;
      plus[name][i] += eps;
      minus[name][i] -= eps;
      absl::StatusOr<ReferenceResult> lp = ReferenceLossAndGrads(c, plus, batch);
      absl::StatusOr<ReferenceResult> lm = ReferenceLossAndGrads(c, minus, batch);
      ASSERT_TRUE(lp.ok() && lm.ok());
      // A perturbation that flips a top-K choice crosses a discontinuity: skip it.
      if (lp->expert_counts != base->expert_counts || lm->expert_counts != base->expert_counts) {
        ++skipped;
        continue;
      }
      const double fd = (lp->total() - lm->total()) / (2 * eps);
      const double an = base->grads.at(name)[i];
      EXPECT_NEAR(an, fd, 1e-7 + 1e-6 * std::abs(fd)) << name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_LE(skipped, 2);
  EXPECT_GT(checked, 200);
}

TEST(ReferenceMoeLmTest, GradientsMatchFiniteDifferencesNormalizedTopK) {
  ReferenceConfig c;
  c.vocab = 7;
  c.dim = 5;
  c.layers = 2;
  c.experts = 4;
  c.top_k = 2;
  c.expert_dim = 3;
  c.norm_topk_prob = true;
  c.router_scale = 1.5;
  c.alpha_b = 0.05;  // large enough that the aux gradients are visible
  c.alpha_z = 0.05;
  FiniteDifferenceCheck(c);
}

TEST(ReferenceMoeLmTest, GradientsMatchFiniteDifferencesRawTopK) {
  ReferenceConfig c;
  c.vocab = 6;
  c.dim = 4;
  c.layers = 1;
  c.experts = 3;
  c.top_k = 2;
  c.expert_dim = 5;
  c.norm_topk_prob = false;
  c.router_scale = 0.7;
  c.alpha_b = 0.1;
  c.alpha_z = 0.02;
  FiniteDifferenceCheck(c);
}

TEST(ReferenceMoeLmTest, GradientsMatchFiniteDifferencesSampleMode) {
  ReferenceConfig c;
  c.vocab = 7;
  c.dim = 4;
  c.layers = 1;
  c.experts = 4;
  c.top_k = 2;
  c.expert_dim = 3;
  c.alpha_b = 0.05;
  c.alpha_z = 0.05;
  c.ce_mode = "sample";
  FiniteDifferenceCheck(c);
}

TEST(ReferenceMoeLmTest, GradientsMatchFiniteDifferencesSquareMode) {
  ReferenceConfig c;
  c.vocab = 6;
  c.dim = 4;
  c.layers = 1;
  c.experts = 3;
  c.top_k = 2;
  c.expert_dim = 4;
  c.alpha_b = 0.05;
  c.alpha_z = 0.05;
  c.ce_mode = "square";
  FiniteDifferenceCheck(c);
}

TEST(ReferenceMoeLmTest, GradientsMatchFiniteDifferencesWithGqaAttention) {
  ReferenceConfig c;
  c.vocab = 6;
  c.dim = 4;
  c.layers = 1;
  c.experts = 3;
  c.top_k = 2;
  c.expert_dim = 3;
  c.alpha_b = 0.05;
  c.alpha_z = 0.05;
  c.attention = true;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.rope_theta = 7.0;  // small, so that the rotations are far from the identity
  FiniteDifferenceCheck(c);
}

TEST(ReferenceMoeLmTest, GradientsMatchFiniteDifferencesWithAttentionTwoLayersSampleMode) {
  ReferenceConfig c;
  c.vocab = 5;
  c.dim = 4;
  c.layers = 2;
  c.experts = 2;
  c.top_k = 1;
  c.expert_dim = 2;
  c.alpha_b = 0.05;
  c.alpha_z = 0.05;
  c.attention = true;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.rope_theta = 5.0;
  c.ce_mode = "sample";
  FiniteDifferenceCheck(c);
}

// Attention never crosses a document: a document's loss and gradients do not depend on
// the tokens of another document packed into the same sequence.
TEST(ReferenceMoeLmTest, AttentionStaysInsideDocuments) {
  ReferenceConfig c;
  c.vocab = 6;
  c.dim = 4;
  c.layers = 1;
  c.experts = 2;
  c.top_k = 1;
  c.expert_dim = 2;
  c.alpha_b = 0;
  c.alpha_z = 0;
  c.attention = true;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  const NamedTensors params = RandomParams(c, 3, 0.6);
  ReferenceMicroBatch mb;
  mb.seq_len = 6;
  mb.tokens = {1, 2, 3, 4, 5, 0};
  mb.labels = {2, 3, c.ignore_index, 5, 0, 1};
  mb.mask = {1, 1, 1, 1, 1, 1};
  mb.doc_start = {0, 0, 0, 3, 3, 3};
  ReferenceMicroBatch other = mb;
  other.tokens = {4, 0, 1, 4, 5, 0};  // the first document changed, the second not
  other.labels = {0, 1, c.ignore_index, 5, 0, 1};
  // The second document alone (as the first document's labels ignored in both).
  for (ReferenceMicroBatch* b : {&mb, &other}) {
    for (int t = 0; t < 3; ++t) b->labels[t] = c.ignore_index;
  }
  absl::StatusOr<ReferenceResult> a = ReferenceLossAndGrads(c, params, {{mb}});
  absl::StatusOr<ReferenceResult> b = ReferenceLossAndGrads(c, params, {{other}});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_DOUBLE_EQ(a->ce, b->ce);
  for (const char* name : {"layers.0.wq", "layers.0.wk", "layers.0.wv", "out"}) {
    EXPECT_EQ(a->grads.at(name), b->grads.at(name)) << name;
  }
}

// D of §3 by exact count: token mode counts valid tokens; sample mode counts the samples
// with a valid token (each contributes n_s * 1/n_s = 1); square mode sums sqrt(n_s).
TEST(ReferenceMoeLmTest, CeWeightSumIsTheModesCount) {
  ReferenceConfig c;
  c.vocab = 5;
  c.dim = 4;
  const auto batch = RandomBatch(c, 2, 3, 8, 21);
  std::map<std::tuple<int, int, int64_t>, int> n;
  int valid = 0;
  for (int m = 0; m < 2; ++m) {
    for (int r = 0; r < 3; ++r) {
      const ReferenceMicroBatch& mb = batch[m][r];
      for (size_t t = 0; t < mb.labels.size(); ++t) {
        if (mb.labels[t] == c.ignore_index) continue;
        ++valid;
        ++n[{m, r, mb.sample_ids[t]}];
      }
    }
  }
  double square = 0;
  for (const auto& [key, count] : n) square += std::sqrt(static_cast<double>(count));
  const NamedTensors params = RandomParams(c, 2, 0.5);
  for (const auto& [mode, want] : std::vector<std::pair<std::string, double>>{
           {"token", valid}, {"sample", static_cast<double>(n.size())}, {"square", square}}) {
    c.ce_mode = mode;
    absl::StatusOr<ReferenceResult> ref = ReferenceLossAndGrads(c, params, batch);
    ASSERT_TRUE(ref.ok()) << ref.status();
    EXPECT_NEAR(ref->ce_weight_sum, want, 1e-12 * want) << mode;
    EXPECT_EQ(ref->valid_tokens, valid) << mode;
  }
}

// With a zero LM head and zero routers every term has a closed form: CE = ln V;
// p = 1/E so lse(u) = ln E and L_z = alpha_z L (ln E)^2; top-K ties pick experts
// 0..K-1 for every token, c[e] = N_m for those, so L_bal = alpha_b L exactly.
TEST(ReferenceMoeLmTest, ClosedFormValuesAtZeroHeadAndRouters) {
  ReferenceConfig c;
  c.vocab = 9;
  c.dim = 4;
  c.layers = 3;
  c.experts = 5;
  c.top_k = 2;
  c.expert_dim = 3;
  c.alpha_b = 0.01;
  c.alpha_z = 0.02;
  NamedTensors params = RandomParams(c, 3, 0.5);
  std::fill(params["out"].begin(), params["out"].end(), 0.0);
  for (int l = 0; l < c.layers; ++l) {
    auto& wr = params["layers." + std::to_string(l) + ".router"];
    std::fill(wr.begin(), wr.end(), 0.0);
  }
  const auto batch = RandomBatch(c, 3, 2, 6, 4);
  absl::StatusOr<ReferenceResult> ref = ReferenceLossAndGrads(c, params, batch);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_NEAR(ref->ce, std::log(9.0), 1e-12);
  EXPECT_NEAR(ref->z, c.alpha_z * c.layers * std::log(5.0) * std::log(5.0), 1e-12);
  EXPECT_NEAR(ref->bal, c.alpha_b * c.layers, 1e-12);
  for (int l = 0; l < c.layers; ++l) {
    for (int m = 0; m < 3; ++m) {
      int64_t routed = 0;
      for (const auto& mb : batch[m]) routed += std::count(mb.mask.begin(), mb.mask.end(), 1);
      EXPECT_THAT(ref->expert_counts[l][m], ::testing::ElementsAre(routed, routed, 0, 0, 0));
    }
  }
}

// SEMANTICS.md §3: D == 0 gives a CE of exactly 0 and exactly zero CE gradients.
TEST(ReferenceMoeLmTest, NoValidTokensGivesZeroCeAndZeroHeadGradient) {
  ReferenceConfig c;
  c.vocab = 5;
  c.dim = 4;
  c.alpha_b = 0;
  c.alpha_z = 0;
  auto batch = RandomBatch(c, 2, 2, 5, 8);
  for (auto& micro : batch) {
    for (auto& mb : micro) std::fill(mb.labels.begin(), mb.labels.end(), c.ignore_index);
  }
  absl::StatusOr<ReferenceResult> ref = ReferenceLossAndGrads(c, RandomParams(c, 1, 0.5), batch);
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ(ref->ce, 0.0);
  for (const auto& [name, g] : ref->grads) {
    for (double x : g) ASSERT_EQ(x, 0.0) << name;
  }
}

TEST(ReferenceMoeLmTest, BadInputsAreInvalidArgument) {
  ReferenceConfig c;
  c.vocab = 5;
  const NamedTensors params = RandomParams(c, 1, 0.5);
  auto check = [&](const NamedTensors& p, std::vector<std::vector<ReferenceMicroBatch>> b,
                   const char* expect) {
    absl::StatusOr<ReferenceResult> r = ReferenceLossAndGrads(c, p, b);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << expect;
    EXPECT_THAT(r.status().message(), HasSubstr(expect));
  };
  ReferenceMicroBatch ok{{1, 2}, {2, -100}, {1, 1}};
  auto good = ReferenceLossAndGrads(c, params, {{ok}});
  EXPECT_TRUE(good.ok());
  check(params, {{ReferenceMicroBatch{{1, 2}, {5, -100}, {1, 1}}}}, "label 5");
  check(params, {{ReferenceMicroBatch{{1, 2}, {-3, -100}, {1, 1}}}}, "label -3");
  check(params, {{ReferenceMicroBatch{{7, 2}, {1, -100}, {1, 1}}}}, "token 7");
  check(params, {{ReferenceMicroBatch{{1, 2}, {2, 3}, {1, 0}}}}, "has label 3");
  check(params, {{ReferenceMicroBatch{{1, 2}, {2}, {1, 1}}}}, "differ in length");
  NamedTensors missing = params;
  missing.erase("final_norm");
  check(missing, {{ok}}, "missing parameter final_norm");
  NamedTensors wrong = params;
  wrong["emb"].pop_back();
  check(wrong, {{ok}}, "parameter emb has");
  ReferenceConfig sample = c;
  sample.ce_mode = "sample";
  EXPECT_THAT(ReferenceLossAndGrads(sample, params, {{ok}}).status().message(),
              HasSubstr("0 sample ids for 2 tokens (sample mode)"));
  ReferenceConfig bad_mode = c;
  bad_mode.ce_mode = "mean";
  EXPECT_THAT(ReferenceLossAndGrads(bad_mode, params, {{ok}}).status().message(),
              HasSubstr("ce_mode \"mean\""));
  ReferenceConfig bad_k = c;
  bad_k.top_k = 9;
  EXPECT_EQ(ReferenceLossAndGrads(bad_k, params, {{ok}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gradsum::testing
