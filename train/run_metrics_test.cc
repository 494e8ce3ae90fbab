// The trainer's issue-49 fields against independent counts: consumed tokens against the
// running sum of each step's routed tokens (the loader's own count, from the step
// statistics), consumed sequences against step x B, the FLOPs of the per-token model
// against 3 x routed tokens x the matmul FLOPs of a token read off the spec's shapes (the
// attention model's exceed that by its scores), mfu against the configured peak, and a
// --resume continuing the counts of an uninterrupted run.
#include "train/run_metrics.h"

#include <filesystem>
#include <string>
#include <vector>

#include "data/markov.h"
#include "gtest/gtest.h"
#include "model/moe_lm_spec.h"
#include "train/checkpointing.h"
#include "train/config.pb.h"
#include "train/moe_lm.h"
#include "train/test_util.h"

namespace gradsum::train {
namespace {

// Forward matmul FLOPs of a token from the spec's parameters (as model/flops_test.cc); with
// `layers_without_router` only the layers' matrices but their routers (what
// --recompute=full runs twice).
double SpecForwardFlopsPerToken(const TrainConfig& c, bool layers_without_router = false) {
  const model::MoeLmConfig m = ToMoeLmConfig(c.model(), c.loss());
  absl::StatusOr<model::MoeLmSpec> spec = model::MoeLmSpec::Create(m);
  EXPECT_TRUE(spec.ok()) << spec.status();
  double flops = 0;
  for (const model::ParamDef& p : spec->params()) {
    if (p.shape.size() != 2 || p.name == "emb") continue;
    if (layers_without_router && (p.layer < 0 || p.name.find("router") != std::string::npos)) {
      continue;
    }
    const double per_use = 2.0 * p.shape[0] * p.shape[1];
    if (p.name == "out") {
      flops += per_use * (1 + m.mtp_depth);
    } else if (p.expert >= 0) {
      flops += per_use * m.top_k / m.experts;
    } else {
      flops += per_use;
    }
  }
  return flops;
}

std::vector<StepMetrics> Train(const TrainConfig& config) {
  auto ranks = RunInProcess(config);
  EXPECT_TRUE(ranks.ok()) << ranks.status();
  if (!ranks.ok()) return {};
  for (const RankOutcome& r : *ranks) EXPECT_TRUE(r.status.ok()) << r.status;
  return (*ranks)[0].history;
}

TEST(RunMetricsTest, CountsMatchTheStepsOwnTokens) {
  TrainConfig config = TinyConfig(/*world=*/4, /*ep=*/2, /*grad_acc=*/2, TrainConfig::fsdp);
  config.mutable_optim()->set_steps(5);
  config.mutable_log()->set_peak_tflops(0.5);  // every rank: mfu = flops_per_s / (0.5e12 x 4)
  const std::vector<StepMetrics> history = Train(config);
  ASSERT_EQ(history.size(), 5u);
  const int64_t B = 4 * 2 * config.data().micro_batch();
  const double per_token = SpecForwardFlopsPerToken(config);
  int64_t tokens = 0;
  for (const StepMetrics& r : history) {
    tokens += r.routed_tokens();
    EXPECT_EQ(r.consumed_tokens(), tokens) << r.step();
    EXPECT_EQ(r.consumed_sequences(), r.step() * B) << r.step();
    EXPECT_DOUBLE_EQ(r.model_flops(), 3 * r.routed_tokens() * per_token) << r.step();
    EXPECT_DOUBLE_EQ(r.hardware_flops(), r.model_flops());  // no attention, no recompute
    EXPECT_DOUBLE_EQ(r.flops_per_s(), r.model_flops() / r.step_s());
    EXPECT_DOUBLE_EQ(r.mfu(), r.flops_per_s() / (0.5e12 * 4));
    EXPECT_GE(r.data_s(), 0);
    EXPECT_LE(r.data_s(), r.step_s());
    EXPECT_GT(r.peak_rss_bytes(), 1 << 20);
    // The global CE is the weighted mean of the ranks' own: never above their max.
    EXPECT_GE(r.ce_max_rank(), r.ce() * (1 - 1e-12)) << r.step();
    EXPECT_EQ(r.skipped_steps(), 0);
    EXPECT_EQ(r.nonfinite_steps(), 0);
  }
  // The embedded corpus states its floors, and every record carries them (for the plots).
  ASSERT_EQ(config.data().corpus(), DataConfig::markov1);
  const data::MarkovCorpus corpus(config.data());
  ASSERT_GT(corpus.EntropyFloorNats(), 0);
  for (const StepMetrics& r : history) {
    EXPECT_EQ(r.entropy_floor(), corpus.EntropyFloorNats()) << r.step();
    if (corpus.ContextFloorNats() >= 0) {
      EXPECT_EQ(r.context_floor(), corpus.ContextFloorNats()) << r.step();
    } else {
      EXPECT_FALSE(r.has_context_floor()) << r.step();
    }
  }
}

TEST(RunMetricsTest, OneRanksMaxIsTheGlobalCe) {
  TrainConfig config = TinyConfig(1, 1, 2, TrainConfig::fsdp);
  config.mutable_optim()->set_steps(2);
  for (const StepMetrics& r : Train(config)) EXPECT_NEAR(r.ce_max_rank(), r.ce(), 1e-12 * r.ce());
}

TEST(RunMetricsTest, AttentionAndRecomputationAddTheirFlops) {
  TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  config.mutable_model()->set_attention(ModelConfig::causal);
  config.mutable_model()->set_heads(2);
  config.mutable_model()->set_kv_heads(1);
  config.mutable_optim()->set_steps(2);
  const std::vector<StepMetrics> plain = Train(config);
  config.mutable_parallelism()->set_recompute(ParallelismConfig::full);
  const std::vector<StepMetrics> full = Train(config);
  ASSERT_EQ(plain.size(), 2u);
  ASSERT_EQ(full.size(), 2u);
  const double per_token = SpecForwardFlopsPerToken(config);
  for (int i = 0; i < 2; ++i) {
    const double matmuls = 3 * plain[i].routed_tokens() * per_token;
    EXPECT_GT(plain[i].model_flops(), matmuls);                    // the scores
    EXPECT_GT(plain[i].hardware_flops(), plain[i].model_flops());  // backward's scores again
    EXPECT_EQ(full[i].model_flops(), plain[i].model_flops());
    // --recompute=full: every layer's forward again but the router, scores included.
    const double score_forward = (plain[i].model_flops() - matmuls) / 3;
    EXPECT_NEAR(full[i].hardware_flops() - plain[i].hardware_flops(),
                plain[i].routed_tokens() * SpecForwardFlopsPerToken(config, true) + score_forward,
                1e-9 * full[i].hardware_flops());
  }
}

TEST(RunMetricsTest, ResumeContinuesTheConsumedCounts) {
  const std::string dir = ::testing::TempDir() + "/run_metrics_ckpt";
  std::filesystem::remove_all(dir);
  TrainConfig full = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  full.mutable_optim()->set_steps(5);
  const std::vector<StepMetrics> reference = Train(full);
  ASSERT_EQ(reference.size(), 5u);
  TrainConfig first = full;
  first.mutable_optim()->set_steps(3);
  first.mutable_checkpoint()->set_dir(dir);
  ASSERT_EQ(Train(first).size(), 3u);
  TrainConfig second = full;
  second.mutable_checkpoint()->set_dir(dir);
  second.mutable_checkpoint()->set_resume(true);
  const std::vector<StepMetrics> resumed = Train(second);
  ASSERT_EQ(resumed.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const StepMetrics& want = reference[3 + i];
    EXPECT_EQ(resumed[i].step(), want.step());
    EXPECT_EQ(resumed[i].consumed_tokens(), want.consumed_tokens());
    EXPECT_EQ(resumed[i].consumed_sequences(), want.consumed_sequences());
    EXPECT_EQ(resumed[i].model_flops(), want.model_flops());
  }
}

}  // namespace
}  // namespace gradsum::train
