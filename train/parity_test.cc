// Parity of the distributed trainer with the single-process reference (SEMANTICS.md §2):
// after SUM reduction every parameter's gradient equals dL/dtheta of the global loss,
// and the display losses equal the reference's, at every (F, P) mesh, micro-batch count
// and sharding mode, on the thread backend.
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "data/corpus.h"
#include "data/document_source.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/streams.h"
#include "gtest/gtest.h"
#include "train/test_util.h"

namespace gradsum::train {
namespace {

// (F, P, G, sharding)
using Case = std::tuple<int, int, int, TrainConfig::Sharding>;

class ParityTest : public ::testing::TestWithParam<Case> {};

TEST_P(ParityTest, StepOneMatchesReferenceOnEveryRank) {
  const auto [F, P, G, sharding] = GetParam();
  TrainConfig config = TinyConfig(F * P, P, G, sharding);
  config.mutable_debug()->set_parity_check(true);
  absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
  ASSERT_TRUE(out.ok()) << out.status();
  for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << r.status;

  // Rank 0 ran the reference: every parameter and loss term within 1e-5.
  const RankOutcome& r0 = (*out)[0];
  ASSERT_TRUE(r0.parity.has_value());
  EXPECT_TRUE(r0.parity->ok) << r0.parity->ToString();
  EXPECT_LE(r0.parity->worst, 1e-5);
  EXPECT_EQ(r0.parity->params.size(), 1 + 2 * (2 + 4 * 3) + 2u);
  EXPECT_EQ(r0.parity->losses.size(), 3u);

  // Every rank: the same global display values and the same full reduced gradients.
  for (const RankOutcome& r : *out) {
    ASSERT_TRUE(r.parity.has_value());
    EXPECT_TRUE(r.parity->ok);
    ASSERT_EQ(r.history.size(), 1u);
    EXPECT_EQ(r.history[0].ce(), r0.history[0].ce());
    EXPECT_EQ(r.history[0].z(), r0.history[0].z());
    EXPECT_EQ(r.history[0].bal(), r0.history[0].bal());
    EXPECT_EQ(r.history[0].grad_norm(), r0.history[0].grad_norm());
    ASSERT_TRUE(r.first_step_grads.has_value());
    EXPECT_EQ(*r.first_step_grads, *r0.first_step_grads);
  }
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const auto [F, P, G, sharding] = info.param;
  return absl::StrCat("F", F, "P", P, "G", G, "_", TrainConfig::Sharding_Name(sharding));
}

// (F, P, G, sharding): every mesh of the issue, G in {1, 2, 3}, both modes.
std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const auto& [F, P] :
       std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {1, 2}, {2, 2}, {4, 2}, {2, 4}}) {
    for (int G : {1, 2, 3}) {
      for (auto sharding : {TrainConfig::fsdp, TrainConfig::replicated}) {
        cases.push_back({F, P, G, sharding});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Meshes, ParityTest, ::testing::ValuesIn(AllCases()), CaseName);

// HSDP (SEMANTICS.md §7): sharded inside shard groups of N consecutive ranks, the
// accumulated shard summed across the W / N groups. Every case matches the fp64 reference
// on every rank, with its units reduced every micro-batch or only on the last one; N = W is
// sharded mode with no replicas.
TEST(HsdpParityTest, StepOneMatchesReferenceOnEveryRank) {
  // (world, P, N, G, reduce_every_micro_batch)
  for (const auto& [W, P, N, G, every] :
       std::vector<std::tuple<int, int, int, int, bool>>{{4, 2, 2, 1, true},
                                                         {4, 2, 2, 3, true},
                                                         {4, 1, 2, 2, true},
                                                         {4, 1, 1, 2, false},
                                                         {8, 2, 4, 2, true},
                                                         {8, 2, 2, 1, false},
                                                         {6, 1, 3, 2, true},
                                                         {4, 2, 4, 2, true}}) {
    TrainConfig config = TinyConfig(W, P, G, TrainConfig::hsdp);
    config.mutable_parallelism()->set_shard_group(N);
    config.mutable_parallelism()->set_reduce_every_micro_batch(every);
    config.mutable_debug()->set_parity_check(true);
    const std::string what = absl::StrCat("world ", W, " ep ", P, " shard_group ", N, " G ", G,
                                          every ? "" : " reduce once");
    absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
    ASSERT_TRUE(out.ok()) << what << ": " << out.status();
    for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << what << ": " << r.status;
    const RankOutcome& r0 = (*out)[0];
    ASSERT_TRUE(r0.parity.has_value());
    EXPECT_TRUE(r0.parity->ok) << what << "\n" << r0.parity->ToString();
    EXPECT_LE(r0.parity->worst, 1e-5) << what;
    EXPECT_EQ(r0.parity->params.size(), 1 + 2 * (2 + 4 * 3) + 2u);
    for (const RankOutcome& r : *out) {
      ASSERT_TRUE(r.first_step_grads.has_value());
      EXPECT_EQ(*r.first_step_grads, *r0.first_step_grads) << what;
      EXPECT_EQ(r.history[0].grad_norm(), r0.history[0].grad_norm()) << what;
    }
  }
}

// bf16 on the wire: the in-group stage rounds its partial sums to bf16 once, the
// cross-group stage carries the fp32 accumulator (SEMANTICS.md §7); with bf16 compute it
// stays within the parity check's bf16 bar, and is not exact.
TEST(HsdpParityTest, Bf16ComputeAndReduceStayNearTheReference) {
  TrainConfig config = TinyConfig(4, 2, 2, TrainConfig::hsdp);
  config.mutable_parallelism()->set_shard_group(2);
  config.mutable_precision()->set_compute_dtype(TrainConfig::bf16);
  config.mutable_precision()->set_reduce_dtype(TrainConfig::bf16);
  config.mutable_debug()->set_parity_check(true);  // bf16 uses a 3e-2 bar
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << r.status;
  ASSERT_TRUE((*out)[0].parity.has_value());
  EXPECT_TRUE((*out)[0].parity->ok) << (*out)[0].parity->ToString();
  EXPECT_GT((*out)[0].parity->worst, 1e-6) << "bf16 should not be exact";
}

// In exact precision (SEMANTICS.md §11) HSDP's two integer stages give fsdp's bits: the
// reduced gradients, and with them the step's grad norm.
TEST(HsdpParityTest, ReproducibleGradientsAreFsdpsBits) {
  for (const auto& [W, P, N, G] :
       std::vector<std::tuple<int, int, int, int>>{{4, 2, 2, 2}, {4, 1, 1, 1}, {8, 2, 4, 3}}) {
    TrainConfig fsdp = TinyConfig(W, P, G, TrainConfig::fsdp);
    fsdp.mutable_precision()->set_reproducible(true);
    fsdp.mutable_debug()->set_parity_check(true);
    TrainConfig hsdp = fsdp;
    hsdp.mutable_parallelism()->set_sharding(TrainConfig::hsdp);
    hsdp.mutable_parallelism()->set_shard_group(N);
    auto a = RunInProcess(fsdp);
    auto b = RunInProcess(hsdp);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_TRUE((*a)[0].status.ok()) << (*a)[0].status;
    ASSERT_TRUE((*b)[0].status.ok()) << (*b)[0].status;
    ASSERT_TRUE((*b)[0].parity.has_value());
    EXPECT_TRUE((*b)[0].parity->ok) << (*b)[0].parity->ToString();
    EXPECT_EQ(*(*a)[0].first_step_grads, *(*b)[0].first_step_grads) << W << " " << N;
    EXPECT_EQ((*a)[0].history[0].grad_norm(), (*b)[0].history[0].grad_norm());
  }
}

// SEMANTICS.md §7: on the thread backend the two modes give bit-identical gradients
// (with G == 1 they add the same terms in the same order).
TEST(ParityModesTest, FsdpAndReplicatedAreBitIdenticalAtOneMicroBatch) {
  for (const auto& [F, P] : {std::pair<int, int>{2, 2}, {4, 2}, {2, 4}}) {
    TrainConfig fsdp = TinyConfig(F * P, P, 1, TrainConfig::fsdp);
    TrainConfig replicated = TinyConfig(F * P, P, 1, TrainConfig::replicated);
    fsdp.mutable_debug()->set_parity_check(true);
    replicated.mutable_debug()->set_parity_check(true);
    auto a = RunInProcess(fsdp);
    auto b = RunInProcess(replicated);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_TRUE((*a)[0].status.ok() && (*b)[0].status.ok());
    EXPECT_EQ(*(*a)[0].first_step_grads, *(*b)[0].first_step_grads) << F << "x" << P;
    EXPECT_EQ((*a)[0].history[0].ce(), (*b)[0].history[0].ce());
  }
}

// The unit schedule's choices change only where and when gradients are summed, not what:
// a coarser wrap (2 layers per unit, 3 layers), no reshard after forward, and fsdp
// reduce-scattering only the last micro-batch's accumulated gradient all match the
// reference at every G; fsdp and replicated stay bit-identical at G = 1 with the coarser
// units too.
TEST(ParityScheduleTest, WrapPolicyReshardAndLastMicroBatchReductionMatchTheReference) {
  for (const auto& [F, P, G, sharding] : std::vector<Case>{{2, 2, 1, TrainConfig::fsdp},
                                                           {2, 2, 3, TrainConfig::fsdp},
                                                           {4, 2, 2, TrainConfig::fsdp},
                                                           {2, 2, 3, TrainConfig::replicated}}) {
    TrainConfig config = TinyConfig(F * P, P, G, sharding);
    config.mutable_model()->set_layers(3);
    config.mutable_parallelism()->set_layers_per_unit(2);
    config.mutable_parallelism()->set_reshard_after_forward(false);
    config.mutable_parallelism()->set_reduce_every_micro_batch(false);
    config.mutable_comm()->set_first_bucket_mb(1e-3);
    config.mutable_debug()->set_parity_check(true);
    auto out = RunInProcess(config);
    ASSERT_TRUE(out.ok()) << out.status();
    for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << r.status;
    ASSERT_TRUE((*out)[0].parity.has_value());
    EXPECT_TRUE((*out)[0].parity->ok) << (*out)[0].parity->ToString();
    EXPECT_LE((*out)[0].parity->worst, 1e-5)
        << F << "x" << P << " G" << G << " " << TrainConfig::Sharding_Name(sharding);
  }
  TrainConfig fsdp = TinyConfig(4, 2, 1, TrainConfig::fsdp);
  fsdp.mutable_model()->set_layers(3);
  fsdp.mutable_parallelism()->set_layers_per_unit(2);
  fsdp.mutable_debug()->set_parity_check(true);
  TrainConfig replicated = fsdp;
  replicated.mutable_parallelism()->set_sharding(TrainConfig::replicated);
  auto a = RunInProcess(fsdp);
  auto b = RunInProcess(replicated);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)[0].status.ok() && (*b)[0].status.ok());
  EXPECT_EQ(*(*a)[0].first_step_grads, *(*b)[0].first_step_grads);
  EXPECT_EQ((*a)[0].history[0].grad_norm(), (*b)[0].history[0].grad_norm());
  EXPECT_EQ((*a)[0].history[0].ce(), (*b)[0].history[0].ce());
}

