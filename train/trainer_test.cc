#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint.pb.h"
#include "data/corpus.h"
#include "data/loader.h"
#include "data/markov.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/atomic_file.h"
#include "io/dir_lock.h"
#include "io/fingerprint.h"
#include "io/proto_json.h"
#include "io/safetensors.h"
#include "testing/reference_moe_lm.h"
#include "testing/run_ranks.h"
#include "train/checkpointing.h"
#include "train/config.h"
#include "train/debugging.h"
#include "train/metrics.pb.h"
#include "train/moe_lm.h"
#include "train/rank_main.h"
#include "train/stop_signal.h"
#include "train/test_util.h"

namespace gradsum::train {
namespace {

using ::testing::HasSubstr;

// 300 steps of the per-token model on the first-order Markov corpus (the defaults before
// attention) bring the CE within 10% of the chain's entropy floor. A small model keeps it
// fast.
// The binary's defaults (world 2, ep 2, G 2, fsdp) at a small width and micro-batch, as
// the convergence tests train them.
TrainConfig SmallDefaultConfig(int steps) {
  TrainConfig config;
  config.mutable_optim()->set_steps(steps);
  config.mutable_model()->set_dim(32);
  config.mutable_model()->set_expert_dim(32);
  config.mutable_data()->set_micro_batch(2);
  return config;
}

// The mean CE of the last 20 steps.
double TailCe(const std::vector<StepMetrics>& h) {
  double tail = 0;
  for (size_t i = h.size() - 20; i < h.size(); ++i) tail += h[i].ce() / 20;
  return tail;
}

TEST(TrainerTest, ThreeHundredStepsReachTheEntropyFloor) {
  TrainConfig config = SmallDefaultConfig(300);
  config.mutable_model()->set_attention(ModelConfig::none);
  config.mutable_data()->set_corpus(DataConfig::markov1);
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
  const std::vector<StepMetrics>& h = (*out)[0].history;
  ASSERT_EQ(h.size(), 300u);
  const double tail = TailCe(h);
  const double floor = data::MarkovCorpus(config.data()).EntropyFloorNats();
  EXPECT_GT(h.front().ce(), 2 * floor);  // it did have something to learn
  EXPECT_LT(tail, 1.10 * floor) << "floor " << floor;
  EXPECT_GT(tail, 0.9 * floor) << "below the floor: the labels would leak";
  // The step's time split: model (forward, backward, reduction) and update are disjoint
  // parts of the step.
  for (const StepMetrics& r : h) {
    EXPECT_GT(r.model_s(), 0);
    EXPECT_GT(r.update_s(), 0);
    EXPECT_LE(r.model_s() + r.update_s(), r.step_s());
  }
}

// The defaults (the attention block on the order-2 corpus): 500 steps of a small model end
// far below the per-token floor, which only the previous token's context can beat, and
// within 12% of the context floor (the README's job, at its width, ends within 10%), but
// not below it, where the labels would leak through attention.
TEST(TrainerTest, AttentionOnTheDefaultCorpusApproachesTheContextFloor) {
  const TrainConfig config = SmallDefaultConfig(500);  // attention causal, corpus markov2
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
  const std::vector<StepMetrics>& h = (*out)[0].history;
  ASSERT_EQ(h.size(), 500u);
  const double tail = TailCe(h);
  const data::SecondOrderMarkovCorpus corpus(config.data());
  const double per_token = corpus.EntropyFloorNats(), context = corpus.ContextFloorNats();
  EXPECT_LT(tail, 0.6 * per_token) << "per-token floor " << per_token;
  EXPECT_LT(tail, 1.12 * context) << "context floor " << context;
  EXPECT_GT(tail, 0.95 * context) << "below the context floor: the labels would leak";
}

TEST(TrainerTest, DumpWritesTheNamedFiles) {
  const std::string dir = ::testing::TempDir() + "/dump";
  std::filesystem::remove_all(dir);
  TrainConfig config = TinyConfig(4, 2, 2, TrainConfig::fsdp);
  config.mutable_debug()->set_dump_dir(dir);
  config.mutable_optim()->set_steps(2);
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;

  // weights: the initial parameters, every name with its shape.
  auto weights = SafetensorsFile::Read(dir + "/weights.safetensors");
  ASSERT_TRUE(weights.ok()) << weights.status();
  const NamedParams init = MoeLm::InitialParameters(config.model(), config.model().seed());
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
      const data::MicroBatch& want = (*global)[m][r];
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
      // The global index of each row: step 0, (m world + r) micro_batch + j.
      auto seq = b->Get("sequence_ids");
      ASSERT_TRUE(seq.ok()) << seq.status();
      ASSERT_EQ(seq->shape(), (std::vector<int64_t>{2}));
      for (int j = 0; j < 2; ++j) EXPECT_EQ(seq->data<int64_t>()[j], (m * 4 + r) * 2 + j);
    }
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/batch.r4.m0.safetensors"));

