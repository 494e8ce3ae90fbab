#include "train/trainer.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "sharding/atomic_file.h"
#include "sharding/checkpoint.pb.h"
#include "sharding/proto_json.h"
#include "sharding/safetensors.h"
#include "testing/run_ranks.h"
#include "train/config.h"
#include "train/metrics.pb.h"
#include "train/moe_lm.h"
#include "train/rank_main.h"
#include "train/test_util.h"

namespace gradsum::train {
namespace {

using ::testing::HasSubstr;

// 300 steps on the default (embedded Markov) corpus bring the CE within 10% of the
// chain's entropy floor. A small model keeps it fast; the corpus is the default one.
TEST(TrainerTest, ThreeHundredStepsReachTheEntropyFloor) {
  TrainConfig config;  // default corpus, world 2, ep 2, G 2, fsdp
  config.set_steps(300);
  config.mutable_model()->set_dim(32);
  config.mutable_model()->set_expert_dim(32);
  config.mutable_data()->set_micro_batch(2);
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
  const std::vector<StepRecord>& h = (*out)[0].history;
  ASSERT_EQ(h.size(), 300u);
  double tail = 0;
  for (size_t i = h.size() - 20; i < h.size(); ++i) tail += h[i].ce / 20;
  const double floor = MarkovCorpus(config.data()).EntropyFloorNats();
  EXPECT_GT(h.front().ce, 2 * floor);  // it did have something to learn
  EXPECT_LT(tail, 1.10 * floor) << "floor " << floor;
  EXPECT_GT(tail, 0.9 * floor) << "below the floor: the labels would leak";
  // The step's time split: model (forward, backward, reduction) and update are disjoint
  // parts of the step.
  for (const StepRecord& r : h) {
    EXPECT_GT(r.model_seconds, 0);
    EXPECT_GT(r.update_seconds, 0);
    EXPECT_LE(r.model_seconds + r.update_seconds, r.step_seconds);
  }
}

TEST(TrainerTest, DumpWritesTheNamedFiles) {
  const std::string dir = ::testing::TempDir() + "/dump";
  std::filesystem::remove_all(dir);
  TrainConfig config = TinyConfig(4, 2, 2, TrainConfig::fsdp);
  config.set_dump_dir(dir);
  config.set_steps(2);
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;

  // weights: the initial parameters, every name with its shape.
  auto weights = SafetensorsFile::Read(dir + "/weights.safetensors");
  ASSERT_TRUE(weights.ok()) << weights.status();
  const NamedParams init = MoeLm::InitialParameters(config.model(), config.seed());
  const auto shapes = MoeLmParamShapes(config.model());
  EXPECT_EQ(weights->num_tensors(), static_cast<int>(shapes.size()));
  for (const auto& [name, shape] : shapes) {
    auto t = weights->Get(name);
    ASSERT_TRUE(t.ok()) << name;
    EXPECT_EQ(t->shape(), shape) << name;
    EXPECT_EQ(t->dtype(), DType::kF32);
    const std::vector<float>& want = init.at(name);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), t->data<float>())) << name;
  }
  EXPECT_TRUE(weights->Contains("layers.1.experts.3.wd"));
  EXPECT_EQ(weights->Get("layers.1.experts.3.wd")->shape(), (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(weights->Get("emb")->shape(), (std::vector<int64_t>{256, 8}));
  EXPECT_EQ(weights->Get("out")->shape(), (std::vector<int64_t>{8, 256}));

  // grads: the step-1 reduced gradients, as the trainer computed them.
  auto grads = SafetensorsFile::Read(dir + "/grads.safetensors");
  ASSERT_TRUE(grads.ok()) << grads.status();
  for (const auto& [name, values] : *(*out)[0].first_step_grads) {
    auto t = grads->Get(name);
    ASSERT_TRUE(t.ok()) << name;
    EXPECT_TRUE(std::equal(values.begin(), values.end(), t->data<float>())) << name;
  }

  // batches: one file per rank and micro-batch, the loader's step-1 data, int64 [B, S].
  auto global = GlobalBatchForStep(config, 0);
  ASSERT_TRUE(global.ok());
  for (int r = 0; r < 4; ++r) {
    for (int m = 0; m < 2; ++m) {
      auto b = SafetensorsFile::Read(dir + "/batch.r" + std::to_string(r) + ".m" +
                                     std::to_string(m) + ".safetensors");
      ASSERT_TRUE(b.ok()) << b.status();
      const MicroBatch& want = (*global)[m][r];
      for (const auto& [name, v] :
           {std::pair<const char*, const std::vector<int32_t>*>{"tokens", &want.tokens},
            {"labels", &want.labels},
            {"mask", &want.mask}}) {
        auto t = b->Get(name);
        ASSERT_TRUE(t.ok()) << name;
        EXPECT_EQ(t->dtype(), DType::kI64);
        EXPECT_EQ(t->shape(), (std::vector<int64_t>{2, 16}));
        for (size_t i = 0; i < v->size(); ++i) ASSERT_EQ(t->data<int64_t>()[i], (*v)[i]) << name;
      }
      auto ids = b->Get("sample_ids");  // which packed document each token belongs to
      ASSERT_TRUE(ids.ok()) << ids.status();
      ASSERT_EQ(ids->dtype(), DType::kI64);
      ASSERT_EQ(ids->shape(), (std::vector<int64_t>{2, 16}));
      for (size_t i = 0; i < want.sample_ids.size(); ++i) {
        ASSERT_EQ(ids->data<int64_t>()[i], want.sample_ids[i]) << "sample_ids " << i;
      }
    }
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/batch.r4.m0.safetensors"));

  // losses.json: the step-1 display values and the config.
  std::ifstream in(dir + "/losses.json");
  std::stringstream ss;
  ss << in.rdbuf();
  DumpedLosses losses;
  ASSERT_TRUE(ProtoFromJson(ss.str(), &losses).ok()) << ss.str();
  EXPECT_EQ(FirstMissingField(losses), "");
  const StepRecord& s1 = (*out)[0].history[0];
  EXPECT_EQ(losses.step(), 1);
  EXPECT_EQ(losses.ce(), s1.ce);
  EXPECT_EQ(losses.z(), s1.z);
  EXPECT_EQ(losses.bal(), s1.bal);
  EXPECT_EQ(losses.valid_tokens(), s1.valid_tokens);
  EXPECT_THAT(ss.str(), HasSubstr(absl::StrCat("\"valid_tokens\":\"", s1.valid_tokens, "\"")));
  EXPECT_THAT(losses.config(), HasSubstr("world: 4"));
}

// Resuming from a checkpoint continues bit-exactly: the same losses and grad norms as an
// uninterrupted run (the kill -9 variant is resume_kill_test.sh).
TEST(TrainerTest, ResumeContinuesBitExactly) {
  for (auto sharding : {TrainConfig::fsdp, TrainConfig::replicated}) {
    const std::string dir = ::testing::TempDir() + "/ckpt_" + TrainConfig::Sharding_Name(sharding);
    std::filesystem::remove_all(dir);
    TrainConfig full = TinyConfig(4, 2, 2, sharding);
    full.set_steps(6);
    auto reference = RunInProcess(full);
    ASSERT_TRUE(reference.ok() && (*reference)[0].status.ok());

    TrainConfig first = full;
    first.set_steps(3);
    first.set_checkpoint_dir(dir);
    auto a = RunInProcess(first);
    ASSERT_TRUE(a.ok() && (*a)[0].status.ok()) << (*a)[0].status;
    absl::StatusOr<int64_t> latest = LatestCheckpointStep(dir);
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ(*latest, 3);

    TrainConfig second = full;
    second.set_checkpoint_dir(dir);
    second.set_resume(true);
    auto b = RunInProcess(second);
    ASSERT_TRUE(b.ok() && (*b)[0].status.ok()) << (*b)[0].status;
    const std::vector<StepRecord>& resumed = (*b)[0].history;
    ASSERT_EQ(resumed.size(), 3u);
    for (int i = 0; i < 3; ++i) {
      const StepRecord& want = (*reference)[0].history[3 + i];
      EXPECT_EQ(resumed[i].step, want.step);
      EXPECT_EQ(resumed[i].ce, want.ce) << sharding << " step " << want.step;
      EXPECT_EQ(resumed[i].bal, want.bal);
      EXPECT_EQ(resumed[i].z, want.z);
      EXPECT_EQ(resumed[i].grad_norm, want.grad_norm);
    }
  }
}

// A checkpoint resumes only under the settings that decide its data stream and model:
// changing G would replay a different number of micro-batches, so it is refused by name,
// while a new learning rate or step count is fine.
TEST(TrainerTest, ResumeRefusesAnotherDataStreamButAllowsNewOptimizerSettings) {
  const std::string dir = ::testing::TempDir() + "/ckpt_compat";
  std::filesystem::remove_all(dir);
  TrainConfig first = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  first.set_steps(2);
  first.set_checkpoint_dir(dir);
  auto a = RunInProcess(first);
  ASSERT_TRUE(a.ok() && (*a)[0].status.ok()) << (*a)[0].status;

  TrainConfig other_g = first;
  other_g.set_steps(4);
  other_g.set_resume(true);
  other_g.set_grad_acc(3);
  auto b = RunInProcess(other_g);
  ASSERT_TRUE(b.ok());
  for (const RankOutcome& r : *b) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
    EXPECT_THAT(r.status.message(), HasSubstr("grad_acc=2 but this run has grad_acc=3"));
  }
  TrainConfig other_model = first;
  other_model.set_resume(true);
  other_model.set_steps(3);
  other_model.mutable_model()->set_router_scale(2.0f);
  auto c = RunInProcess(other_model);
  ASSERT_TRUE(c.ok());
  EXPECT_THAT((*c)[0].status.message(), HasSubstr("model.router_scale=1 but this run has"));

  TrainConfig new_lr = first;
  new_lr.set_resume(true);
  new_lr.set_steps(3);
  new_lr.mutable_optim()->set_lr(0.003);
  auto d = RunInProcess(new_lr);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)[0].status.ok()) << (*d)[0].status;
  ASSERT_EQ((*d)[0].history.size(), 1u);
  EXPECT_EQ((*d)[0].history[0].step, 3);
}

