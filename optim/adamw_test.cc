#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/thread_backend.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "parallel/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

using sharding_testing::DenseSpecs;
using sharding_testing::ExpertSpecs;
using sharding_testing::InitGroup;
using sharding_testing::InitValue;
using sharding_testing::Noise;
using sharding_testing::ToyTrainStep;
using testing::RunRanks;

// Straightforward scalar AdamW in double (torch.optim.AdamW's formula).
struct ScalarAdamW {
  AdamWOptions o;
  double m = 0, v = 0;
  double m_abs = 0;  // m's recursion on |g|: the scale of m's rounding error under cancellation
  int t = 0;
  void Step(double& p, double g) {
    ++t;
    p *= 1 - o.lr * o.weight_decay;
    m = o.beta1 * m + (1 - o.beta1) * g;
    m_abs = o.beta1 * m_abs + (1 - o.beta1) * std::fabs(g);
    v = o.beta2 * v + (1 - o.beta2) * g * g;
    const double m_hat = m / (1 - std::pow(o.beta1, t));
    const double v_hat = v / (1 - std::pow(o.beta2, t));
    p -= o.lr * m_hat / (std::sqrt(v_hat) + o.eps);
  }
};

TEST(AdamWTest, SingleRankMatchesScalarReference) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  auto fp = FlatParam::Create("g", {{"w", {40}}}, (*comms)[0].get());
  ASSERT_TRUE(fp.ok());
  ASSERT_TRUE(InitGroup(**fp).ok());
  AdamWOptions o{.lr = 0.01, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1};
  auto opt = ShardedAdamW::Create({fp->get()}, o);
  ASSERT_TRUE(opt.ok());
  const std::vector<float> init = InitValue("w", 40);
  std::vector<double> ref_p(init.begin(), init.end());
  std::vector<ScalarAdamW> ref(40, ScalarAdamW{o});
  for (int step = 0; step < 20; ++step) {
    absl::Span<float> g = (*fp)->master_grad();
    for (int i = 0; i < 40; ++i) {
      // Gradients of all magnitudes, including exact zeros.
      g[i] =
          i % 10 == 0 ? 0.0f : static_cast<float>(Noise("g", i, step) * std::pow(10.0, i % 7 - 3));
      ref[i].Step(ref_p[i], g[i]);
    }
    ASSERT_TRUE((*opt)->Step().ok());
    EXPECT_EQ((*opt)->step(), step + 1);
    for (int i = 0; i < 40; ++i) {
      EXPECT_NEAR((*fp)->master()[i], ref_p[i], 1e-6 + 1e-6 * std::fabs(ref_p[i]))
          << step << " " << i;
      EXPECT_NEAR((*opt)->exp_avg(0)[i], ref[i].m, 1e-6 * ref[i].m_abs);
      EXPECT_NEAR((*opt)->exp_avg_sq(0)[i], ref[i].v, 1e-6 * ref[i].v + 1e-18);
    }
  }
}

