// The expert bias of SEMANTICS.md §5.1 (aux-loss-free balancing) in the trainer: the sign
// update against a plain recomputation from the step's counts, no effect when off, the same
// bias under full recomputation, across meshes in reproducible mode, through checkpoints,
// --export and --init_from, sigmoid scores, and bad settings.

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/safetensors.h"
#include "train/checkpointing.h"
#include "train/config.h"
#include "train/debugging.h"
#include "train/metrics.pb.h"
#include "train/test_util.h"

namespace gradsum::train {
namespace {

using ::testing::HasSubstr;

constexpr double kSpeed = 0.01;

std::string Dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/expert_bias_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::vector<StepMetrics> TrainOrDie(const TrainConfig& config) {
  auto out = RunInProcess(config);
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  for (const RankOutcome& r : *out) EXPECT_TRUE(r.status.ok()) << r.status;
  if (config.debug().parity_check()) {
    EXPECT_TRUE((*out)[0].parity.has_value() && (*out)[0].parity->ok)
        << ((*out)[0].parity.has_value() ? (*out)[0].parity->ToString() : "no parity report");
  }
  return (*out)[0].history;
}

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The bias an --export file holds (empty when it holds none).
model::ExpertBias ExportedBias(const std::string& path, const ModelConfig& model) {
  model::ExpertBias bias;
  absl::StatusOr<NamedParams> params = ReadParamsFile(path, model, &bias);
  EXPECT_TRUE(params.ok()) << params.status();
  return bias;
}

// TinyConfig with the bias on and an export file.
TrainConfig BiasConfig(int world, int ep, int grad_acc, int steps, const std::string& export_path) {
  TrainConfig c = TinyConfig(world, ep, grad_acc, TrainConfig::fsdp);
  c.mutable_optim()->set_steps(steps);
  c.mutable_loss()->set_expert_bias_speed(kSpeed);
  c.mutable_checkpoint()->set_export_path(export_path);
  return c;
}

// The update, recomputed plainly from each step's logged global counts (tokens_per_expert,
// the display's sum over the micro-batches): b_e += u sign(mean_e c_e - c_e) in fp32, the
// mean and the comparison in double.
TEST(ExpertBiasTest, SignUpdateMatchesARecomputationFromTheStepCounts) {
  const std::string dir = Dir("sign");
  TrainConfig config = BiasConfig(2, 2, 2, 5, dir + "/final.safetensors");
  config.mutable_debug()->set_parity_check(true);  // step 1 routes as the reference does
  const std::vector<StepMetrics> h = TrainOrDie(config);
  ASSERT_EQ(h.size(), 5u);
  const int L = config.model().layers(), E = config.model().experts(), K = config.model().top_k();
  std::vector<std::vector<float>> want(L, std::vector<float>(E, 0.0f));
  const float u = static_cast<float>(kSpeed);
  int moved = 0;
  for (const StepMetrics& r : h) {
    ASSERT_EQ(r.tokens_per_expert_size(), L * E) << "step " << r.step();
    for (int l = 0; l < L; ++l) {
      double sum = 0;
      for (int e = 0; e < E; ++e) sum += r.tokens_per_expert(l * E + e);
      // Counted once per routed token and slot: a training forward, never twice.
      EXPECT_EQ(sum, static_cast<double>(K) * r.routed_tokens()) << "step " << r.step();
      const double mean = sum / E;
      for (int e = 0; e < E; ++e) {
        const double c = r.tokens_per_expert(l * E + e);
        if (c < mean) want[l][e] += u;  // under-loaded: pushed up
        if (c > mean) want[l][e] -= u;  // over-loaded: pushed down
        moved += c != mean;
      }
    }
  }
  EXPECT_GT(moved, 0);
  const model::ExpertBias got = ExportedBias(dir + "/final.safetensors", config.model());
  ASSERT_EQ(got.size(), static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    for (int e = 0; e < E; ++e) {
      EXPECT_EQ(got[l][e], want[l][e]) << "layer " << l << " expert " << e;
    }
  }
}

// --expert_bias_speed=0 is the default: the same export bytes as a run without the flag,
// and no bias in the file.
TEST(ExpertBiasTest, ZeroSpeedLeavesTheResultsBitIdentical) {
  const std::string dir = Dir("zero");
  TrainConfig plain = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  plain.mutable_optim()->set_steps(4);
  plain.mutable_checkpoint()->set_export_path(dir + "/plain.safetensors");
  TrainOrDie(plain);
  TrainConfig zero = plain;
  zero.mutable_loss()->set_expert_bias_speed(0.0);
  zero.mutable_checkpoint()->set_export_path(dir + "/zero.safetensors");
  TrainOrDie(zero);
  const std::string a = FileBytes(dir + "/plain.safetensors");
  ASSERT_FALSE(a.empty());
  EXPECT_TRUE(a == FileBytes(dir + "/zero.safetensors"));
  EXPECT_TRUE(ExportedBias(dir + "/zero.safetensors", zero.model()).empty());
  // And a run with the bias on does differ (the check above can fail).
  TrainConfig on = BiasConfig(2, 2, 2, 4, dir + "/on.safetensors");
  TrainOrDie(on);
  EXPECT_FALSE(a == FileBytes(dir + "/on.safetensors"));
}

// recompute=full re-runs each layer's forward in backward from the first forward's routes;
// it must not count again (the bias would move by other counts) nor change any bit.
TEST(ExpertBiasTest, FullRecomputationGivesTheSameBias) {
  const std::string dir = Dir("recompute");
  TrainConfig none = BiasConfig(2, 2, 2, 4, dir + "/none.safetensors");
  TrainConfig full = BiasConfig(2, 2, 2, 4, dir + "/full.safetensors");
  full.mutable_parallelism()->set_recompute(ParallelismConfig::full);
  const std::vector<StepMetrics> a = TrainOrDie(none), b = TrainOrDie(full);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].ce(), b[i].ce()) << "step " << i + 1;
    ASSERT_EQ(a[i].tokens_per_expert_size(), b[i].tokens_per_expert_size());
    for (int j = 0; j < a[i].tokens_per_expert_size(); ++j) {
      EXPECT_EQ(a[i].tokens_per_expert(j), b[i].tokens_per_expert(j)) << "step " << i + 1;
    }
  }
  const std::string bytes = FileBytes(dir + "/none.safetensors");
  EXPECT_FALSE(ExportedBias(dir + "/none.safetensors", none.model()).empty());
  EXPECT_TRUE(bytes == FileBytes(dir + "/full.safetensors"));
}