// A commit marker without the config that wrote it proves nothing about the data stream
// and the model: refused, on every rank. The marker is rewritten with a valid fingerprint
// (XXH3 of its other members), so only the missing config can be the reason.
TEST(TrainerTest, ResumeRefusesAMarkerWithoutItsConfig) {
  const std::string dir = ::testing::TempDir() + "/ckpt_no_config";
  std::filesystem::remove_all(dir);
  TrainConfig first = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  first.set_steps(2);
  first.set_checkpoint_dir(dir);
  auto a = RunInProcess(first);
  ASSERT_TRUE(a.ok() && (*a)[0].status.ok()) << (*a)[0].status;
  const std::string marker_path = dir + "/step-00000002/checkpoint.json";
  absl::StatusOr<std::string> text = ReadFileToString(marker_path);
  ASSERT_TRUE(text.ok());
  checkpoint::CommitMarker marker;
  ASSERT_TRUE(ProtoFromJson(*text, &marker).ok()) << *text;
  ASSERT_EQ(marker.extra().count("config"), 1u);
  marker.mutable_extra()->erase("config");
  // The documented fingerprint: XXH3-64 of the marker's JSON without "fingerprint".
  marker.clear_fingerprint();
  absl::StatusOr<std::string> body = ProtoToJson(marker);
  ASSERT_TRUE(body.ok());
  marker.set_fingerprint(absl::StrFormat("%016x", Fingerprint64(*body)));
  absl::StatusOr<std::string> rewritten = ProtoToJson(marker);
  ASSERT_TRUE(rewritten.ok());
  ASSERT_TRUE(WriteFileAtomically(marker_path, *rewritten + "\n").ok());

  TrainConfig again = first;
  again.set_steps(3);
  again.set_resume(true);
  auto b = RunInProcess(again);
  ASSERT_TRUE(b.ok());
  for (const RankOutcome& r : *b) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
    EXPECT_THAT(r.status.message(), HasSubstr("has no \"config\" in its commit marker"));
  }
}