  // losses.json: the step-1 display values and the config.
  std::ifstream in(dir + "/losses.json");
  std::stringstream ss;
  ss << in.rdbuf();
  DumpedLosses losses;
  ASSERT_TRUE(ProtoFromJson(ss.str(), &losses).ok()) << ss.str();
  // Every field but z_out, which only a run with --alpha_lse writes (SEMANTICS.md §3.2).
  EXPECT_FALSE(losses.has_z_out());
  EXPECT_EQ(losses.mtp_size(), 0);
  losses.set_z_out(0);
  EXPECT_EQ(FirstMissingField(losses), "");
  const StepMetrics& s1 = (*out)[0].history[0];
  EXPECT_EQ(losses.step(), 1);
  EXPECT_EQ(losses.ce(), s1.ce());
  EXPECT_EQ(losses.z(), s1.z());
  EXPECT_EQ(losses.bal(), s1.bal());
  EXPECT_EQ(losses.valid_tokens(), s1.valid_tokens());
  // 64-bit integers are JSON numbers, as in the --metrics lines.
  EXPECT_THAT(ss.str(), HasSubstr(absl::StrCat("\"valid_tokens\":", s1.valid_tokens(), ",")));
  EXPECT_THAT(losses.config(), HasSubstr("world: 4"));
}

// With the output z-loss and MTP on, losses.json carries their display terms too: z_out and
// one mtp value per depth, each the step record's value, and loss their sum with ce, z, bal.
TEST(TrainerTest, DumpCarriesTheOptionalTerms) {
  const std::string dir = ::testing::TempDir() + "/dump_terms";
  std::filesystem::remove_all(dir);
  TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  config.mutable_debug()->set_dump_dir(dir);
  config.mutable_optim()->set_steps(1);
  config.mutable_model()->set_mtp_depth(2);
  config.mutable_loss()->set_alpha_lse(0.01);
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
  std::ifstream in(dir + "/losses.json");
  std::stringstream ss;
  ss << in.rdbuf();
  DumpedLosses losses;
  ASSERT_TRUE(ProtoFromJson(ss.str(), &losses).ok()) << ss.str();
  const StepMetrics& s1 = (*out)[0].history[0];
  ASSERT_TRUE(losses.has_z_out());
  EXPECT_GT(losses.z_out(), 0.0);
  EXPECT_EQ(losses.z_out(), s1.z_out());
  ASSERT_EQ(losses.mtp_size(), 2);
  double total = losses.ce() + losses.z() + losses.bal() + losses.z_out();
  for (int j = 0; j < 2; ++j) {
    EXPECT_GT(losses.mtp(j), 0.0);
    EXPECT_EQ(losses.mtp(j), s1.mtp(j));
    total += losses.mtp(j);
  }
  EXPECT_NEAR(losses.loss(), total, 1e-12 * total);
}

// Runs `full` for its first `first_steps` steps with checkpoints in `dir` (its last one at
// first_steps), then resumes it to full's steps: rank 0's history of the resumed part.
// Fails the test (empty result) on an error.
std::vector<StepMetrics> StopAndResume(const TrainConfig& full, const std::string& dir,
                                       int first_steps) {
  TrainConfig first = full;
  first.mutable_optim()->set_steps(first_steps);
  first.mutable_checkpoint()->set_dir(dir);
  auto a = RunInProcess(first);
  EXPECT_TRUE(a.ok() && (*a)[0].status.ok()) << (a.ok() ? (*a)[0].status : a.status());
  absl::StatusOr<int64_t> latest = LatestCheckpointStep(dir);
  EXPECT_TRUE(latest.ok() && *latest == first_steps) << latest.status();
  TrainConfig second = full;
  second.mutable_checkpoint()->set_dir(dir);
  second.mutable_checkpoint()->set_resume(true);
  auto b = RunInProcess(second);
  if (!b.ok() || !(*b)[0].status.ok()) {
    ADD_FAILURE() << (b.ok() ? (*b)[0].status : b.status());
    return {};
  }
  return (*b)[0].history;
}

// Resuming from a checkpoint continues bit-exactly: the same losses and grad norms as an
// uninterrupted run (the kill -9 variant is resume_kill_test.sh).
TEST(TrainerTest, ResumeContinuesBitExactly) {
  for (auto sharding : {TrainConfig::fsdp, TrainConfig::replicated}) {
    const std::string dir = ::testing::TempDir() + "/ckpt_" + TrainConfig::Sharding_Name(sharding);
    std::filesystem::remove_all(dir);
    TrainConfig full = TinyConfig(4, 2, 2, sharding);
    full.mutable_optim()->set_steps(6);
    auto reference = RunInProcess(full);
    ASSERT_TRUE(reference.ok() && (*reference)[0].status.ok());
    const std::vector<StepMetrics> resumed = StopAndResume(full, dir, 3);
    ASSERT_EQ(resumed.size(), 3u);
    for (int i = 0; i < 3; ++i) {
      const StepMetrics& want = (*reference)[0].history[3 + i];
      EXPECT_EQ(resumed[i].step(), want.step());
      EXPECT_EQ(resumed[i].ce(), want.ce()) << sharding << " step " << want.step();
      EXPECT_EQ(resumed[i].bal(), want.bal());
      EXPECT_EQ(resumed[i].z(), want.z());
      EXPECT_EQ(resumed[i].grad_norm(), want.grad_norm());
    }
  }
}

// The learning-rate schedule (optim/lr_schedule.h) in the run: every step's lr is the
// cosine formula written here (warmup 2, decay to min_lr at decay_steps 6, held after), and a
// run stopped at step 3 and resumed continues it: the same lr and the same values, bit for
// bit, as the uninterrupted run (the schedule depends on the step alone).
TEST(TrainerTest, TheLrScheduleRunsAndResumes) {
  const std::string dir = ::testing::TempDir() + "/ckpt_cosine";
  std::filesystem::remove_all(dir);
  TrainConfig full = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  OptimConfig* o = full.mutable_optim();
  o->set_steps(8);
  o->set_lr(0.02);
  o->set_warmup_steps(2);
  o->set_lr_decay(OptimConfig::cosine);
  o->set_min_lr(0.002);
  o->set_decay_steps(6);
  auto reference = RunInProcess(full);
  ASSERT_TRUE(reference.ok() && (*reference)[0].status.ok()) << (*reference)[0].status;
  const std::vector<StepMetrics>& h = (*reference)[0].history;
  ASSERT_EQ(h.size(), 8u);
  for (int s = 0; s < 8; ++s) {
    const double done = s + 1.0;
    const double t = std::min(1.0, std::max(0.0, (done - 2) / (6 - 2)));
    const double want = done <= 2 ? 0.02 * done / 2
                                  : 0.002 + 0.018 * (1 + std::cos(3.14159265358979323846 * t)) / 2;
    EXPECT_NEAR(h[s].lr(), want, 1e-15) << "step " << s + 1;
  }
  EXPECT_EQ(h[5].lr(), h[7].lr());  // held at min_lr after decay_steps

  const std::vector<StepMetrics> resumed = StopAndResume(full, dir, 3);
  ASSERT_EQ(resumed.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(resumed[i].lr(), h[3 + i].lr()) << "step " << 4 + i;
    EXPECT_EQ(resumed[i].ce(), h[3 + i].ce()) << "step " << 4 + i;
    EXPECT_EQ(resumed[i].grad_norm(), h[3 + i].grad_norm()) << "step " << 4 + i;
  }
}

// checkpoint.keep: after every save only the newest N complete checkpoints stay, and a run
// resumed from what is left continues (and keeps pruning).
TEST(TrainerTest, KeepPrunesOldCheckpointsAndResumeStillWorks) {
  const std::string dir = ::testing::TempDir() + "/ckpt_keep";
  std::filesystem::remove_all(dir);
  auto steps_in = [&] {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step-", 0) == 0) names.push_back(name);
    }
    std::sort(names.begin(), names.end());
    return names;
  };
  TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  config.mutable_optim()->set_steps(5);
  config.mutable_checkpoint()->set_dir(dir);
  config.mutable_checkpoint()->set_every(1);
  config.mutable_checkpoint()->set_keep(2);
  auto a = RunInProcess(config);
  ASSERT_TRUE(a.ok() && (*a)[0].status.ok()) << (*a)[0].status;
  EXPECT_EQ(steps_in(), (std::vector<std::string>{"step-00000004", "step-00000005"}));

  TrainConfig more = config;
  more.mutable_optim()->set_steps(7);
  more.mutable_checkpoint()->set_resume(true);
  auto b = RunInProcess(more);
  ASSERT_TRUE(b.ok() && (*b)[0].status.ok()) << (*b)[0].status;
  ASSERT_EQ((*b)[0].history.size(), 2u);
  EXPECT_EQ((*b)[0].history[0].step(), 6);
  EXPECT_EQ(steps_in(), (std::vector<std::string>{"step-00000006", "step-00000007"}));

  // keep 0 (the default) keeps every one.
  std::filesystem::remove_all(dir);
  config.mutable_checkpoint()->set_keep(0);
  config.mutable_optim()->set_steps(3);
  auto c = RunInProcess(config);
  ASSERT_TRUE(c.ok() && (*c)[0].status.ok()) << (*c)[0].status;
  EXPECT_EQ(steps_in().size(), 3u);
}

// The held-out evaluation (log.eval_every): after step 1 (the run exports those weights) the
// evaluation's CE equals the fp64 reference model's CE of the same held-out global batch
// (built from MakeHeldOutCorpus's documents here, as the loaders number them) at those
// weights, within 1e-5, on two meshes: world 2 EP 2 without attention, and world 4 EP 2
// SP 2 with attention and sample weighting over 2 held-out micro-batches. The held-out
// documents are not the training ones.
TEST(TrainerTest, HeldOutEvaluationMatchesTheReference) {
  const std::string dir = ::testing::TempDir() + "/eval";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  TrainConfig plain = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  TrainConfig attention = TinyConfig(4, 2, 1, TrainConfig::fsdp);
  attention.mutable_parallelism()->set_sp(2);
  attention.mutable_model()->set_attention(ModelConfig::causal);
  attention.mutable_model()->set_heads(4);
  attention.mutable_model()->set_kv_heads(2);
  attention.mutable_loss()->set_ce_mode(TrainConfig::sample);
  attention.mutable_log()->set_eval_micro_batches(2);
  int meshes = 0;
  for (TrainConfig config : {plain, attention}) {
    ++meshes;
    config.mutable_optim()->set_steps(1);
    config.mutable_log()->set_eval_every(1);
    const std::string weights = absl::StrCat(dir, "/w", meshes, ".safetensors");
    config.mutable_checkpoint()->set_export_path(weights);
    auto out = RunInProcess(config);
    ASSERT_TRUE(out.ok());
    for (const RankOutcome& r : *out) ASSERT_TRUE(r.status.ok()) << r.status;
    ASSERT_EQ((*out)[0].history.size(), 1u);
    const StepMetrics& s1 = (*out)[0].history[0];
    ASSERT_TRUE(s1.has_eval_ce());
    for (const RankOutcome& r : *out) EXPECT_EQ(r.history[0].eval_ce(), s1.eval_ce());

    auto held_out = data::MakeHeldOutCorpus(config.data());
    ASSERT_TRUE(held_out.ok()) << held_out.status();
    TrainConfig eval_layout = config;
    eval_layout.mutable_parallelism()->set_grad_acc(config.log().eval_micro_batches());
    auto batch = GlobalBatchForStep(eval_layout, 0, *held_out);
    ASSERT_TRUE(batch.ok()) << batch.status();
    auto train_batch = GlobalBatchForStep(config, 0);
    ASSERT_TRUE(train_batch.ok());
    EXPECT_NE((*batch)[0][0].tokens, (*train_batch)[0][0].tokens) << "held-out = training data";

    auto file = SafetensorsFile::Read(weights);
    ASSERT_TRUE(file.ok()) << file.status();
    testing::NamedTensors params;
    for (const auto& [name, shape] : MoeLmParamShapes(config.model())) {
      auto t = file->Get(name);
      ASSERT_TRUE(t.ok()) << name;
      params[name].assign(t->data<float>(), t->data<float>() + t->numel());
    }
    std::vector<std::vector<testing::ReferenceMicroBatch>> ref_batch(batch->size());
    for (size_t m = 0; m < batch->size(); ++m) {
      for (const data::MicroBatch& mb : (*batch)[m]) {
        testing::ReferenceMicroBatch r{mb.tokens, mb.labels, mb.mask, mb.sample_ids};
        r.seq_len = mb.seq_len;
        r.doc_start = mb.doc_start;
        ref_batch[m].push_back(std::move(r));
      }
    }
    auto ref = testing::ReferenceLossAndGrads(ReferenceConfigFor(config), params, ref_batch);
    ASSERT_TRUE(ref.ok()) << ref.status();
    EXPECT_GT(ref->ce, 0.0);
    EXPECT_NEAR(s1.eval_ce(), ref->ce, 1e-5 * ref->ce) << "mesh " << meshes;
  }
}