// decay_vectors = false: 1-D parameters (norm gains, biases) get no weight decay, matrices
// and embeddings do, also where a shard boundary cuts a parameter (3 ranks over a group of
// 1-D and 2-D parameters); decay_vectors = true decays every element, as before.
TEST(AdamWTest, DecayVectorsFalseExemptsOneDimensionalParameters) {
  const std::vector<ParamSpec> specs = {
      {"norm", {7}}, {"w", {5, 4}}, {"bias", {9}}, {"emb", {3, 6}}};
  for (bool decay_vectors : {false, true}) {
    for (ShardingMode mode : {ShardingMode::kSharded, ShardingMode::kReplicated}) {
      absl::Status s = RunRanks(3, [&](Communicator& comm) -> absl::Status {
        FlatParamOptions fo;
        fo.mode = mode;
        GRADSUM_ASSIGN_OR_RETURN(auto fp, FlatParam::Create("g", specs, &comm, fo));
        GRADSUM_RETURN_IF_ERROR(InitGroup(*fp));
        AdamWOptions o{.lr = 0.05,
                       .beta1 = 0.9,
                       .beta2 = 0.99,
                       .eps = 1e-8,
                       .weight_decay = 0.3,
                       .decay_vectors = decay_vectors};
        GRADSUM_ASSIGN_OR_RETURN(auto opt, ShardedAdamW::Create({fp.get()}, o));
        const int64_t first = fp->master_offset();
        const int64_t n = static_cast<int64_t>(fp->master().size());
        // Each element's parameter (by flat index) and the reference state.
        std::vector<bool> decays(n, true);
        for (const FlatParamEntry& e : fp->entries()) {
          for (int64_t i = std::max(e.offset, first); i < std::min(e.offset + e.numel, first + n);
               ++i) {
            decays[i - first] = decay_vectors || e.shape.size() >= 2;
          }
        }
        std::vector<double> ref_p(fp->master().begin(), fp->master().end());
        std::vector<ScalarAdamW> ref(n);
        for (int64_t i = 0; i < n; ++i) {
          ref[i].o = o;
          if (!decays[i]) ref[i].o.weight_decay = 0.0;
        }
        for (int step = 0; step < 5; ++step) {
          absl::Span<float> g = fp->master_grad();
          for (int64_t i = 0; i < n; ++i) {
            g[i] = static_cast<float>(std::sin(0.7 * (first + i) + step));
            ref[i].Step(ref_p[i], g[i]);
          }
          GRADSUM_RETURN_IF_ERROR(opt->Step());
        }
        for (int64_t i = 0; i < fp->numel() - first && i < n; ++i) {
          if (std::fabs(fp->master()[i] - ref_p[i]) > 1e-6 + 1e-6 * std::fabs(ref_p[i])) {
            return absl::InternalError(
                absl::StrCat("element ", first + i, ": ", fp->master()[i], " vs ", ref_p[i]));
          }
        }
        return absl::OkStatus();
      });
      EXPECT_TRUE(s.ok()) << "decay_vectors " << decay_vectors << " " << ShardingModeName(mode)
                          << ": " << s;
    }
  }
}

