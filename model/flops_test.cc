// CountStepFlops against an independent count: the matmuls read off the spec's parameter
// shapes (each matrix a token passes through: 2 FLOPs per element; an expert's matrices at
// top_k / experts of the tokens; the head once per CE), and the attention's score entries
// enumerated pair by pair from the kernel's blocking rule.
#include "model/flops.h"

#include <vector>

#include "gtest/gtest.h"
#include "model/moe_lm_spec.h"

namespace gradsum::model {
namespace {

// Pairs (query t, key s) of one document of n tokens that the blocked kernel computes:
// s's block is at or before t's (blocks of `block` tokens from the document's start).
int64_t EnumeratedEntries(int64_t n, int64_t block) {
  int64_t count = 0;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t s = 0; s < n; ++s) count += (s / block <= t / block) ? 1 : 0;
  }
  return count;
}

// Forward matmul FLOPs of one token from the spec's parameters.
double SpecForwardFlopsPerToken(const MoeLmConfig& m) {
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(m);
  EXPECT_TRUE(spec.ok()) << spec.status();
  double flops = 0;
  for (const ParamDef& p : spec->params()) {
    if (p.shape.size() != 2 || p.name == "emb") continue;  // norms; the embedding is a lookup
    const double per_use = 2.0 * p.shape[0] * p.shape[1];
    if (p.name == "out") {
      flops += per_use * (1 + m.mtp_depth);  // the main CE and every MTP depth's
    } else if (p.expert >= 0) {
      flops += per_use * m.top_k / m.experts;  // each token visits top_k of E experts
    } else {
      flops += per_use;
    }
  }
  return flops;
}

MoeLmConfig Small(bool attention, int mtp_depth) {
  MoeLmConfig m;
  m.vocab = 37;
  m.dim = 24;
  m.layers = 3;
  m.experts = 5;
  m.top_k = 2;
  m.expert_dim = 20;
  m.attention = attention;
  m.n_heads = 6;
  m.n_kv_heads = 2;
  m.mtp_depth = mtp_depth;
  return m;
}

TEST(FlopsTest, ScoreEntriesMatchThePairsTheBlockedKernelComputes) {
  for (int64_t block : {1, 4, 64}) {
    for (int64_t n : {0, 1, 2, 3, 63, 64, 65, 96, 128, 130, 200}) {
      EXPECT_EQ(ComputedScoreEntries(n, block), EnumeratedEntries(n, block))
          << "n=" << n << " block=" << block;
    }
  }
  // By hand: 96 tokens are blocks of 64 and 32; 64 x 64 + 32 x 96.
  EXPECT_EQ(ComputedScoreEntries(96), 4096 + 3072);
  // With blocks of one token the count is the causal triangle n (n + 1) / 2.
  EXPECT_EQ(ComputedScoreEntries(10, 1), 55);
}

TEST(FlopsTest, MatmulsMatchTheSpecsShapes) {
  for (bool attention : {false, true}) {
    for (int mtp : {0, 2}) {
      const MoeLmConfig m = Small(attention, mtp);
      EXPECT_DOUBLE_EQ(MatmulForwardFlopsPerToken(m), SpecForwardFlopsPerToken(m))
          << "attention=" << attention << " mtp=" << mtp;
    }
  }
  // The README model by hand: per layer 2 x 3 x 2 D H (experts) + 2 D E (router) +
  // 2 (2 D^2 + 2 D^2) (attention, 4 kv heads of 32), two layers, and the head 2 D V.
  MoeLmConfig readme;
  readme.attention = true;
  EXPECT_DOUBLE_EQ(MatmulForwardFlopsPerToken(readme),
                   2 * (196608.0 + 2048.0 + 131072.0) + 65536.0);
}

TEST(FlopsTest, StepCountsEveryDocumentsTokensAndScores) {
  for (int mtp : {0, 1}) {
    const MoeLmConfig m = Small(/*attention=*/true, mtp);
    const std::vector<int64_t> docs = {5, 64, 70, 1, 128};
    double tokens = 0, entries = 0;
    for (int64_t n : docs) {
      tokens += n;
      entries += EnumeratedEntries(n, 64);
    }
    const int layers = m.layers + mtp;
    // q k^T and p v per query head and entry: 2 x 2 x head_dim, times the heads.
    const double scores = layers * entries * 4.0 * (m.dim / m.n_heads) * m.n_heads;
    const double forward = tokens * SpecForwardFlopsPerToken(m) + scores;
    const StepFlops f = CountStepFlops(m, docs, /*recompute_full=*/false);
    EXPECT_DOUBLE_EQ(f.model, 3 * forward);
    EXPECT_DOUBLE_EQ(f.hardware, 3 * forward + scores / 2);  // backward's q k^T again
    // --recompute=full: each layer's forward once more, without the router.
    const double router = 2.0 * m.dim * m.experts;
    const StepFlops full = CountStepFlops(m, docs, /*recompute_full=*/true);
    EXPECT_DOUBLE_EQ(full.model, f.model);
    const double head_and_proj = (1 + mtp) * 2.0 * m.dim * m.vocab + mtp * 4.0 * m.dim * m.dim;
    const double layer_matmuls = (SpecForwardFlopsPerToken(m) - head_and_proj) / layers;
    EXPECT_NEAR(full.hardware - f.hardware, tokens * layers * (layer_matmuls - router) + scores,
                1e-6 * full.hardware);
  }
}

TEST(FlopsTest, WithoutAttentionNoScores) {
  const MoeLmConfig m = Small(/*attention=*/false, 0);
  const StepFlops f = CountStepFlops(m, {100, 28}, /*recompute_full=*/false);
  EXPECT_DOUBLE_EQ(f.model, 3 * 128 * SpecForwardFlopsPerToken(m));
  EXPECT_DOUBLE_EQ(f.hardware, f.model);
  EXPECT_EQ(CountStepFlops(m, {}, true).model, 0);
}

}  // namespace
}  // namespace gradsum::model