// An evaluation changes nothing of training: with the expert bias on (whose counts only
// training forwards may move) and full recomputation, a run evaluating after every step
// has the losses, grad norms and expert counts of the run without, bit for bit.
TEST(TrainerTest, EvaluationLeavesTrainingBitIdentical) {
  TrainConfig config = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  config.mutable_model()->set_attention(ModelConfig::causal);
  config.mutable_optim()->set_steps(4);
  config.mutable_loss()->set_expert_bias_speed(0.01);
  config.mutable_parallelism()->set_recompute(ParallelismConfig::full);
  TrainConfig evaluated = config;
  evaluated.mutable_log()->set_eval_every(1);
  auto a = RunInProcess(config);
  auto b = RunInProcess(evaluated);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)[0].status.ok() && (*b)[0].status.ok()) << (*b)[0].status;
  ASSERT_EQ((*a)[0].history.size(), 4u);
  ASSERT_EQ((*b)[0].history.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    const StepMetrics& x = (*a)[0].history[i];
    const StepMetrics& y = (*b)[0].history[i];
    EXPECT_FALSE(x.has_eval_ce());
    EXPECT_TRUE(y.has_eval_ce());
    EXPECT_EQ(x.ce(), y.ce()) << i;
    EXPECT_EQ(x.grad_norm(), y.grad_norm()) << i;
    EXPECT_EQ(std::vector<int64_t>(x.tokens_per_expert().begin(), x.tokens_per_expert().end()),
              std::vector<int64_t>(y.tokens_per_expert().begin(), y.tokens_per_expert().end()))
        << i;
  }
  // It measures something: the held-out CE falls as training goes on.
  EXPECT_LT((*b)[0].history[3].eval_ce(), (*b)[0].history[0].eval_ce());
}

// In reproducible mode the held-out CE is the same bits at every mesh, as the training
// values are: world 1 (one micro-batch of 8 sequences) against world 4 (EP 2, 2 each).
TEST(TrainerTest, ReproducibleHeldOutCeIsTheSameBitsAtEveryMesh) {
  auto run = [](int world, int ep, int micro_batch) {
    TrainConfig c = TinyConfig(world, ep, 1, TrainConfig::fsdp);
    c.mutable_data()->set_micro_batch(micro_batch);
    c.mutable_precision()->set_reproducible(true);
    c.mutable_optim()->set_steps(2);
    c.mutable_log()->set_eval_every(1);
    return RunInProcess(c);
  };
  auto w1 = run(1, 1, 8);
  auto w4 = run(4, 2, 2);
  ASSERT_TRUE(w1.ok() && w4.ok());
  ASSERT_TRUE((*w1)[0].status.ok()) << (*w1)[0].status;
  ASSERT_TRUE((*w4)[0].status.ok()) << (*w4)[0].status;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE((*w1)[0].history[i].has_eval_ce());
    EXPECT_EQ((*w1)[0].history[i].eval_ce(), (*w4)[0].history[i].eval_ce()) << "step " << i + 1;
  }
}

// A diverged step names what diverged: a NaN in one rank's reduced gradient (the fault hook
// puts it in the first element rank 1 owns of the embedding at step 2) ends every rank at
// step 2 with the non-finite norm and rank 1's parameter, index and value.
TEST(TrainerTest, ANonFiniteGradientIsNamedByParameterAndRank) {
  TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  config.mutable_optim()->set_steps(3);
  ::setenv("GRADSUM_TEST_FAULT", "nan:1:2", 1);
  auto out = RunInProcess(config);
  ::unsetenv("GRADSUM_TEST_FAULT");
  ASSERT_TRUE(out.ok()) << out.status();
  for (const RankOutcome& r : *out) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInternal) << r.status;
    const std::string m(r.status.message());
    EXPECT_THAT(m, HasSubstr("step 2: gradient norm is nan (training diverged; lower --lr)"));
    EXPECT_THAT(m, HasSubstr("on rank 1 of 2"));
    EXPECT_THAT(m, HasSubstr("the reduced gradient of emb["));
    EXPECT_THAT(m, HasSubstr("] is nan (unit \"emb\")"));
    EXPECT_EQ(r.history.size(), 1u);
  }
}

// A rank that runs out of memory loading its data at start-up (issue 50, item 2: a --data
// file too large for the machine) reaches the start-up agreement with that failure: every
// rank ends within seconds with rank 1's message, not after the collective timeout, and no
// step runs. The hook throws std::bad_alloc where the data is loaded (fault mode oom).
TEST(TrainerTest, OutOfMemoryWhileLoadingTheDataEndsEveryRankPromptly) {
  TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  config.mutable_optim()->set_steps(2);
  config.mutable_comm()->set_timeout_s(60);
  ::setenv("GRADSUM_TEST_FAULT", "oom:1:0", 1);
  const absl::Time start = absl::Now();
  auto out = RunInProcess(config);
  const absl::Duration took = absl::Now() - start;
  ::unsetenv("GRADSUM_TEST_FAULT");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_LT(took, absl::Seconds(20)) << "the peers waited for the timeout";
  for (const RankOutcome& r : *out) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kResourceExhausted) << r.status;
    const std::string m(r.status.message());
    EXPECT_THAT(m, HasSubstr("rank 1"));
    EXPECT_THAT(m, HasSubstr("the embedded corpus: out of memory while loading it at start-up"));
    EXPECT_TRUE(r.history.empty());
  }
}

// --save_on_signal: a SIGTERM on one rank (the fault hook raises it at the start of step 3)
// stops every rank at that step boundary, after saving the two steps done; the run ends
// Cancelled naming the signal and the checkpoint, and resuming from it gives the
// uninterrupted run's values bit for bit.
TEST(TrainerTest, SaveOnSignalCheckpointsAndStopsEveryRank) {
  const std::string dir = ::testing::TempDir() + "/ckpt_signal";
  std::filesystem::remove_all(dir);
  TrainConfig full = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  full.mutable_optim()->set_steps(5);
  auto reference = RunInProcess(full);
  ASSERT_TRUE(reference.ok() && (*reference)[0].status.ok());

  TrainConfig config = full;
  config.mutable_checkpoint()->set_dir(dir);
  config.mutable_checkpoint()->set_save_on_signal(true);
  ResetStopSignal();
  ::setenv("GRADSUM_TEST_FAULT", "term:1:3", 1);
  auto stopped = RunInProcess(config);
  ::unsetenv("GRADSUM_TEST_FAULT");
  ResetStopSignal();
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  for (const RankOutcome& r : *stopped) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled) << r.status;
    EXPECT_THAT(std::string(r.status.message()),
                HasSubstr("stopped by signal 15 (Terminated) after step 2; checkpoint"));
    EXPECT_EQ(r.history.size(), 2u);
  }
  absl::StatusOr<int64_t> latest = LatestCheckpointStep(dir);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 2);

  TrainConfig resume = config;
  resume.mutable_checkpoint()->set_resume(true);
  auto b = RunInProcess(resume);
  ASSERT_TRUE(b.ok() && (*b)[0].status.ok()) << (*b)[0].status;
  ASSERT_EQ((*b)[0].history.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const StepMetrics& want = (*reference)[0].history[2 + i];
    EXPECT_EQ((*b)[0].history[i].step(), want.step());
    EXPECT_EQ((*b)[0].history[i].ce(), want.ce());
    EXPECT_EQ((*b)[0].history[i].grad_norm(), want.grad_norm());
  }
}