// Reproducible mode: world 1 and a world-2 EP mesh give the same bits (the counts are exact
// integers), and so does a run checkpointed on one mesh and resumed on another, whose
// commit marker carries the bias.
TEST(ExpertBiasTest, ReproducibleAcrossMeshesAndAResume) {
  const std::string dir = Dir("mesh");
  auto mesh = [&](int world, int ep, int micro_batch, int steps, const std::string& out) {
    TrainConfig c = BiasConfig(world, ep, 1, steps, out);
    c.mutable_data()->set_micro_batch(micro_batch);
    c.mutable_precision()->set_reproducible(true);
    return c;
  };
  TrainOrDie(mesh(1, 1, 4, 6, dir + "/w1.safetensors"));
  TrainOrDie(mesh(2, 2, 2, 6, dir + "/w2.safetensors"));
  const std::string want = FileBytes(dir + "/w1.safetensors");
  ASSERT_FALSE(want.empty());
  EXPECT_TRUE(want == FileBytes(dir + "/w2.safetensors")) << "world 1 vs world 2, ep 2";

  TrainConfig first = mesh(2, 2, 2, 3, "");
  first.mutable_checkpoint()->set_dir(dir + "/ckpt");
  TrainOrDie(first);
  absl::StatusOr<CheckpointInfo> info = ReadCheckpointInfo(CheckpointPath(dir + "/ckpt", 3));
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->extra.count("expert_bias"), 1u);
  absl::StatusOr<std::vector<std::vector<float>>> saved =
      ParseExpertBias(info->extra.at("expert_bias"));
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->size(), 2u);
  TrainConfig second = mesh(1, 1, 4, 6, dir + "/resumed.safetensors");
  second.mutable_checkpoint()->set_dir(dir + "/ckpt");
  second.mutable_checkpoint()->set_resume(true);
  TrainOrDie(second);
  EXPECT_TRUE(want == FileBytes(dir + "/resumed.safetensors"))
      << "resumed from world 2 onto world 1";
}

TEST(ExpertBiasTest, MarkerTextReadsBackEveryFloatExactly) {
  const std::vector<std::vector<float>> bias = {{0.0f, -0.0099999998f, 1e-30f, -3.4e38f},
                                                {0.1f, 0.2f, 0.3f, 1.0f / 3.0f}};
  absl::StatusOr<std::vector<std::vector<float>>> back = ParseExpertBias(ExpertBiasText(bias));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, bias);
  EXPECT_EQ(ParseExpertBias("0.1,x;0.2,0.3").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ParseExpertBias("0.1,0.2;0.3").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ParseExpertBias("0.1,inf").status().code(), absl::StatusCode::kDataLoss);
}