TEST(TrainerTest, ResumeWithoutCheckpointIsNotFound) {
  const std::string dir = ::testing::TempDir() + "/empty_ckpt";
  std::filesystem::create_directories(dir);
  TrainConfig config = TinyConfig(2, 1, 1, TrainConfig::fsdp);
  config.set_checkpoint_dir(dir);
  config.set_resume(true);
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  for (const RankOutcome& r : *out) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kNotFound) << r.status;
    EXPECT_THAT(r.status.message(), HasSubstr(dir));
  }
}

TEST(TrainerTest, CommunicatorsThatDisagreeWithTheConfigAreInvalidArgument) {
  // Resolved: the rank threads read it concurrently (train/config.h ResolvedConfig).
  TrainConfig config = ResolvedConfig(TinyConfig(4, 2, 1, TrainConfig::fsdp));  // but run on 2 ranks
  absl::Status s = testing::RunRanks(2, [&](Communicator& world) -> absl::Status {
    absl::StatusOr<RankMesh> mesh = MakeRankMesh(&world, 2);
    if (!mesh.ok()) return mesh.status();
    return Trainer::Create(config, mesh->comms()).status();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("world=4"));
  config.set_world(2);
  config.set_ep(1);  // but the mesh has EP groups of 2
  s = testing::RunRanks(2, [&](Communicator& world) -> absl::Status {
    absl::StatusOr<RankMesh> mesh = MakeRankMesh(&world, 2);
    if (!mesh.ok()) return mesh.status();
    return Trainer::Create(config, mesh->comms()).status();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("ep=1"));
}

TEST(TrainerTest, BadConfigFailsBeforeTraining) {
  TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  config.mutable_model()->set_experts(3);  // 3 % ep 2 != 0
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT((*out)[0].status.message(), HasSubstr("ep=2"));
  EXPECT_TRUE((*out)[0].history.empty());
}

// bf16 compute and bf16 reduction train, and stay close to the fp32 gradients.
TEST(TrainerTest, Bf16ComputeAndReduceStayNearTheReference) {
  TrainConfig config = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  config.set_compute_dtype(TrainConfig::bf16);
  config.set_reduce_dtype(TrainConfig::bf16);
  config.set_parity_check(true);  // bf16 uses a 2e-2 bar
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
  ASSERT_TRUE((*out)[0].parity.has_value());
  EXPECT_TRUE((*out)[0].parity->ok) << (*out)[0].parity->ToString();
  EXPECT_GT((*out)[0].parity->worst, 1e-6) << "bf16 should not be exact";
}

}  // namespace
}  // namespace gradsum::train