// A checkpoint resumes only under the settings that decide its data stream and model:
// another global batch B = world x G x micro_batch would continue another stream, so it is
// refused naming both values, while a new learning rate or step count is fine.
TEST(TrainerTest, ResumeRefusesAnotherDataStreamButAllowsNewOptimizerSettings) {
  const std::string dir = ::testing::TempDir() + "/ckpt_compat";
  std::filesystem::remove_all(dir);
  TrainConfig first = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  first.mutable_optim()->set_steps(2);
  first.mutable_checkpoint()->set_dir(dir);
  auto a = RunInProcess(first);
  ASSERT_TRUE(a.ok() && (*a)[0].status.ok()) << (*a)[0].status;

  TrainConfig other_g = first;
  other_g.mutable_optim()->set_steps(4);
  other_g.mutable_checkpoint()->set_resume(true);
  other_g.mutable_parallelism()->set_grad_acc(3);
  auto b = RunInProcess(other_g);
  ASSERT_TRUE(b.ok());
  for (const RankOutcome& r : *b) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
    EXPECT_THAT(r.status.message(),
                HasSubstr("global batch B=8 (world x grad_acc x micro_batch = 2 x 2 x 2) but "
                          "this run has global batch B=12 (world x grad_acc x micro_batch = 2 "
                          "x 3 x 2)"));
  }
  TrainConfig other_model = first;
  other_model.mutable_checkpoint()->set_resume(true);
  other_model.mutable_optim()->set_steps(3);
  other_model.mutable_model()->set_router_scale(2.0f);
  auto c = RunInProcess(other_model);
  ASSERT_TRUE(c.ok());
  EXPECT_THAT((*c)[0].status.message(), HasSubstr("model.router_scale=1 but this run has"));
  // The attention block, its head layout and the corpus decide the model and the stream
  // too (TinyConfig: no attention, 4 heads over 4 kv heads, markov1).
  const std::pair<std::function<void(TrainConfig*)>, std::string> refused[] = {
      {[](TrainConfig* t) { t->mutable_model()->set_attention(ModelConfig::causal); },
       "model.attention=none but this run has model.attention=causal"},

      {[](TrainConfig* t) { t->mutable_data()->set_corpus(DataConfig::markov2); },
       "data.corpus=markov1 but this run has data.corpus=markov2"},
  };
  for (const auto& [edit, message] : refused) {
    TrainConfig other = first;
    other.mutable_checkpoint()->set_resume(true);
    other.mutable_optim()->set_steps(3);
    edit(&other);
    auto e = RunInProcess(other);
    ASSERT_TRUE(e.ok());
    for (const RankOutcome& r : *e) {
      EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
      EXPECT_THAT(r.status.message(), HasSubstr(message));
    }
  }

  // Another head layout for the per-token model, which has none: refused before the
  // checkpoint is read, as a value the model would ignore (issue 50).
  {
    TrainConfig other = first;
    other.mutable_checkpoint()->set_resume(true);
    other.mutable_optim()->set_steps(3);
    other.mutable_model()->set_kv_heads(2);
    auto e = RunInProcess(other);
    ASSERT_TRUE(e.ok());
    for (const RankOutcome& r : *e) {
      EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
      EXPECT_THAT(r.status.message(),
                  HasSubstr("model.kv_heads=2: is not used with model.attention=none"));
    }
  }

  TrainConfig new_lr = first;
  new_lr.mutable_checkpoint()->set_resume(true);
  new_lr.mutable_optim()->set_steps(3);
  new_lr.mutable_optim()->set_lr(0.003);
  auto d = RunInProcess(new_lr);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)[0].status.ok()) << (*d)[0].status;
  ASSERT_EQ((*d)[0].history.size(), 1u);
  EXPECT_EQ((*d)[0].history[0].step(), 3);
}

// A run owns its checkpoint directory. A fresh run into a directory with another run's
// checkpoints is refused on every rank, naming that run, and changes nothing there;
// --overwrite_checkpoints removes them first; while a process holds the directory's lock,
// any run on it is refused at start-up naming the holder's pid.
TEST(TrainerTest, ARunOwnsItsCheckpointDirectory) {
  const std::string dir = ::testing::TempDir() + "/ckpt_owner";
  std::filesystem::remove_all(dir);
  TrainConfig first = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  first.mutable_optim()->set_steps(4);
  first.mutable_checkpoint()->set_dir(dir);
  first.mutable_checkpoint()->set_every(2);
  auto a = RunInProcess(first);
  ASSERT_TRUE(a.ok() && (*a)[0].status.ok()) << (*a)[0].status;
  absl::StatusOr<CheckpointInfo> marker = ReadCheckpointInfo(CheckpointPath(dir, 4));
  ASSERT_TRUE(marker.ok()) << marker.status();
  const std::string run_id = marker->extra.at("run_id");
  absl::StatusOr<std::string> marker_text =
      ReadFileToString(CheckpointPath(dir, 4) + "/checkpoint.json");
  ASSERT_TRUE(marker_text.ok());

  TrainConfig fresh = first;
  fresh.mutable_optim()->set_steps(2);
  auto b = RunInProcess(fresh);
  ASSERT_TRUE(b.ok());
  for (const RankOutcome& r : *b) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
    EXPECT_THAT(r.status.message(),
                HasSubstr("--checkpoint_dir=" + dir + " holds the checkpoints of run " + run_id +
                          " (2 checkpoints, steps 2 to 4); --resume continues that run, "
                          "--overwrite_checkpoints replaces it"));
    EXPECT_TRUE(r.history.empty());
  }
  EXPECT_EQ(*ReadFileToString(CheckpointPath(dir, 4) + "/checkpoint.json"), *marker_text);

  // Another holder of the lock (this process, through its own open of the file).
  {
    absl::StatusOr<DirLock> other = DirLock::Acquire(dir, kCheckpointLockFile);
    ASSERT_TRUE(other.ok()) << other.status();
    TrainConfig resume = first;
    resume.mutable_checkpoint()->set_resume(true);
    resume.mutable_optim()->set_steps(6);
    auto c = RunInProcess(resume);
    ASSERT_TRUE(c.ok());
    for (const RankOutcome& r : *c) {
      EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
      EXPECT_THAT(r.status.message(),
                  HasSubstr("--checkpoint_dir=" + dir + " is in use by another run: held by pid " +
                            std::to_string(::getpid()) + " on host "));
    }
  }

  TrainConfig overwrite = fresh;
  overwrite.mutable_checkpoint()->set_overwrite(true);
  auto d = RunInProcess(overwrite);
  ASSERT_TRUE(d.ok() && (*d)[0].status.ok()) << (*d)[0].status;
  EXPECT_FALSE(std::filesystem::exists(CheckpointPath(dir, 4)));
  absl::StatusOr<CheckpointInfo> replaced = ReadCheckpointInfo(CheckpointPath(dir, 2));
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  EXPECT_NE(replaced->extra.at("run_id"), run_id);
}

// A resume takes the fields that only decide the initial parameters (the seed, init_std)
// from the checkpoint, which holds those parameters, and records them in its own saves.
TEST(TrainerTest, ResumeTakesTheSeedFromTheCheckpoint) {
  const std::string dir = ::testing::TempDir() + "/ckpt_seed";
  std::filesystem::remove_all(dir);
  TrainConfig first = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  first.mutable_optim()->set_steps(2);
  first.mutable_checkpoint()->set_dir(dir);
  auto a = RunInProcess(first);
  ASSERT_TRUE(a.ok() && (*a)[0].status.ok()) << (*a)[0].status;
  TrainConfig resume = first;
  resume.mutable_checkpoint()->set_resume(true);
  resume.mutable_optim()->set_steps(3);
  resume.mutable_model()->set_seed(first.model().seed() + 8);
  auto b = RunInProcess(resume);
  ASSERT_TRUE(b.ok() && (*b)[0].status.ok()) << (*b)[0].status;
  absl::StatusOr<CheckpointInfo> after = ReadCheckpointInfo(CheckpointPath(dir, 3));
  ASSERT_TRUE(after.ok()) << after.status();
  absl::StatusOr<TrainConfig> saved = ParseConfigText(after->extra.at("config"));
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->model().seed(), first.model().seed());
}

// Rank 0's step records of `config` run in process (every rank must succeed).
std::vector<StepMetrics> TrainOrDie(const TrainConfig& config) {
  auto out = RunInProcess(config);
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  for (const RankOutcome& r : *out) EXPECT_TRUE(r.status.ok()) << r.status;
  return (*out)[0].history;
}