TEST(AdamWTest, OptionsAreValidated) {
  for (AdamWOptions bad :
       {AdamWOptions{.lr = -1}, AdamWOptions{.beta1 = 1.0}, AdamWOptions{.beta2 = -0.1},
        AdamWOptions{.eps = 0}, AdamWOptions{.weight_decay = -0.5}, AdamWOptions{.lr = NAN}}) {
    auto opt = ShardedAdamW::Create({}, bad);
    EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument) << opt.status();
  }
  EXPECT_EQ(ShardedAdamW::Create({nullptr}, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto opt = ShardedAdamW::Create({}, {});
  ASSERT_TRUE(opt.ok());
  EXPECT_EQ((*opt)->set_lr(-2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*opt)->set_lr(0.5).ok());
  EXPECT_EQ((*opt)->options().lr, 0.5);
  EXPECT_EQ((*opt)->set_step(-1).code(), absl::StatusCode::kInvalidArgument);
}

// ---- End to end: toy training on a (F, P) mesh vs a single-process double reference. ----

struct ToySetup {
  int world, ep, micro_batches, steps;
  double max_norm;
  ShardingMode mode;
};

AdamWOptions ToyAdamW() {
  return {.lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.01};
}

// Full parameter values after training, by name.
using Params = std::map<std::string, std::vector<double>>;

Params ReferenceTraining(const ToySetup& s) {
  struct P {
    std::string name;
    int slot;  // -1: dense (all ranks contribute)
    std::vector<double> theta;
    std::vector<ScalarAdamW> adam;
  };
  std::vector<P> params;
  auto add = [&](const std::vector<ParamSpec>& specs, int slot) {
    for (const ParamSpec& sp : specs) {
      int64_t n = 1;
      for (int64_t d : sp.shape) n *= d;
      const std::vector<float> init = InitValue(sp.name, n);
      params.push_back({sp.name,
                        slot,
                        {init.begin(), init.end()},
                        std::vector<ScalarAdamW>(n, ScalarAdamW{ToyAdamW()})});
    }
  };
  add(DenseSpecs(), -1);
  if (s.ep > 1) {
    for (int p = 0; p < s.ep; ++p) add(ExpertSpecs(p, 2), p);
  }
  for (int t = 0; t < s.steps; ++t) {
    std::vector<std::vector<double>> grads;
    double sq = 0;
    for (const P& p : params) {
      std::vector<double> g(p.theta.size(), 0.0);
      for (size_t i = 0; i < g.size(); ++i) {
        for (int r = 0; r < s.world; ++r) {
          if (p.slot >= 0 && r % s.ep != p.slot) continue;
          for (int m = 0; m < s.micro_batches; ++m) {
            const double a = static_cast<float>(0.75 + 0.25 * Noise(p.name, i, r, m, t));
            const double c = static_cast<float>(Noise(p.name, i, r + 1000, m, t));
            g[i] += a * (p.theta[i] - c);
          }
        }
        sq += g[i] * g[i];
      }
      grads.push_back(std::move(g));
    }
    const double norm = std::sqrt(sq);
    const double scale = s.max_norm > 0 && norm > s.max_norm ? s.max_norm / (norm + 1e-6) : 1.0;
    for (size_t k = 0; k < params.size(); ++k) {
      for (size_t i = 0; i < params[k].theta.size(); ++i) {
        params[k].adam[i].Step(params[k].theta[i], grads[k][i] * scale);
      }
    }
  }
  Params out;
  for (P& p : params) out[p.name] = std::move(p.theta);
  return out;
}

absl::StatusOr<Params> DistributedTraining(const ToySetup& s) {
  Params out;
  std::mutex mu;
  absl::Status status = RunRanks(s.world, [&](Communicator& comm) -> absl::Status {
    const int slot = comm.rank() % s.ep;
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> edp,
                             comm.Split(slot, comm.rank() / s.ep));
    FlatParamOptions opts;
    opts.mode = s.mode;
    std::vector<std::unique_ptr<FlatParam>> owned;
    GRADSUM_ASSIGN_OR_RETURN(auto dense, FlatParam::Create("dense", DenseSpecs(), &comm, opts));
    owned.push_back(std::move(dense));
    if (s.ep > 1) {
      GRADSUM_ASSIGN_OR_RETURN(
          auto experts, FlatParam::Create(absl::StrCat("experts.ep", slot), ExpertSpecs(slot, 2),
                                          edp.get(), opts));
      owned.push_back(std::move(experts));
    }
    std::vector<FlatParam*> groups;
    for (auto& g : owned) {
      GRADSUM_RETURN_IF_ERROR(InitGroup(*g));
      groups.push_back(g.get());
    }
    GRADSUM_ASSIGN_OR_RETURN(auto opt, ShardedAdamW::Create(groups, ToyAdamW()));
    for (int t = 0; t < s.steps; ++t) {
      GRADSUM_RETURN_IF_ERROR(ToyTrainStep(groups, *opt, comm, s.micro_batches, s.max_norm));
    }
    for (FlatParam* g : groups) {
      GRADSUM_RETURN_IF_ERROR(g->Unshard());
      if (g->group_rank() != 0) continue;
      std::lock_guard<std::mutex> lock(mu);
      for (int k = 0; k < g->num_params(); ++k) {
        GRADSUM_ASSIGN_OR_RETURN(TensorView v, g->param(k));
        out[g->entries()[k].name].assign(v.data<float>(), v.data<float>() + v.numel());
      }
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return out;
}

TEST(AdamWTest, ToyTrainingOnMeshMatchesDoubleReference) {
  const ToySetup setups[] = {
      {1, 1, 2, 3, 0.0, ShardingMode::kSharded},    {2, 1, 3, 3, 1.0, ShardingMode::kSharded},
      {3, 1, 2, 3, 1.0, ShardingMode::kReplicated}, {4, 2, 2, 3, 1.0, ShardingMode::kSharded},
      {5, 1, 1, 3, 0.5, ShardingMode::kSharded},    {6, 3, 2, 3, 1.0, ShardingMode::kReplicated},
      {7, 1, 2, 3, 0.0, ShardingMode::kSharded},    {8, 4, 2, 3, 1.0, ShardingMode::kSharded},
      {8, 2, 1, 3, 1.0, ShardingMode::kReplicated},
  };
  for (const ToySetup& s : setups) {
    const Params ref = ReferenceTraining(s);
    absl::StatusOr<Params> got = DistributedTraining(s);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), ref.size()) << "world " << s.world;
    for (const auto& [name, want] : ref) {
      const std::vector<double>& have = got->at(name);
      ASSERT_EQ(have.size(), want.size()) << name;
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_NEAR(have[i], want[i], 2e-5)
            << "world " << s.world << " ep " << s.ep << " " << name << "[" << i << "]";
      }
    }
  }
}

}  // namespace
}  // namespace gradsum