// Sample and square CE weighting (§3): the trainer's weights come from
// losses::ComputeTokenWeights over this rank's packed documents; the reference weighs the
// global batch itself. Step 1 must agree within 1e-5 on every mesh shape tried, and the
// weighting must matter (the CE differs from token mode's).
TEST(ParityCeModesTest, SampleAndSquareWeightingMatchTheReference) {
  for (const auto& [F, P, G, sharding] : std::vector<Case>{{1, 1, 1, TrainConfig::fsdp},
                                                           {2, 2, 2, TrainConfig::fsdp},
                                                           {1, 2, 3, TrainConfig::replicated}}) {
    TrainConfig token = TinyConfig(F * P, P, G, sharding);
    token.mutable_debug()->set_parity_check(true);
    auto t = RunInProcess(token);
    ASSERT_TRUE(t.ok() && (*t)[0].status.ok());
    for (auto mode : {TrainConfig::sample, TrainConfig::square}) {
      TrainConfig config = token;
      config.mutable_loss()->set_ce_mode(mode);
      absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
      ASSERT_TRUE(out.ok()) << out.status();
      for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << mode << ": " << r.status;
      const RankOutcome& r0 = (*out)[0];
      ASSERT_TRUE(r0.parity.has_value());
      EXPECT_TRUE(r0.parity->ok) << mode << "\n" << r0.parity->ToString();
      EXPECT_LE(r0.parity->worst, 1e-5) << mode;
      EXPECT_NE(r0.history[0].ce(), (*t)[0].history[0].ce()) << mode << ": weighting had no effect";
    }
  }
}