double RelErr(double a, double b) { return std::abs(a - b) / std::abs(b); }

// `resumed` continues `reference` (records of steps 1..): its first step within 1e-5
// relative of the uninterrupted run's loss and CE, the rest within 1e-3.
void ExpectContinues(const std::vector<StepMetrics>& resumed,
                     const std::vector<StepMetrics>& reference, const std::string& what) {
  ASSERT_FALSE(resumed.empty()) << what;
  for (size_t i = 0; i < resumed.size(); ++i) {
    const StepMetrics& got = resumed[i];
    ASSERT_LE(got.step(), static_cast<int64_t>(reference.size())) << what;
    const StepMetrics& want = reference[got.step() - 1];
    const double tol = i == 0 ? 1e-5 : 1e-3;
    EXPECT_LE(RelErr(got.loss(), want.loss()), tol)
        << what << " step " << got.step() << ": loss " << got.loss() << " vs " << want.loss();
    EXPECT_LE(RelErr(got.ce(), want.ce()), tol) << what << " step " << got.step();
    EXPECT_EQ(got.valid_tokens(), want.valid_tokens()) << what << " step " << got.step();
  }
}

// One rank, one micro-batch of `micro_batch` x `seq_len` tokens per step, `layers` layers.
TrainConfig ActivationConfig(int layers, int micro_batch, int seq_len, bool attention) {
  TrainConfig config;
  config.mutable_optim()->set_steps(1);
  config.mutable_parallelism()->set_world(1);
  config.mutable_parallelism()->set_ep(1);
  config.mutable_parallelism()->set_grad_acc(1);
  ModelConfig& m = *config.mutable_model();
  m.set_dim(16);
  m.set_expert_dim(8);
  m.set_layers(layers);
  m.set_experts(4);
  m.set_top_k(2);
  m.set_attention(attention ? ModelConfig::causal : ModelConfig::none);
  if (attention) {  // the per-token model has no heads (and refuses a head layout)
    m.set_heads(4);
    m.set_kv_heads(2);
  }
  config.mutable_data()->set_micro_batch(micro_batch);
  config.mutable_data()->set_seq_len(seq_len);
  config.mutable_data()->set_max_doc_len(seq_len);
  return config;
}

// The step's peak_activation_bytes against the buffers listed from the shapes: T tokens,
// at ep = 1 every routed copy (routed_tokens x K rows) stays on the rank. After the last
// backward stage everything below is held at once (the ops keep their buffers).
TEST(TrainerTest, PeakActivationBytesCountsTheHeldBuffersExactly) {
  for (bool attention : {false, true}) {
    const int L = 2, B = 2, S = 32;
    const TrainConfig config = ActivationConfig(L, B, S, attention);
    const std::vector<StepMetrics> h = TrainOrDie(config);
    ASSERT_EQ(h.size(), 1u);
    const int64_t T = B * S, D = 16, H = 8, E = 4, K = 2, Hq = 4, hd = D / Hq, kv = 2 * hd;
    const int64_t R = h[0].routed_tokens() * K;  // rows the experts ran
    const int64_t f = 4, i32 = 4, i64 = 8;
    // The model's arrays: h_0..h_L, a_l, 1/rms_l, y, dh, da, f, grad_f, 1/rms_f.
    int64_t want = f * ((L + 1) * T * D + L * (T * D + T) + 5 * T * D + T);
    // Per MoE layer (the ops): router logits and probs [T, E], expert index and weight
    // [T, K], routed flags [T]; dispatch send order and its inverse (int64), its combine
    // weights, the output rows; expert input and output [R, D], the SwiGLU pre-activations
    // [R, H] twice. Once for all layers: backward's two expert scratch buffers [R, D].
    want += L * (2 * T * E * f + T * K * (i32 + f) + T + R * i64 + T * K * i64 + T * K * f +
                 R * i64 + 2 * R * D * f + 2 * R * H * f);
    want += 2 * R * D * f;
    want += T * E * f;  // the router losses' gradient du [T, E]
    if (attention) {
      // Per layer: b, q, k, v, o in the head split, o in the token split, m [T, D]; 1/rms
      // [T]; the softmax statistics [T, heads]. Shared: q and six gradients [T, D], k and
      // v [T, kv]; the ops' RoPE tables [T, hd / 2] twice and the exchange buffers [T, D].
      want += f * (L * (7 * T * D + T + T * Hq) + 7 * T * D + 2 * T * kv);
      want += f * (2 * T * hd / 2 + 2 * T * D);
    }
    EXPECT_EQ(h[0].peak_activation_bytes(), want) << "attention " << attention;
  }
}

// Linear in the tokens (micro_batch, seq_len) and in the layers: without attention every
// held buffer is per token or per routed copy, and documents of exactly seq_len tokens
// leave no padding (every token routed).
TEST(TrainerTest, PeakActivationBytesGrowsLinearlyWithTokensAndLayers) {
  auto bytes = [](int layers, int micro_batch, int seq_len) {
    TrainConfig config = ActivationConfig(layers, micro_batch, seq_len, /*attention=*/false);
    config.mutable_data()->set_min_doc_len(seq_len);
    const std::vector<StepMetrics> h = TrainOrDie(config);
    EXPECT_EQ(h.size(), 1u);
    EXPECT_EQ(h.empty() ? 0 : h[0].routed_tokens(), int64_t{micro_batch} * seq_len);
    return h.empty() ? int64_t{0} : h[0].peak_activation_bytes();
  };
  const int64_t base = bytes(2, 2, 32);
  EXPECT_GT(base, 0);
  EXPECT_EQ(bytes(2, 4, 32), 2 * base);
  EXPECT_EQ(bytes(2, 2, 64), 2 * base);
  const int64_t l1 = bytes(1, 2, 32), l3 = bytes(3, 2, 32);
  EXPECT_GT(base, l1);
  EXPECT_EQ(l3 - base, base - l1);  // the same bytes per layer
}

// Elastic resume: a run checkpointed on one mesh continues on others with the same global
// batch B = world x G x micro_batch = 8, through (world, ep, G) = (4, 2, 1) fsdp ->
// (2, 1, 2) replicated -> (1, 1, 4) fsdp. The reference is the uninterrupted run on the
// original mesh (4, 2, 1): the data stream is mesh-independent, so it trains on the same
// sequences. alpha_b = 0 here because the balancing loss is defined per micro-step
// (SEMANTICS.md §5: expert counts of micro-batch m), so with alpha_b > 0 another G is
// another objective; the test with a fixed G below keeps alpha_b.
TEST(TrainerTest, ResumeOntoAnotherMeshContinuesTheUninterruptedRun) {
  const std::string dir = ::testing::TempDir() + "/ckpt_elastic";
  std::filesystem::remove_all(dir);
  auto mesh = [&](int world, int ep, int g, TrainConfig::Sharding sharding, int steps) {
    TrainConfig c = TinyConfig(world, ep, g, sharding);
    c.mutable_loss()->set_alpha_b(0);
    c.mutable_optim()->set_steps(steps);
    c.mutable_checkpoint()->set_dir(dir);
    return c;
  };
  TrainConfig reference = mesh(4, 2, 1, TrainConfig::fsdp, 15);
  reference.mutable_checkpoint()->clear_dir();
  const std::vector<StepMetrics> want = TrainOrDie(reference);
  ASSERT_EQ(want.size(), 15u);

  TrainOrDie(mesh(4, 2, 1, TrainConfig::fsdp, 2));
  TrainConfig second = mesh(2, 1, 2, TrainConfig::replicated, 4);
  second.mutable_checkpoint()->set_resume(true);
  ExpectContinues(TrainOrDie(second), want, "(4,2,1) fsdp -> (2,1,2) replicated");
  TrainConfig third = mesh(1, 1, 4, TrainConfig::fsdp, 15);
  third.mutable_checkpoint()->set_resume(true);
  const std::vector<StepMetrics> last = TrainOrDie(third);
  ASSERT_EQ(last.size(), 11u);  // the first step after the resume and 10 more
  ExpectContinues(last, want, "(2,1,2) replicated -> (1,1,4) fsdp");
}