// --init_from carries an exported bias: with the speed at 0 it stays as it was, step 1 routes
// with it (the parity reference does too), and the dump and the next export hold it.
TEST(ExpertBiasTest, InitFromCarriesTheBias) {
  const std::string dir = Dir("init_from");
  TrainConfig a = BiasConfig(2, 2, 2, 3, dir + "/a.safetensors");
  TrainOrDie(a);
  const model::ExpertBias bias = ExportedBias(dir + "/a.safetensors", a.model());
  ASSERT_FALSE(bias.empty());
  TrainConfig b = TinyConfig(2, 1, 1, TrainConfig::replicated);
  b.mutable_optim()->set_steps(2);
  b.mutable_checkpoint()->set_init_from(dir + "/a.safetensors");
  b.mutable_checkpoint()->set_export_path(dir + "/b.safetensors");
  b.mutable_debug()->set_dump_dir(dir + "/dump");
  b.mutable_debug()->set_parity_check(true);
  TrainOrDie(b);
  EXPECT_EQ(ExportedBias(dir + "/b.safetensors", b.model()), bias);
  EXPECT_EQ(ExportedBias(dir + "/dump/weights.safetensors", b.model()), bias);
}

// A file with the bias of some layers only is refused, naming the problem.
TEST(ExpertBiasTest, InitFromRefusesAPartialBias) {
  const std::string dir = Dir("partial");
  TrainConfig config = TinyConfig(1, 1, 1, TrainConfig::fsdp);
  const NamedParams init = MoeLm::InitialParameters(config.model(), config.model().seed());
  SafetensorsWriter w;
  for (const auto& [name, shape] : MoeLmParamShapes(config.model())) {
    auto view = TensorView::Create(const_cast<float*>(init.at(name).data()), DType::kF32, shape);
    ASSERT_TRUE(view.ok());
    ASSERT_TRUE(w.Add(name, *view).ok());
  }
  std::vector<float> one_layer(config.model().experts(), 0.5f);
  auto view = TensorView::Create(one_layer.data(), DType::kF32, {config.model().experts()});
  ASSERT_TRUE(view.ok());
  ASSERT_TRUE(w.Add(ExpertBiasTensorName(0), *view).ok());
  ASSERT_TRUE(w.WriteFile(dir + "/partial.safetensors").ok());
  model::ExpertBias bias;
  absl::StatusOr<NamedParams> read =
      ReadParamsFile(dir + "/partial.safetensors", config.model(), &bias);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(read.status().message(), HasSubstr("expert bias of 1 of the 2 layers"));
}

// Sigmoid scores (DeepSeek-V3) with the bias and alpha_b = 0: trains, and step 1 matches
// the double reference's sigmoid router.
TEST(ExpertBiasTest, SigmoidScoresTrainAndMatchTheReference) {
  const std::string dir = Dir("sigmoid");
  TrainConfig config = BiasConfig(2, 2, 2, 4, dir + "/final.safetensors");
  config.mutable_model()->set_router_score(ModelConfig::sigmoid);
  config.mutable_loss()->set_alpha_b(0);
  config.mutable_debug()->set_parity_check(true);
  const std::vector<StepMetrics> h = TrainOrDie(config);
  ASSERT_EQ(h.size(), 4u);
  for (const StepMetrics& r : h) {
    EXPECT_TRUE(std::isfinite(r.loss())) << "step " << r.step();
    EXPECT_EQ(r.bal(), 0.0);
  }
  EXPECT_LT(h.back().ce(), h.front().ce());
}

TEST(ExpertBiasTest, BadSettingsAreInvalidArgumentNamingTheValue) {
  for (const auto& [value, shown] :
       std::vector<std::pair<std::string, std::string>>{{"-0.001", "loss.expert_bias_speed=-0.001"},
                                                        {"nan", "loss.expert_bias_speed=nan"},
                                                        {"inf", "loss.expert_bias_speed=inf"}}) {
    TrainConfig c = TinyConfig(1, 1, 1, TrainConfig::fsdp);
    ASSERT_TRUE(ApplyOverrides({{"loss.expert_bias_speed", value}}, &c).ok()) << value;
    const absl::Status s = ValidateConfig(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_THAT(s.message(), HasSubstr(shown));
  }
  TrainConfig sigmoid = TinyConfig(1, 1, 1, TrainConfig::fsdp);  // alpha_b = 0.01
  ASSERT_TRUE(ApplyOverrides({{"model.router_score", "sigmoid"}}, &sigmoid).ok());
  const absl::Status s = ValidateConfig(sigmoid);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.router_score=sigmoid"));
  EXPECT_THAT(s.message(), HasSubstr("needs loss.alpha_b=0 (got 0.01)"));
  TrainConfig bogus = TinyConfig(1, 1, 1, TrainConfig::fsdp);
  const absl::Status b = ApplyOverrides({{"model.router_score", "bogus"}}, &bogus);
  EXPECT_EQ(b.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.message(), HasSubstr("bogus"));
  EXPECT_THAT(b.message(), HasSubstr("softmax or sigmoid"));
}

}  // namespace
}  // namespace gradsum::train