// The CE options (SEMANTICS.md §3.2), each on alone and all together, at world 2, ep 2,
// G 2: the fp64 reference (testing/reference_moe_lm) computes them from their definitions,
// so step 1's gradients and losses must agree within 1e-5, and each option must matter.
TEST(ParityCeOptionsTest, SmoothingSoftcapAndOutputZLossMatchTheReference) {
  TrainConfig plain = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  plain.mutable_debug()->set_parity_check(true);
  auto p = RunInProcess(plain);
  ASSERT_TRUE(p.ok() && (*p)[0].status.ok());
  struct Options {
    const char* name;
    double eps, cap, alpha;
  };
  for (const Options& o :
       {Options{"label_smoothing", 0.1, 0, 0}, Options{"logit_softcap", 0, 0.5, 0},
        Options{"alpha_lse", 0, 0, 0.01}, Options{"all three", 0.2, 0.3, 0.02}}) {
    TrainConfig config = plain;
    config.mutable_loss()->set_label_smoothing(o.eps);
    config.mutable_loss()->set_logit_softcap(o.cap);
    config.mutable_loss()->set_alpha_lse(o.alpha);
    absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
    ASSERT_TRUE(out.ok()) << out.status();
    for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << o.name << ": " << r.status;
    const RankOutcome& r0 = (*out)[0];
    ASSERT_TRUE(r0.parity.has_value());
    EXPECT_TRUE(r0.parity->ok) << o.name << "\n" << r0.parity->ToString();
    EXPECT_LE(r0.parity->worst, 1e-5) << o.name;
    EXPECT_NE(r0.history[0].loss(), (*p)[0].history[0].loss()) << o.name << " had no effect";
    // ce changes with the options that change the CE; the output z-loss is a term of its
    // own (z_out, checked against the reference by the parity report's extra row).
    if (o.eps > 0 || o.cap > 0) {
      EXPECT_NE(r0.history[0].ce(), (*p)[0].history[0].ce()) << o.name;
    }
    EXPECT_EQ(r0.history[0].has_z_out(), o.alpha > 0) << o.name;
    EXPECT_EQ(r0.parity->losses.size(), o.alpha > 0 ? 4u : 3u) << o.name;
    ASSERT_TRUE(r0.first_step_grads.has_value() && (*p)[0].first_step_grads.has_value());
    EXPECT_NE(*r0.first_step_grads, *(*p)[0].first_step_grads) << o.name << " had no effect";
  }
}