// HSDP checkpoints (SEMANTICS.md §7: the owned slices partition the world as fsdp's do)
// load onto fsdp and replicated meshes and back: (world, ep, G) = (4, 2, 1) hsdp with
// shard groups of 2 -> (2, 1, 2) fsdp -> (4, 2, 1) replicated -> (4, 1, 1) hsdp with shard
// groups of 1 (fully replicated units, summed across 4 replicas) -> (4, 2, 1) hsdp with
// one group of 4, each segment continuing the uninterrupted fsdp run (B = 8, alpha_b = 0 as
// above).
TEST(TrainerTest, ResumeFromHsdpOntoFsdpAndReplicatedAndBack) {
  const std::string dir = ::testing::TempDir() + "/ckpt_hsdp";
  std::filesystem::remove_all(dir);
  auto mesh = [&](int world, int ep, int g, TrainConfig::Sharding sharding, int shard_group,
                  int steps) {
    TrainConfig c = TinyConfig(world, ep, g, sharding);
    c.mutable_parallelism()->set_shard_group(shard_group);
    c.mutable_loss()->set_alpha_b(0);
    c.mutable_optim()->set_steps(steps);
    c.mutable_checkpoint()->set_dir(dir);
    c.mutable_checkpoint()->set_resume(true);
    return c;
  };
  TrainConfig reference = mesh(4, 2, 1, TrainConfig::fsdp, 0, 10);
  reference.mutable_checkpoint()->clear_dir();
  reference.mutable_checkpoint()->set_resume(false);
  const std::vector<StepMetrics> want = TrainOrDie(reference);
  ASSERT_EQ(want.size(), 10u);

  TrainConfig first = mesh(4, 2, 1, TrainConfig::hsdp, 2, 2);
  first.mutable_checkpoint()->set_resume(false);
  ExpectContinues(TrainOrDie(first), want, "(4,2,1) hsdp N=2 from the start");
  // Each segment resumed (two steps each), so each continued from the checkpoint.
  const std::vector<StepMetrics> second = TrainOrDie(mesh(2, 1, 2, TrainConfig::fsdp, 0, 4));
  ASSERT_EQ(second.size(), 2u);
  ExpectContinues(second, want, "(4,2,1) hsdp N=2 -> (2,1,2) fsdp");
  const std::vector<StepMetrics> third = TrainOrDie(mesh(4, 2, 1, TrainConfig::replicated, 0, 6));
  ASSERT_EQ(third.size(), 2u);
  ExpectContinues(third, want, "(2,1,2) fsdp -> (4,2,1) replicated");
  const std::vector<StepMetrics> fourth = TrainOrDie(mesh(4, 1, 1, TrainConfig::hsdp, 1, 8));
  ASSERT_EQ(fourth.size(), 2u);
  ExpectContinues(fourth, want, "(4,2,1) replicated -> (4,1,1) hsdp N=1");
  const std::vector<StepMetrics> last = TrainOrDie(mesh(4, 2, 1, TrainConfig::hsdp, 4, 10));
  ASSERT_EQ(last.size(), 2u);
  ExpectContinues(last, want, "(4,1,1) hsdp N=1 -> (4,2,1) hsdp N=4");
}

// The same with the balancing loss on and G fixed: (world, ep, micro_batch) = (4, 2, 2)
// fsdp -> (2, 2, 4) replicated with two layers per unit (B = 16 both), against the
// uninterrupted run on the target mesh.
TEST(TrainerTest, ResumeOntoAnotherWorldAndUnitGroupingKeepsTheBalancingLoss) {
  const std::string dir = ::testing::TempDir() + "/ckpt_elastic_bal";
  std::filesystem::remove_all(dir);
  TrainConfig first = TinyConfig(4, 2, 2, TrainConfig::fsdp);
  first.mutable_optim()->set_steps(3);
  first.mutable_checkpoint()->set_dir(dir);
  TrainOrDie(first);
  TrainConfig target = TinyConfig(2, 2, 2, TrainConfig::replicated);
  target.mutable_data()->set_micro_batch(4);
  target.mutable_parallelism()->set_layers_per_unit(2);
  target.mutable_optim()->set_steps(14);
  const std::vector<StepMetrics> want = TrainOrDie(target);
  target.mutable_checkpoint()->set_dir(dir);
  target.mutable_checkpoint()->set_resume(true);
  const std::vector<StepMetrics> resumed = TrainOrDie(target);
  ASSERT_EQ(resumed.size(), 11u);
  ExpectContinues(resumed, want, "(4,2,2) mb 2 fsdp -> (2,2,2) mb 4 replicated");
}

// An hsdp checkpoint consolidates offline (checkpoint/checkpoint.h reads its manifests as a
// sharded run's: SEMANTICS.md §7) into exactly the parameters the run's --export gathered
// from its shards, with shard groups of 2 (EP 2: the experts held whole) and of 1.
TEST(TrainerTest, HsdpCheckpointConsolidatesToTheExport) {
  for (const auto& [ep, n] : {std::pair<int, int>{2, 2}, {1, 1}}) {
    const std::string dir = absl::StrCat(::testing::TempDir(), "/export_hsdp_", n);
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    TrainConfig config = TinyConfig(4, ep, 2, TrainConfig::hsdp);
    config.mutable_parallelism()->set_shard_group(n);
    config.mutable_optim()->set_steps(2);
    config.mutable_checkpoint()->set_dir(dir + "/ckpt");
    config.mutable_checkpoint()->set_export_path(dir + "/final.safetensors");
    TrainOrDie(config);
    ASSERT_TRUE(ExportConsolidated(dir + "/ckpt/step-00000002", dir + "/offline.safetensors").ok());
    auto exported = SafetensorsFile::Read(dir + "/final.safetensors");
    auto offline = SafetensorsFile::Read(dir + "/offline.safetensors");
    ASSERT_TRUE(exported.ok() && offline.ok());
    const auto shapes = MoeLmParamShapes(config.model());
    ASSERT_EQ(offline->num_tensors(), static_cast<int>(shapes.size()));
    const NamedParams init = MoeLm::InitialParameters(config.model(), config.model().seed());
    for (const auto& [name, shape] : shapes) {
      auto a = exported->Get(name);
      auto b = offline->Get(name);
      ASSERT_TRUE(a.ok() && b.ok()) << name;
      EXPECT_EQ(b->shape(), shape) << name;
      EXPECT_EQ(0, std::memcmp(a->raw(), b->raw(), a->nbytes()))
          << "shard group " << n << " " << name;
      EXPECT_NE(0, std::memcmp(a->raw(), init.at(name).data(), a->nbytes())) << name;
    }
  }
}

// optim.decay_norms: after one step (same initial values, data and so gradients) with
// weight decay 0.5, the RMSNorm gains are bit for bit those of the run without decay when
// they are exempt (the default), and differ when they are not; the matrices and the
// embedding decay in both.
TEST(TrainerTest, WeightDecayExemptsTheNormGainsUnlessAskedTo) {
  const std::string dir = ::testing::TempDir() + "/decay_norms";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto run = [&](const std::string& name, double wd, bool decay_norms) {
    TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
    config.mutable_model()->set_attention(ModelConfig::causal);
    config.mutable_optim()->set_steps(1);
    config.mutable_optim()->set_warmup_steps(0);
    config.mutable_optim()->set_weight_decay(wd);
    config.mutable_optim()->set_decay_norms(decay_norms);
    config.mutable_checkpoint()->set_export_path(dir + "/" + name + ".safetensors");
    TrainOrDie(config);
    return SafetensorsFile::Read(dir + "/" + name + ".safetensors");
  };
  auto none = run("none", 0.0, false);
  auto exempt = run("exempt", 0.5, false);
  auto all = run("all", 0.5, true);
  ASSERT_TRUE(none.ok() && exempt.ok() && all.ok());
  auto same = [](const absl::StatusOr<SafetensorsFile>& a, const absl::StatusOr<SafetensorsFile>& b,
                 const std::string& name) {
    auto x = a->Get(name);
    auto y = b->Get(name);
    return x.ok() && y.ok() && x->nbytes() == y->nbytes() &&
           std::memcmp(x->raw(), y->raw(), x->nbytes()) == 0;
  };
  int norms = 0;
  for (const std::string name :
       {"layers.0.attn_norm", "layers.0.norm", "layers.1.norm", "final_norm"}) {
    ++norms;
    EXPECT_TRUE(same(none, exempt, name)) << name;
    EXPECT_FALSE(same(none, all, name)) << name;
  }
  EXPECT_EQ(norms, 4);
  for (const std::string name : {"emb", "layers.0.wq", "layers.0.router", "out"}) {
    EXPECT_FALSE(same(none, exempt, name)) << name;
    EXPECT_TRUE(same(exempt, all, name)) << name;
  }
}

