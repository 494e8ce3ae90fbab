// Activation recomputation (--recompute, SEMANTICS.md §14): nothing observable happens
// twice, and the gradients are the same bits.
//  - Every mode gives bit-identical reduced gradients (step 1), logged values and later
//    steps to the run without recomputation, at G = 1 and G = 2 in normal mode, with and
//    without attention, EP and sequence parallelism; --parity_check passes in each.
//  - The re-run forward issues no all-reduce, all-gather or reduce-scatter (the §5 counts
//    are not reduced again, parameters are not gathered again): counted by the timing
//    decorator. Only the exchanges of the re-run layer (EP dispatch, SP head split) repeat.
//  - --reproducible with full recomputation gives the same bits at world 1 and world 4,
//    with and without SP.
//  - A checkpoint resumes under another mode onto the same bits.
//  - The activations held: full < selective < none, and under full each extra layer adds
//    only its input and its routing decisions.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "train/config.pb.h"
#include "train/metrics.pb.h"
#include "train/test_util.h"

namespace gradsum::train {
namespace {

struct Ranks {
  std::vector<RankOutcome> ranks;
};

Ranks RunOrDie(const TrainConfig& config) {
  absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  for (const RankOutcome& r : *out) EXPECT_TRUE(r.status.ok()) << r.status;
  return {*std::move(out)};
}

TrainConfig WithRecompute(TrainConfig c, ParallelismConfig::Recompute mode) {
  c.mutable_parallelism()->set_recompute(mode);
  return c;
}

// The displayed values of a step: what the run reports, bit for bit.
void ExpectSameDisplay(const StepMetrics& got, const StepMetrics& want, const std::string& what) {
  EXPECT_EQ(got.ce(), want.ce()) << what;
  EXPECT_EQ(got.z(), want.z()) << what;
  EXPECT_EQ(got.bal(), want.bal()) << what;
  EXPECT_EQ(got.loss(), want.loss()) << what;
  EXPECT_EQ(got.valid_tokens(), want.valid_tokens()) << what;
  EXPECT_EQ(got.routed_tokens(), want.routed_tokens()) << what;
  EXPECT_EQ(got.grad_norm(), want.grad_norm()) << what;
  ASSERT_EQ(got.maxvio_size(), want.maxvio_size()) << what;
  for (int l = 0; l < got.maxvio_size(); ++l) EXPECT_EQ(got.maxvio(l), want.maxvio(l)) << what;
}

struct Mesh {
  int world, ep, sp, grad_acc;
  bool attention;
};

TrainConfig MeshConfig(const Mesh& m, int steps) {
  TrainConfig c = TinyConfig(m.world, m.ep, m.grad_acc, TrainConfig::fsdp);
  c.mutable_optim()->set_steps(steps);
  c.mutable_parallelism()->set_sp(m.sp);
  c.mutable_debug()->set_parity_check(true);
  if (m.attention) {
    ModelConfig* model = c.mutable_model();
    model->set_attention(ModelConfig::causal);
    model->set_heads(4);
    model->set_kv_heads(2);
    model->set_rope_theta(100);
  }
  return c;
}

std::string MeshName(const Mesh& m) {
  return absl::StrCat("world ", m.world, " ep ", m.ep, " sp ", m.sp, " G ", m.grad_acc,
                      m.attention ? " attention" : " no attention");
}

int64_t Calls(const StepMetrics& r, int64_t (StepMetrics::*field)() const) { return (r.*field)(); }

TEST(RecomputeTest, EveryModeGivesTheSameBitsAndReducesNothingAgain) {
  const int kSteps = 3, L = 2;
  for (const Mesh& m : std::vector<Mesh>{
           {2, 2, 1, 1, true}, {2, 2, 1, 2, false}, {4, 2, 2, 1, true}, {4, 1, 2, 2, true}}) {
    const std::string mesh = MeshName(m);
    const TrainConfig base = MeshConfig(m, kSteps);
    const Ranks none = RunOrDie(WithRecompute(base, ParallelismConfig::none));
    ASSERT_EQ(none.ranks.size(), static_cast<size_t>(m.world)) << mesh;
    for (auto mode : {ParallelismConfig::selective, ParallelismConfig::full}) {
      const std::string what = absl::StrCat(mesh, ", ", ParallelismConfig::Recompute_Name(mode));
      const Ranks run = RunOrDie(WithRecompute(base, mode));
      ASSERT_EQ(run.ranks.size(), none.ranks.size()) << what;
      for (size_t rank = 0; rank < run.ranks.size(); ++rank) {
        const RankOutcome& got = run.ranks[rank];
        const RankOutcome& want = none.ranks[rank];
        ASSERT_EQ(got.history.size(), static_cast<size_t>(kSteps)) << what;
        ASSERT_TRUE(got.first_step_grads.has_value() && want.first_step_grads.has_value());
        EXPECT_EQ(*got.first_step_grads, *want.first_step_grads) << what << " rank " << rank;
        if (rank == 0) {
          ASSERT_TRUE(got.parity.has_value()) << what;
          EXPECT_TRUE(got.parity->ok) << what << ": " << got.parity->ToString();
        }
        for (int s = 0; s < kSteps; ++s) {
          const StepMetrics& g = got.history[s];
          const StepMetrics& w = want.history[s];
          const std::string at = absl::StrCat(what, " rank ", rank, " step ", s + 1);
          ExpectSameDisplay(g, w, at);
          // No reduction or gather is issued again: the §5 counts, the display losses, the
          // gradients and the parameter gathers are the first forward's.
          for (auto field : {&StepMetrics::all_reduce_calls, &StepMetrics::all_gather_calls,
                             &StepMetrics::reduce_scatter_calls}) {
            EXPECT_EQ(Calls(g, field), Calls(w, field)) << at;
          }
          EXPECT_GT(w.all_reduce_calls(), 0) << at;
          if (s == 0) continue;  // step 1 also ran the parity check's collectives
          const int64_t a2a = g.all_to_all_calls() - w.all_to_all_calls();
          const int64_t sp_a2a = g.sp_all_to_all_calls() - w.sp_all_to_all_calls();
          if (mode == ParallelismConfig::selective) {
            EXPECT_EQ(a2a, 0) << at;  // only norms re-run: no exchange
            EXPECT_EQ(sp_a2a, 0) << at;
          } else {
            // Each layer's forward exchanges are re-done once per micro-batch, the same
            // number in every layer and micro-batch.
            EXPECT_EQ(a2a % (L * m.grad_acc), 0) << at;
            EXPECT_EQ(sp_a2a % (L * m.grad_acc), 0) << at;
            EXPECT_EQ(a2a > 0, m.ep > 1) << at << ": " << a2a << " more EP all-to-alls";
            EXPECT_EQ(sp_a2a > 0, m.sp > 1 && m.attention) << at;
          }
        }
      }
    }
  }
}

// SEMANTICS.md §11: under --reproducible the same bits at every mesh; full recomputation
// keeps that: world 4 (EP 2, 2 sequences per rank) and world 4 with SP 2 (EP 2, two SP
// groups of 4 sequences) with full recomputation, against world 1 (8 sequences) without;
// the global batch, G and the contribution blocks (8 tokens) the same.
TEST(RecomputeTest, ReproducibleFullRecomputationGivesTheSameBitsAtEveryMesh) {
  auto config = [](int world, int ep, int sp, ParallelismConfig::Recompute mode) {
    TrainConfig c = MeshConfig({world, ep, sp, 1, true}, 3);
    c.mutable_debug()->set_parity_check(false);
    c.mutable_data()->set_micro_batch(8 * sp / world);
    c.mutable_precision()->set_reproducible(true);
    c.mutable_precision()->set_repro_block(8);
    c.mutable_parallelism()->set_recompute(mode);
    return c;
  };
  const Ranks one = RunOrDie(config(1, 1, 1, ParallelismConfig::none));
  const Ranks four = RunOrDie(config(4, 2, 1, ParallelismConfig::full));
  const Ranks four_none = RunOrDie(config(4, 2, 1, ParallelismConfig::none));
  const Ranks four_sp = RunOrDie(config(4, 2, 2, ParallelismConfig::full));
  ASSERT_FALSE(one.ranks.empty());
  ASSERT_FALSE(four.ranks.empty());
  ASSERT_FALSE(four_none.ranks.empty());
  ASSERT_FALSE(four_sp.ranks.empty());
  for (int s = 0; s < 3; ++s) {
    ExpectSameDisplay(four.ranks[0].history[s], one.ranks[0].history[s],
                      absl::StrCat("world 4 full vs world 1 none, step ", s + 1));
    ExpectSameDisplay(four.ranks[0].history[s], four_none.ranks[0].history[s],
                      absl::StrCat("world 4 full vs none, step ", s + 1));
    ExpectSameDisplay(four_sp.ranks[0].history[s], one.ranks[0].history[s],
                      absl::StrCat("world 4 sp 2 full vs world 1 none, step ", s + 1));
  }
}

// What a layer keeps is not part of the training state: a run checkpointed without
// recomputation resumes with full recomputation (and back) onto the uninterrupted run's bits.
TEST(RecomputeTest, ResumeWithAnotherModeContinuesTheSameBits) {
  const std::string dir = ::testing::TempDir() + "/recompute_resume";
  std::filesystem::remove_all(dir);
  auto config = [&](int steps, ParallelismConfig::Recompute mode, bool resume) {
    TrainConfig c = MeshConfig({2, 2, 1, 1, true}, steps);
    c.mutable_debug()->set_parity_check(false);
    c.mutable_parallelism()->set_recompute(mode);
    c.mutable_checkpoint()->set_dir(dir);
    c.mutable_checkpoint()->set_resume(resume);
    return c;
  };
  TrainConfig uninterrupted = config(6, ParallelismConfig::none, false);
  uninterrupted.mutable_checkpoint()->clear_dir();
  const Ranks want = RunOrDie(uninterrupted);
  RunOrDie(config(2, ParallelismConfig::none, false));
  const Ranks second = RunOrDie(config(4, ParallelismConfig::full, true));
  const Ranks third = RunOrDie(config(6, ParallelismConfig::selective, true));
  ASSERT_FALSE(want.ranks.empty() || second.ranks.empty() || third.ranks.empty());
  ASSERT_EQ(want.ranks[0].history.size(), 6u);
  std::vector<StepMetrics> resumed = second.ranks[0].history;
  resumed.insert(resumed.end(), third.ranks[0].history.begin(), third.ranks[0].history.end());
  ASSERT_EQ(resumed.size(), 4u);
  for (const StepMetrics& got : resumed) {
    ExpectSameDisplay(got, want.ranks[0].history[got.step() - 1],
                      absl::StrCat("resumed step ", got.step()));
  }
}

// The step's peak activation bytes (counted from the buffers held): each mode holds less
// than the one before, and the bytes each extra layer adds shrink in the same order. Under
// full recomputation a layer keeps its input [T, D] and its routing decisions (router
// logits and probabilities [T, E], expert index and weight [T, K], the routed flags [T]),
// with the row blocks of its experts: nothing that grows with the expert width.
TEST(RecomputeTest, EachModeHoldsLessAndFullKeepsOnlyInputsAndRoutes) {
  auto bytes = [](int layers, ParallelismConfig::Recompute mode) -> int64_t {
    TrainConfig c = MeshConfig({1, 1, 1, 1, true}, 1);
    c.mutable_debug()->set_parity_check(false);
    c.mutable_model()->set_layers(layers);
    c.mutable_model()->set_expert_dim(64);
    c.mutable_parallelism()->set_recompute(mode);
    const Ranks run = RunOrDie(c);
    return run.ranks.empty() ? 0 : run.ranks[0].history.at(0).peak_activation_bytes();
  };
  const int64_t none2 = bytes(2, ParallelismConfig::none),
                none4 = bytes(4, ParallelismConfig::none);
  const int64_t sel2 = bytes(2, ParallelismConfig::selective);
  const int64_t sel4 = bytes(4, ParallelismConfig::selective);
  const int64_t full2 = bytes(2, ParallelismConfig::full),
                full4 = bytes(4, ParallelismConfig::full);
  EXPECT_LT(sel4, none4);
  EXPECT_LT(full4, sel4);
  const int64_t per_none = (none4 - none2) / 2, per_sel = (sel4 - sel2) / 2;
  const int64_t per_full = (full4 - full2) / 2;
  EXPECT_LT(per_sel, per_none);
  EXPECT_LT(per_full, per_sel);
  // TinyConfig: 2 sequences of 16 tokens, D = 8, E = 4, K = 2. The router state and the
  // input are per token; the row blocks are a few int64 per expert.
  const int64_t T = 32, D = 8, E = 4, K = 2;
  const int64_t input_and_route = 4 * T * D + 2 * 4 * T * E + T * K * (4 + 4) + T;
  EXPECT_GE(per_full, input_and_route);
  EXPECT_LE(per_full, input_and_route + 1024) << "full keeps more than inputs and routes";
}

}  // namespace
}  // namespace gradsum::train