// The output z-loss (§3.2) is its own display term z_out (§8): it equals an fp64
// computation of alpha_lse * sum_t w_t lse_t^2 / D (the reference's, from its own logits),
// with sample-mode weights so that w_t and D are not token counts; ce then excludes it
// (bit for bit the ce of the same run without it: the CE rows do not depend on alpha);
// the loss is the sum of the four terms; every rank displays the same values. Then
// reproducible mode, whose display adds one z_out value per row block, gives the same
// bits of z_out at world 1 and world 4.
TEST(ParityCeOptionsTest, OutputZLossIsItsOwnDisplayTerm) {
  TrainConfig smooth = TinyConfig(4, 2, 2, TrainConfig::fsdp);
  smooth.mutable_debug()->set_parity_check(true);
  smooth.mutable_loss()->set_ce_mode(TrainConfig::sample);
  smooth.mutable_loss()->set_label_smoothing(0.1);
  TrainConfig config = smooth;
  const double alpha = 0.05;
  config.mutable_loss()->set_alpha_lse(alpha);
  auto without = RunInProcess(smooth);
  auto with = RunInProcess(config);
  ASSERT_TRUE(without.ok() && with.ok());
  for (const auto* out : {&*without, &*with}) {
    for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << r.status;
  }
  const RankOutcome& r0 = (*with)[0];
  ASSERT_TRUE(r0.parity.has_value());
  EXPECT_TRUE(r0.parity->ok) << r0.parity->ToString();
  const StepMetrics& s1 = r0.history[0];
  ASSERT_TRUE(s1.has_z_out());
  EXPECT_GT(s1.z_out(), 0.0);
  bool compared = false;
  for (const LossParity& l : r0.parity->losses) {
    if (l.name != "z_out") continue;
    compared = true;
    EXPECT_EQ(l.value, s1.z_out());
    EXPECT_GT(l.reference, 0.0);
    EXPECT_LE(l.rel_err, 1e-6) << r0.parity->ToString();
  }
  EXPECT_TRUE(compared) << r0.parity->ToString();
  const StepMetrics& plain = (*without)[0].history[0];
  EXPECT_FALSE(plain.has_z_out());
  EXPECT_EQ(s1.ce(), plain.ce()) << "ce must exclude the output z-loss";
  EXPECT_EQ(s1.z(), plain.z());
  EXPECT_EQ(s1.bal(), plain.bal());
  EXPECT_NEAR(s1.loss(), s1.ce() + s1.z() + s1.bal() + s1.z_out(), 1e-12);
  EXPECT_NEAR(s1.loss() - plain.loss(), s1.z_out(), 1e-12);
  for (const RankOutcome& r : *with) EXPECT_EQ(r.history[0].z_out(), s1.z_out());

  // Reproducible: the same bits at world 1 and world 4 (one micro-batch of 8 vs 4 x 2).
  auto repro = [&](int world, int ep, int micro_batch) {
    TrainConfig c = config;
    c.mutable_parallelism()->set_world(world);
    c.mutable_parallelism()->set_ep(ep);
    c.mutable_parallelism()->set_grad_acc(1);
    c.mutable_data()->set_micro_batch(micro_batch);
    c.mutable_precision()->set_reproducible(true);
    c.mutable_debug()->set_parity_check(false);
    return RunInProcess(c);
  };
  auto w1 = repro(1, 1, 8);
  auto w4 = repro(4, 2, 2);
  ASSERT_TRUE(w1.ok() && w4.ok());
  ASSERT_TRUE((*w1)[0].status.ok()) << (*w1)[0].status;
  for (const RankOutcome& r : *w4) ASSERT_TRUE(r.status.ok()) << r.status;
  ASSERT_TRUE((*w1)[0].history[0].has_z_out());
  EXPECT_GT((*w1)[0].history[0].z_out(), 0.0);
  EXPECT_EQ((*w1)[0].history[0].z_out(), (*w4)[0].history[0].z_out());
  EXPECT_EQ((*w1)[0].history[0].ce(), (*w4)[0].history[0].ce());
}

// The bar can fail: a tolerance below fp32 rounding must fail the check on every rank.
TEST(ParityCheckTest, FailsWhenTheToleranceIsBelowRoundingError) {
  TrainConfig config = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  config.mutable_debug()->set_parity_check(true);
  config.mutable_debug()->set_parity_tolerance(1e-13);  // below fp32 rounding: must fail
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE((*out)[0].parity.has_value());
  EXPECT_FALSE((*out)[0].parity->ok);
  EXPECT_EQ((*out)[0].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*out)[1].status.code(), absl::StatusCode::kFailedPrecondition);
}

// With attention (§10) and sequence parallelism (§12): the reduced gradients equal the
// single-process gradients of the global batch at S = 1, 2, 4, crossed with EP 1 / 2,
// G 1 / 2, both sharding modes and the three CE weightings. Documents of 2 to 12 tokens
// packed into 16-token sequences cross the slices of 16 / S tokens that the ranks of an SP
// group hold (sample mode then needs each document's whole count on every rank).
// (S, P, G, sharding, CE mode); the world is 2 S so that every case has two SP groups.
using AttentionCase = std::tuple<int, int, int, TrainConfig::Sharding, TrainConfig::CeMode>;

class AttentionParityTest : public ::testing::TestWithParam<AttentionCase> {};