// --export writes the final parameters as the dumps name and shape them; they equal the
// offline consolidation of the run's last checkpoint (checkpoint/checkpoint.h, assembled from
// the shards). --init_from starts a run from such a file: its step-1 dump holds exactly the
// file's values.
TEST(TrainerTest, ExportWritesTheFinalParametersAndInitFromStartsFromThem) {
  const std::string dir = ::testing::TempDir() + "/export";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  TrainConfig config = TinyConfig(4, 2, 2, TrainConfig::fsdp);
  config.mutable_optim()->set_steps(3);
  config.mutable_checkpoint()->set_dir(dir + "/ckpt");
  config.mutable_checkpoint()->set_export_path(dir + "/final.safetensors");
  TrainOrDie(config);
  ASSERT_TRUE(ExportConsolidated(dir + "/ckpt/step-00000003", dir + "/offline.safetensors").ok());
  auto exported = SafetensorsFile::Read(dir + "/final.safetensors");
  auto offline = SafetensorsFile::Read(dir + "/offline.safetensors");
  ASSERT_TRUE(exported.ok() && offline.ok());
  const auto shapes = MoeLmParamShapes(config.model());
  ASSERT_EQ(exported->num_tensors(), static_cast<int>(shapes.size()));
  EXPECT_EQ(exported->metadata().at("step"), "3");
  const NamedParams init = MoeLm::InitialParameters(config.model(), config.model().seed());
  for (const auto& [name, shape] : shapes) {
    auto a = exported->Get(name);
    auto b = offline->Get(name);
    ASSERT_TRUE(a.ok() && b.ok()) << name;
    EXPECT_EQ(a->shape(), shape) << name;
    EXPECT_EQ(a->dtype(), DType::kF32) << name;
    EXPECT_EQ(0, std::memcmp(a->raw(), b->raw(), a->nbytes())) << name;
    EXPECT_NE(0, std::memcmp(a->raw(), init.at(name).data(), a->nbytes())) << name << " trained";
  }

  TrainConfig next = TinyConfig(2, 1, 1, TrainConfig::replicated);
  next.mutable_checkpoint()->set_init_from(dir + "/final.safetensors");
  next.mutable_debug()->set_dump_dir(dir + "/dump");
  TrainOrDie(next);
  auto dumped = SafetensorsFile::Read(dir + "/dump/weights.safetensors");
  ASSERT_TRUE(dumped.ok());
  for (const auto& [name, shape] : shapes) {
    auto a = exported->Get(name);
    auto b = dumped->Get(name);
    ASSERT_TRUE(b.ok()) << name;
    EXPECT_EQ(0, std::memcmp(a->raw(), b->raw(), a->nbytes())) << name;
  }
}

// A file that is not exactly this model's parameters is refused at start-up on every rank,
// naming the tensor: one missing, one extra, one of another shape or dtype.
TEST(TrainerTest, InitFromRefusesAFileOfAnotherModel) {
  const std::string dir = ::testing::TempDir() + "/init_bad";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  const NamedParams init = MoeLm::InitialParameters(config.model(), 7);
  const auto shapes = MoeLmParamShapes(config.model());
  struct Case {
    const char* name;
    std::function<void(SafetensorsWriter&, const std::string&, const std::vector<int64_t>&, float*)>
        add;
    std::string needle;
  };
  std::vector<float> extra(3, 1.0f);
  std::vector<double> wide(8 * 256, 0.0);
  const std::vector<Case> cases = {
      {"missing",
       [](SafetensorsWriter& w, const std::string& n, const std::vector<int64_t>& s, float* p) {
         if (n != "layers.1.router") {
           ASSERT_TRUE(w.Add(n, *TensorView::Create(p, DType::kF32, s)).ok());
         }
       },
       "no tensor \"layers.1.router\", which this model needs with shape [8,4]"},
      {"extra",
       [&](SafetensorsWriter& w, const std::string& n, const std::vector<int64_t>& s, float* p) {
         ASSERT_TRUE(w.Add(n, *TensorView::Create(p, DType::kF32, s)).ok());
         if (n == "emb") {
           ASSERT_TRUE(
               w.Add("layers.2.norm", *TensorView::Create(extra.data(), DType::kF32, {3})).ok());
         }
       },
       "tensor \"layers.2.norm\" is not a parameter of this model"},
      {"misshapen",
       [](SafetensorsWriter& w, const std::string& n, const std::vector<int64_t>& s, float* p) {
         std::vector<int64_t> shape = s;
         if (n == "out") shape = {256, 8};
         ASSERT_TRUE(w.Add(n, *TensorView::Create(p, DType::kF32, shape)).ok());
       },
       "tensor \"out\" is"},
      {"f64",
       [&](SafetensorsWriter& w, const std::string& n, const std::vector<int64_t>& s, float* p) {
         if (n == "out") {
           ASSERT_TRUE(w.Add(n, *TensorView::Create(wide.data(), DType::kF64, s)).ok());
         } else {
           ASSERT_TRUE(w.Add(n, *TensorView::Create(p, DType::kF32, s)).ok());
         }
       },
       "tensor \"out\" is"},
  };
  for (const Case& c : cases) {
    NamedParams copy = init;
    SafetensorsWriter w;
    for (const auto& [name, shape] : shapes) c.add(w, name, shape, copy.at(name).data());
    const std::string path = dir + "/" + c.name + ".safetensors";
    ASSERT_TRUE(w.WriteFile(path).ok());
    TrainConfig bad = config;
    bad.mutable_checkpoint()->set_init_from(path);
    auto out = RunInProcess(bad);
    ASSERT_TRUE(out.ok());
    for (const RankOutcome& r : *out) {
      EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << r.status;
      EXPECT_THAT(r.status.message(), HasSubstr(c.needle)) << c.name;
      EXPECT_THAT(r.status.message(), HasSubstr("--init_from=" + path)) << c.name;
    }
  }
  TrainConfig both = config;
  both.mutable_checkpoint()->set_init_from(dir + "/missing.safetensors");
  both.mutable_checkpoint()->set_dir(dir);
  both.mutable_checkpoint()->set_resume(true);
  auto out = RunInProcess(both);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT((*out)[0].status.message(),
              HasSubstr("checkpoint.init_from=" + dir +
                        "/missing.safetensors: cannot be combined with checkpoint.resume"));
}

// NaN or infinite values are refused when the file is loaded, on every rank, naming the
// file, the tensor and the first such element, before any step (they used to surface at
// step 1 as a router logit "not finite").
TEST(TrainerTest, InitFromRefusesNonFiniteValuesWhenLoaded) {
  const std::string dir = ::testing::TempDir() + "/init_nan";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  NamedParams init = MoeLm::InitialParameters(config.model(), 7);
  std::vector<float>& router = init.at("layers.0.router");  // [D=8, E=4]
  router[6] = std::numeric_limits<float>::quiet_NaN();      // [1, 2]
  router[10] = std::numeric_limits<float>::infinity();
  const std::string path = dir + "/nan.safetensors";
  ASSERT_TRUE(WriteParamsFile(path, config.model(), init, 3).ok());
  config.mutable_checkpoint()->set_init_from(path);
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  for (const RankOutcome& r : *out) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kDataLoss) << r.status;
    EXPECT_THAT(r.status.message(), HasSubstr("--init_from=" + path +
                                              ": tensor \"layers.0.router\" holds 2 "
                                              "non-finite values of 32, the first nan at [1,2]"));
    EXPECT_TRUE(r.history.empty());
  }
}

// A commit marker without the config that wrote it proves nothing about the data stream
// and the model: refused, on every rank. The marker is rewritten with a valid fingerprint
// (XXH3 of its other members), so only the missing config can be the reason.
// Trains TinyConfig(2, 2, 1) for 2 steps with checkpoints in `dir` (emptied first), so
// that dir/step-00000002 holds a complete checkpoint; returns the config.
TrainConfig TwoCheckpointedSteps(const std::string& dir) {
  std::filesystem::remove_all(dir);
  TrainConfig first = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  first.mutable_optim()->set_steps(2);
  first.mutable_checkpoint()->set_dir(dir);
  TrainOrDie(first);
  return first;
}