TrainConfig AttentionConfig(int world, int ep, int sp, int grad_acc, TrainConfig::Sharding sharding,
                            TrainConfig::CeMode ce_mode) {
  TrainConfig config = TinyConfig(world, ep, grad_acc, sharding);
  config.mutable_parallelism()->set_sp(sp);
  config.mutable_loss()->set_ce_mode(ce_mode);
  ModelConfig* m = config.mutable_model();
  m->set_attention(ModelConfig::causal);
  m->set_heads(4);
  m->set_kv_heads(2);
  m->set_rope_theta(100);
  config.mutable_debug()->set_parity_check(true);
  return config;
}

// Step 1 of `config` (an AttentionConfig) passes the parity check within 1e-5, covers every
// parameter, and every rank has the same reduced gradients and logged ce.
void ExpectAttentionParity(const TrainConfig& config) {
  absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
  ASSERT_TRUE(out.ok()) << out.status();
  for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << r.status;
  const RankOutcome& r0 = (*out)[0];
  ASSERT_TRUE(r0.parity.has_value());
  EXPECT_TRUE(r0.parity->ok) << r0.parity->ToString();
  EXPECT_LE(r0.parity->worst, 1e-5);
  // emb; per layer attn_norm, wq, wk, wv, wo, norm, router, 4 experts x 3; final_norm; out.
  EXPECT_EQ(r0.parity->params.size(), 1 + 2 * (5 + 2 + 4 * 3) + 2u);
  for (const RankOutcome& r : *out) {
    ASSERT_TRUE(r.first_step_grads.has_value());
    EXPECT_EQ(*r.first_step_grads, *r0.first_step_grads);
    EXPECT_EQ(r.history[0].ce(), r0.history[0].ce());
  }
}

TEST_P(AttentionParityTest, StepOneMatchesReference) {
  const auto [S, P, G, sharding, ce_mode] = GetParam();
  ExpectAttentionParity(AttentionConfig(2 * S, P, S, G, sharding, ce_mode));
}

std::string AttentionCaseName(const ::testing::TestParamInfo<AttentionCase>& info) {
  const auto [S, P, G, sharding, ce_mode] = info.param;
  return absl::StrCat("S", S, "P", P, "G", G, "_", TrainConfig::Sharding_Name(sharding), "_",
                      TrainConfig::CeMode_Name(ce_mode));
}

std::vector<AttentionCase> AttentionCases() {
  std::vector<AttentionCase> cases;
  for (int S : {1, 2, 4}) {
    for (int P : {1, 2}) {
      for (int G : {1, 2}) {
        cases.push_back({S, P, G, TrainConfig::fsdp, TrainConfig::token});
      }
      cases.push_back({S, P, 2, TrainConfig::replicated, TrainConfig::sample});
    }
    cases.push_back({S, 2, 1, TrainConfig::replicated, TrainConfig::square});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Meshes, AttentionParityTest, ::testing::ValuesIn(AttentionCases()),
                         AttentionCaseName);

// With context parallelism (§16): the ring's gradients equal the single-process
// gradients of the global batch at C = 2 and 4, alone and crossed with S = 2, EP 1 / 2,
// G 1 / 2, both sharding modes and the three CE weightings. The 16-token sequences are cut
// into 2C chunks of 4 or 2 tokens, so the documents (2 to 12 tokens) cross chunk
// boundaries and a rank's two chunks belong to different documents. (C, S, P, G,
// sharding, CE mode); the world is 2 C S: two data-parallel groups.
using CpCase = std::tuple<int, int, int, int, TrainConfig::Sharding, TrainConfig::CeMode>;

class CpParityTest : public ::testing::TestWithParam<CpCase> {};

TEST_P(CpParityTest, StepOneMatchesReference) {
  const auto [C, S, P, G, sharding, ce_mode] = GetParam();
  TrainConfig config = AttentionConfig(2 * C * S, P, S, G, sharding, ce_mode);
  config.mutable_parallelism()->set_cp(C);
  ExpectAttentionParity(config);
}

std::string CpCaseName(const ::testing::TestParamInfo<CpCase>& info) {
  const auto [C, S, P, G, sharding, ce_mode] = info.param;
  return absl::StrCat("C", C, "S", S, "P", P, "G", G, "_", TrainConfig::Sharding_Name(sharding),
                      "_", TrainConfig::CeMode_Name(ce_mode));
}

std::vector<CpCase> CpCases() {
  std::vector<CpCase> cases;
  for (int C : {2, 4}) {
    for (int P : {1, 2}) {
      for (int G : {1, 2}) cases.push_back({C, 1, P, G, TrainConfig::fsdp, TrainConfig::token});
    }
    cases.push_back({C, 1, 2, 2, TrainConfig::replicated, TrainConfig::sample});
    cases.push_back({C, 1, 1, 1, TrainConfig::fsdp, TrainConfig::square});
    cases.push_back({C, 2, 2, 2, TrainConfig::fsdp, TrainConfig::sample});
  }
  cases.push_back({2, 2, 1, 1, TrainConfig::replicated, TrainConfig::token});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Meshes, CpParityTest, ::testing::ValuesIn(CpCases()), CpCaseName);

// A rank of an SP group whose tokens are all padding (§12) contributes exactly zero: here
// documents of at most 8 tokens in 32-token sequences over S = 4 often leave a rank only
// padding, and the parity still holds.
TEST(AttentionParityTest, PaddedSlicesContributeNothing) {
  TrainConfig config = AttentionConfig(4, 1, 4, 1, TrainConfig::fsdp, TrainConfig::sample);
  config.mutable_data()->set_seq_len(32);
  config.mutable_data()->set_max_doc_len(8);
  config.mutable_data()->set_min_doc_len(2);
  config.mutable_data()->set_micro_batch(1);
  config.mutable_data()->set_corpus_documents(3);  // three short documents per sequence
  absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
  ASSERT_TRUE(out.ok()) << out.status();
  for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << r.status;
  ASSERT_TRUE((*out)[0].parity.has_value());
  EXPECT_TRUE((*out)[0].parity->ok) << (*out)[0].parity->ToString();
}

// HSDP with sequence and context parallelism: parameters are not split over the SP or CP
// groups (SEMANTICS.md §12, §16), so the shard groups need nothing of them; the gradients
// still match the reference. (world, P, S, C, shard group)
TEST(HsdpParityTest, WithSequenceAndContextParallelismMatchesReference) {
  for (const auto& [W, P, S, C, N] : std::vector<std::tuple<int, int, int, int, int>>{
           {4, 2, 2, 1, 2}, {4, 1, 1, 2, 2}, {8, 2, 2, 2, 4}, {8, 1, 1, 2, 2}}) {
    TrainConfig config = AttentionConfig(W, P, S, 1, TrainConfig::hsdp, TrainConfig::token);
    config.mutable_parallelism()->set_cp(C);
    config.mutable_parallelism()->set_shard_group(N);
    const std::string what = absl::StrCat("world ", W, " P ", P, " S ", S, " C ", C, " N ", N);
    absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
    ASSERT_TRUE(out.ok()) << what << ": " << out.status();
    for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << what << ": " << r.status;
    const RankOutcome& r0 = (*out)[0];
    ASSERT_TRUE(r0.parity.has_value());
    EXPECT_TRUE(r0.parity->ok) << what << "\n" << r0.parity->ToString();
    EXPECT_LE(r0.parity->worst, 1e-5) << what;
    for (const RankOutcome& r : *out) {
      EXPECT_EQ(*r.first_step_grads, *r0.first_step_grads) << what;
    }
  }
}

// Multi-token prediction (SEMANTICS.md §15.1): the MTP blocks' gradients and each depth's
// loss term equal the fp64 reference's (which rolls the depths' inputs and labels itself
// from the whole sequences) at world 1 / 2 / 4, EP 1 / 2, G 1 / 2, SP 2, CP 2 and SP 2 x CP 2,
// with and without attention, in the three CE weightings. The documents (2 to 12 tokens in
// 16-token sequences) give every rank a different number of valid labels at each depth.
// (mtp_depth, attention, world, P, S, C, G, sharding, CE mode)
using MtpCase =
    std::tuple<int, bool, int, int, int, int, int, TrainConfig::Sharding, TrainConfig::CeMode>;

class MtpParityTest : public ::testing::TestWithParam<MtpCase> {};

TrainConfig MtpConfig(const MtpCase& c) {
  const auto [k, attention, world, P, S, C, G, sharding, ce_mode] = c;
  TrainConfig config = attention ? AttentionConfig(world, P, S, G, sharding, ce_mode)
                                 : TinyConfig(world, P, G, sharding);
  config.mutable_loss()->set_ce_mode(ce_mode);
  config.mutable_parallelism()->set_cp(C);
  config.mutable_model()->set_mtp_depth(k);
  config.mutable_loss()->set_mtp_scale(0.3);
  config.mutable_debug()->set_parity_check(true);
  return config;
}

TEST_P(MtpParityTest, StepOneMatchesReference) {
  const auto [k, attention, world, P, S, C, G, sharding, ce_mode] = GetParam();
  const TrainConfig config = MtpConfig(GetParam());
  absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
  ASSERT_TRUE(out.ok()) << out.status();
  for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << r.status;
  const RankOutcome& r0 = (*out)[0];
  ASSERT_TRUE(r0.parity.has_value());
  EXPECT_TRUE(r0.parity->ok) << r0.parity->ToString();
  EXPECT_LE(r0.parity->worst, 1e-5);
  // emb; L = 2 layers; final_norm, out; per depth hnorm, enorm, proj_h, proj_e and a layer.
  const size_t layer = (attention ? 5 : 0) + 2 + 4 * 3;
  EXPECT_EQ(r0.parity->params.size(), 1 + 2 * layer + 2 + k * (4 + layer));
  EXPECT_EQ(r0.parity->losses.size(), 3u + k);
  ASSERT_EQ(r0.history[0].mtp_size(), k);
  double total = r0.history[0].ce() + r0.history[0].z() + r0.history[0].bal();
  for (int j = 0; j < k; ++j) {
    EXPECT_GT(r0.history[0].mtp(j), 0.0) << "depth " << j + 1;
    total += r0.history[0].mtp(j);
  }
  EXPECT_NEAR(r0.history[0].loss(), total, 1e-12 * total);
  // maxvio per MoE layer: the L main ones and the k MTP layers.
  EXPECT_EQ(r0.history[0].maxvio_size(), 2 + k);
  for (const RankOutcome& r : *out) {
    ASSERT_TRUE(r.first_step_grads.has_value());
    EXPECT_EQ(*r.first_step_grads, *r0.first_step_grads);
    EXPECT_EQ(r.history[0].ce(), r0.history[0].ce());
    EXPECT_EQ(r.history[0].mtp_size(), k);
  }
}

std::string MtpCaseName(const ::testing::TestParamInfo<MtpCase>& info) {
  const auto [k, attention, world, P, S, C, G, sharding, ce_mode] = info.param;
  return absl::StrCat("K", k, attention ? "_attn" : "_tok", "_W", world, "P", P, "S", S, "C", C,
                      "G", G, "_", TrainConfig::Sharding_Name(sharding), "_",
                      TrainConfig::CeMode_Name(ce_mode));
}

std::vector<MtpCase> MtpCases() {
  using T = TrainConfig;
  std::vector<MtpCase> cases;
  for (int k : {1, 2}) {
    // The per-token model: world 1 / 2 / 4, EP 1 / 2, G 1 / 2.
    for (const auto& [W, P] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {2, 2}, {4, 2}}) {
      for (int G : {1, 2}) cases.push_back({k, false, W, P, 1, 1, G, T::fsdp, T::token});
    }
    cases.push_back({k, false, 2, 2, 1, 1, 2, T::replicated, T::sample});
    cases.push_back({k, false, 4, 1, 1, 1, 1, T::fsdp, T::square});
    // Attention: alone, SP 2, CP 2, SP 2 x CP 2, with EP and G.
    cases.push_back({k, true, 1, 1, 1, 1, 1, T::fsdp, T::token});
    cases.push_back({k, true, 2, 2, 1, 1, 2, T::fsdp, T::token});
    cases.push_back({k, true, 4, 1, 2, 1, 1, T::fsdp, T::token});
    cases.push_back({k, true, 4, 2, 2, 1, 2, T::replicated, T::sample});
    cases.push_back({k, true, 4, 1, 1, 2, 2, T::fsdp, T::token});
    cases.push_back({k, true, 4, 2, 1, 2, 1, T::fsdp, T::square});
    cases.push_back({k, true, 8, 2, 2, 2, 2, T::fsdp, T::sample});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Meshes, MtpParityTest, ::testing::ValuesIn(MtpCases()), MtpCaseName);

// A rank whose tokens are all padding contributes exactly zero, and ranks with uneven
// numbers of valid depth-k labels are counted right: one document of 17 to 20 tokens per
// 32-token sequence over S = 4 leaves the last rank of each SP group only padding (checked
// below), and the MTP parity still holds.
TEST(MtpParityTest, PaddedSlicesContributeNothing) {
  for (int k : {1, 2}) {
    TrainConfig config = AttentionConfig(4, 1, 4, 1, TrainConfig::fsdp, TrainConfig::sample);
    config.mutable_data()->set_seq_len(32);
    config.mutable_data()->set_max_doc_len(20);
    config.mutable_data()->set_min_doc_len(17);
    config.mutable_data()->set_micro_batch(1);
    config.mutable_data()->set_corpus_documents(3);
    config.mutable_model()->set_mtp_depth(k);
    // The case this test is for is there: step 1 leaves a rank only padding, and the
    // others hold different numbers of valid depth-k labels.
    absl::StatusOr<std::shared_ptr<const data::DocumentSource>> corpus =
        data::MakeCorpus(config.data());
    ASSERT_TRUE(corpus.ok()) << corpus.status();
    int padded = 0;
    std::set<int64_t> valid_counts;
    for (int r = 0; r < 4; ++r) {
      ParallelismConfig sp4;  // world 4, SP 4: one data rank, a quarter of each sequence
      sp4.set_world(4);
      sp4.set_sp(4);
      absl::StatusOr<data::DataPlace> place = data::DataPlaceOf(sp4, 32, r);
      ASSERT_TRUE(place.ok()) << place.status();
      absl::StatusOr<data::RankDataLoader> loader =
          data::RankDataLoader::Create(*corpus, config.data(), *place);
      ASSERT_TRUE(loader.ok()) << loader.status();
      ASSERT_TRUE(loader->SetLabelStreams(k + 1).ok());
      const data::MicroBatch mb = loader->NextStep(1)[0];
      padded += mb.routed_tokens() == 0;
      int64_t valid = 0;
      for (int32_t y : mb.extra_streams[k - 1].labels) valid += y != data::kIgnoreIndex;
      valid_counts.insert(valid);
    }
    EXPECT_GE(padded, 1) << "depth " << k;
    EXPECT_GE(valid_counts.size(), 2u) << "depth " << k;
    absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
    ASSERT_TRUE(out.ok()) << out.status();
    for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << r.status;
    ASSERT_TRUE((*out)[0].parity.has_value());
    EXPECT_TRUE((*out)[0].parity->ok) << (*out)[0].parity->ToString();
  }
}

// MTP changes the gradients of the shared parameters (it is not a no-op), and mtp_scale
// weighs its terms: the mtp_<j> values scale linearly with it, the main ce does not move.
TEST(MtpParityTest, MtpMattersAndItsScaleWeighsItsTerms) {
  TrainConfig off = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  TrainConfig on = off;
  on.mutable_model()->set_mtp_depth(2);
  TrainConfig doubled = on;
  doubled.mutable_loss()->set_mtp_scale(0.2);
  auto a = RunInProcess(off);
  auto b = RunInProcess(on);
  auto c = RunInProcess(doubled);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_TRUE((*a)[0].status.ok() && (*b)[0].status.ok() && (*c)[0].status.ok());
  EXPECT_EQ((*a)[0].history[0].ce(), (*b)[0].history[0].ce());
  EXPECT_NE((*a)[0].history[0].loss(), (*b)[0].history[0].loss());
  EXPECT_NE((*a)[0].history[0].grad_norm(), (*b)[0].history[0].grad_norm());
  for (int j = 0; j < 2; ++j) {
    EXPECT_NEAR((*c)[0].history[0].mtp(j), 2 * (*b)[0].history[0].mtp(j),
                1e-6 * (*b)[0].history[0].mtp(j));
  }
}

// The CE options (§3.2) with MTP (§15.1): each depth's head takes the same options, and a
// depth's output z-loss stays in its own mtp_<j> term (the fp64 reference computes both from
// their definitions), so z_out is the main head's alone: bit for bit the z_out of the same
// step without MTP (step 1's main-model weights do not depend on mtp_depth). Under EP, SP,
// CP and G.
TEST(MtpParityTest, CeOptionsMatchTheReference) {
  for (const MtpCase& c :
       {MtpCase{2, true, 4, 2, 2, 1, 2, TrainConfig::fsdp, TrainConfig::token},
        MtpCase{1, true, 4, 1, 1, 2, 2, TrainConfig::fsdp, TrainConfig::sample},
        MtpCase{2, false, 2, 2, 1, 1, 2, TrainConfig::replicated, TrainConfig::square}}) {
    const int k = std::get<0>(c);
    TrainConfig config = MtpConfig(c);
    config.mutable_loss()->set_label_smoothing(0.1);
    config.mutable_loss()->set_logit_softcap(0.5);
    config.mutable_loss()->set_alpha_lse(0.02);
    TrainConfig no_mtp = config;
    no_mtp.mutable_model()->set_mtp_depth(0);
    no_mtp.mutable_loss()->clear_mtp_scale();  // without MTP, a scale is refused as unused
    TrainConfig no_z_out = config;
    no_z_out.mutable_loss()->set_alpha_lse(0);
    absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
    absl::StatusOr<std::vector<RankOutcome>> base = RunInProcess(no_mtp);
    absl::StatusOr<std::vector<RankOutcome>> plain = RunInProcess(no_z_out);
    ASSERT_TRUE(out.ok() && base.ok() && plain.ok());
    for (const auto* o : {&*out, &*base, &*plain}) {
      for (const RankOutcome& r : *o) ASSERT_TRUE(r.status.ok()) << r.status;
    }
    const std::string name = MtpCaseName({c, 0});
    const RankOutcome& r0 = (*out)[0];
    ASSERT_TRUE(r0.parity.has_value());
    EXPECT_TRUE(r0.parity->ok) << name << "\n" << r0.parity->ToString();
    EXPECT_LE(r0.parity->worst, 1e-5) << name;
    // ce, z, bal, z_out and one row per depth.
    EXPECT_EQ(r0.parity->losses.size(), 4u + k) << name;
    const StepMetrics& s1 = r0.history[0];
    ASSERT_TRUE(s1.has_z_out()) << name;
    ASSERT_EQ(s1.mtp_size(), k) << name;
    EXPECT_EQ(s1.z_out(), (*base)[0].history[0].z_out()) << name;
    EXPECT_EQ(s1.ce(), (*base)[0].history[0].ce()) << name;
    double total = s1.ce() + s1.z() + s1.bal() + s1.z_out();
    for (int j = 0; j < k; ++j) {
      total += s1.mtp(j);
      // The depth's own output z-loss is in its term: it grows with alpha_lse.
      EXPECT_GT(s1.mtp(j), (*plain)[0].history[0].mtp(j)) << name << " depth " << j + 1;
    }
    EXPECT_NEAR(s1.loss(), total, 1e-12 * total) << name;
  }
}

// Activation recomputation (§14) keeps its bits with MTP: the MTP layers are re-run like
// the main ones.
TEST(MtpParityTest, RecomputationKeepsTheBits) {
  TrainConfig none = MtpConfig({2, true, 2, 2, 2, 1, 2, TrainConfig::fsdp, TrainConfig::token});
  auto base = RunInProcess(none);
  ASSERT_TRUE(base.ok() && (*base)[0].status.ok());
  for (auto mode : {ParallelismConfig::selective, ParallelismConfig::full}) {
    TrainConfig config = none;
    config.mutable_parallelism()->set_recompute(mode);
    auto out = RunInProcess(config);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
    EXPECT_EQ(*(*out)[0].first_step_grads, *(*base)[0].first_step_grads);
    EXPECT_EQ((*out)[0].history[0].mtp(1), (*base)[0].history[0].mtp(1));
  }
}

}  // namespace
}  // namespace gradsum::train