// Rewrites the commit marker at `marker_path` with `edit` applied to its `extra`, and a
// valid fingerprint (the documented one: XXH3-64 of the marker's JSON without
// "fingerprint"), so that only the edit can be the reason for what a resume does.
void RewriteMarkerExtra(
    const std::string& marker_path,
    const std::function<void(google::protobuf::Map<std::string, std::string>*)>& edit) {
  absl::StatusOr<std::string> text = ReadFileToString(marker_path);
  ASSERT_TRUE(text.ok()) << text.status();
  checkpoint::CommitMarker marker;
  ASSERT_TRUE(ProtoFromJson(*text, &marker).ok()) << *text;
  ASSERT_EQ(marker.extra().count("config"), 1u);
  edit(marker.mutable_extra());
  marker.clear_fingerprint();
  absl::StatusOr<std::string> body = ProtoToJson(marker);
  ASSERT_TRUE(body.ok());
  marker.set_fingerprint(absl::StrFormat("%016x", Fingerprint64(*body)));
  absl::StatusOr<std::string> rewritten = ProtoToJson(marker);
  ASSERT_TRUE(rewritten.ok());
  ASSERT_TRUE(WriteFileAtomically(marker_path, *rewritten + "\n").ok());
}

// A checkpoint of the per-token model written before a head layout without attention was
// refused (issue 50) still resumes with the defaults validation now asks for; with
// attention the layout still must match.
TEST(TrainerTest, ResumeIgnoresTheHeadLayoutOfAModelWithoutAttention) {
  TrainConfig saved = ResolvedConfig(TinyConfig(2, 2, 1, TrainConfig::fsdp));
  saved.mutable_model()->set_heads(3);
  saved.mutable_model()->set_kv_heads(1);
  saved.mutable_model()->set_rope_theta(500);
  const TrainConfig now = ResolvedConfig(TinyConfig(2, 2, 1, TrainConfig::fsdp));
  ASSERT_TRUE(ValidateConfig(now).ok());
  EXPECT_TRUE(CheckResumeCompatible(saved, now, 3).ok()) << CheckResumeCompatible(saved, now, 3);
  TrainConfig saved_causal = saved, now_causal = now;
  saved_causal.mutable_model()->set_attention(ModelConfig::causal);
  now_causal.mutable_model()->set_attention(ModelConfig::causal);
  EXPECT_THAT(CheckResumeCompatible(saved_causal, now_causal, 3).message(),
              HasSubstr("model.heads=3 but this run has model.heads=4"));
}

TEST(TrainerTest, ResumeRefusesAMarkerWithoutItsConfig) {
  const std::string dir = ::testing::TempDir() + "/ckpt_no_config";
  const TrainConfig first = TwoCheckpointedSteps(dir);
  RewriteMarkerExtra(dir + "/step-00000002/checkpoint.json",
                     [](auto* extra) { extra->erase("config"); });

  TrainConfig again = first;
  again.mutable_optim()->set_steps(3);
  again.mutable_checkpoint()->set_resume(true);
  auto b = RunInProcess(again);
  ASSERT_TRUE(b.ok());
  for (const RankOutcome& r : *b) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
    EXPECT_THAT(r.status.message(), HasSubstr("has no \"config\" in its commit marker"));
  }
}

// A checkpoint written by the binary before the config had sections holds its config in
// the old layout (top-level world, ep, steps, ...). It still resumes, and continues the
// uninterrupted run bit-exactly. The marker is rewritten with that text (as the previous
// binary wrote it for this config) and a valid fingerprint. It predates the attention
// block and the corpus choice, so it names neither: it reads as what those runs were
// (no attention, markov1, as TinyConfig), not as today's defaults.
TEST(TrainerTest, ResumeReadsAMarkerOfTheOldConfigLayout) {
  const std::string dir = ::testing::TempDir() + "/ckpt_old_layout";
  const TrainConfig first = TwoCheckpointedSteps(dir);
  const std::string marker_path = dir + "/step-00000002/checkpoint.json";
  const std::string old_layout = absl::StrCat(
      "model { vocab: 256 dim: 8 layers: 2 experts: 4 top_k: 2 expert_dim: 8 norm_topk_prob: "
      "true router_scale: 1 init_std: 0.5 } data { path: \"\" seq_len: 16 micro_batch: 2 "
      "corpus_seed: 20261202 min_doc_len: 2 max_doc_len: 12 corpus_documents: 4096 } optim { "
      "lr: 0.01 beta1: 0.9 beta2: 0.95 eps: 1e-08 weight_decay: 0 grad_clip: 1 warmup_steps: "
      "10 } world: 2 ep: 2 grad_acc: 1 steps: 2 backend: thread sharding: fsdp reduce_dtype: "
      "f32 compute_dtype: f32 seed: 1 alpha_b: 0.01 alpha_z: 0.01 dump_dir: \"\" metrics: \"\" "
      "checkpoint_dir: \"",
      dir,
      "\" checkpoint_every: 0 resume: false parity_check: false parity_tolerance: 1e-05 "
      "timeout_s: 60 ce_mode: token nccl_skip_agreement: false layers_per_unit: 1 "
      "reshard_after_forward: true reduce_every_micro_batch: true bucket_cap_mb: 25 "
      "first_bucket_mb: 1 export_path: \"\" init_from: \"\" reproducible: false");
  RewriteMarkerExtra(marker_path, [&](auto* extra) { (*extra)["config"] = old_layout; });

  TrainConfig again = first;
  again.mutable_optim()->set_steps(3);
  again.mutable_checkpoint()->set_resume(true);
  const std::vector<StepMetrics> resumed = TrainOrDie(again);
  TrainConfig uninterrupted = again;
  uninterrupted.clear_checkpoint();
  const std::vector<StepMetrics> want = TrainOrDie(uninterrupted);
  ASSERT_EQ(resumed.size(), 1u);
  ASSERT_EQ(want.size(), 3u);
  EXPECT_EQ(resumed[0].step(), 3);
  EXPECT_EQ(resumed[0].ce(), want[2].ce());
  EXPECT_EQ(resumed[0].grad_norm(), want[2].grad_norm());

  // The same marker with another global batch in the old layout is refused by name.
  RewriteMarkerExtra(marker_path, [](auto* extra) {
    (*extra)["config"] = "world: 2 ep: 2 grad_acc: 2 data { seq_len: 16 }";
  });
  std::filesystem::remove_all(dir + "/step-00000003");
  auto refused = RunInProcess(again);
  ASSERT_TRUE(refused.ok());
  EXPECT_EQ((*refused)[0].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT((*refused)[0].status.message(),
              HasSubstr("global batch B=32 (world x grad_acc x micro_batch = 2 x 2 x 8)"));
}

TEST(TrainerTest, ResumeWithoutCheckpointIsNotFound) {
  const std::string dir = ::testing::TempDir() + "/empty_ckpt";
  std::filesystem::create_directories(dir);
  TrainConfig config = TinyConfig(2, 1, 1, TrainConfig::fsdp);
  config.mutable_checkpoint()->set_dir(dir);
  config.mutable_checkpoint()->set_resume(true);
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  for (const RankOutcome& r : *out) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kNotFound) << r.status;
    EXPECT_THAT(r.status.message(), HasSubstr(dir));
  }
}

// The mesh is built from the config's parallelism section, so its group sizes are the
// config's; a backend whose world has another size (an MPI job launched with another -np)
// is refused there, naming both.
TEST(TrainerTest, AWorldOfAnotherSizeThanTheConfigIsInvalidArgument) {
  const TrainConfig config = ResolvedConfig(TinyConfig(4, 2, 1, TrainConfig::fsdp));
  absl::Status s = testing::RunRanks(2, [&](Communicator& world) -> absl::Status {
    return MakeRankMesh(&world, config.parallelism()).status();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("parallelism.world=4: the backend has 2 ranks"));
}

TEST(TrainerTest, BadConfigFailsBeforeTraining) {
  TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  config.mutable_model()->set_experts(3);  // 3 % ep 2 != 0
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT((*out)[0].status.message(),
              HasSubstr("parallelism.ep=2: must divide model.experts=3"));
  EXPECT_TRUE((*out)[0].history.empty());
}

// bf16 compute and bf16 reduction train, and stay close to the fp32 gradients.
TEST(TrainerTest, Bf16ComputeAndReduceStayNearTheReference) {
  TrainConfig config = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  config.mutable_precision()->set_compute_dtype(TrainConfig::bf16);
  config.mutable_precision()->set_reduce_dtype(TrainConfig::bf16);
  config.mutable_debug()->set_parity_check(true);  // bf16 uses a 3e-2 bar
  auto out = RunInProcess(config);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
  ASSERT_TRUE((*out)[0].parity.has_value());
  EXPECT_TRUE((*out)[0].parity->ok) << (*out)[0].parity->ToString();
  EXPECT_GT((*out)[0].parity->worst, 1e-6) << "bf16 should not be exact";
}

}  // namespace
}  // namespace gradsum::train
