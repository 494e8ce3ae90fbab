#include "optim/grad_norm.h"

#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "parallel/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

using sharding_testing::DenseSpecs;
using sharding_testing::ExpertSpecs;
using sharding_testing::Noise;
using testing::RunRanks;

float G(const std::string& name, int64_t i, int rank) {
  return static_cast<float>(Noise(name, i, rank, 0, 42));
}

// World W = F * P: a dense group over the world and, per EP slot p, an expert group
// "experts.ep<p>" over its EDP group (ranks f * P + p). Returns every rank's norm and
// the norm after clipping to `max_norm` (if > 0).
absl::Status MeshNorms(int world, int ep, ShardingMode mode, double max_norm,
                       std::vector<double>* norms, std::vector<double>* clipped) {
  norms->assign(world, -1);
  clipped->assign(world, -1);
  return RunRanks(world, [&](Communicator& comm) -> absl::Status {
    const int p = comm.rank() % ep;
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> edp, comm.Split(p, comm.rank() / ep));
    FlatParamOptions opts;
    opts.mode = mode;
    GRADSUM_ASSIGN_OR_RETURN(auto dense, FlatParam::Create("dense", DenseSpecs(), &comm, opts));
    GRADSUM_ASSIGN_OR_RETURN(auto experts, FlatParam::Create(absl::StrCat("experts.ep", p),
                                                             ExpertSpecs(p, 2), edp.get(), opts));
    std::vector<FlatParam*> groups = {dense.get(), experts.get()};
    for (FlatParam* g : groups) {
      for (int k = 0; k < g->num_params(); ++k) {
        GRADSUM_ASSIGN_OR_RETURN(TensorView t, g->grad(k));
        for (int64_t i = 0; i < t.numel(); ++i)
          t.data<float>()[i] = G(g->entries()[k].name, i, comm.rank());
      }
      GRADSUM_RETURN_IF_ERROR(g->ReduceGrad(true));
    }
    GRADSUM_ASSIGN_OR_RETURN((*norms)[comm.rank()], GlobalGradNorm(groups, comm));
    if (max_norm > 0) {
      GRADSUM_ASSIGN_OR_RETURN(double before, ClipGradNorm(groups, comm, max_norm));
      if (before != (*norms)[comm.rank()]) return absl::InternalError("clip returned another norm");
      GRADSUM_ASSIGN_OR_RETURN((*clipped)[comm.rank()], GlobalGradNorm(groups, comm));
    }
    return absl::OkStatus();
  });
}

// Direct double computation: each parameter element's reduced gradient once.
double ReferenceNorm(int world, int ep) {
  double sq = 0;
  auto add = [&](const std::vector<ParamSpec>& specs, int slot) {
    for (const ParamSpec& s : specs) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      for (int64_t i = 0; i < n; ++i) {
        double g = 0;
        for (int r = 0; r < world; ++r) {
          if (slot < 0 || r % ep == slot) g += G(s.name, i, r);
        }
        sq += g * g;
      }
    }
  };
  add(DenseSpecs(), -1);
  for (int p = 0; p < ep; ++p) add(ExpertSpecs(p, 2), p);
  return std::sqrt(sq);
}

TEST(GradNormTest, CountsEveryElementOnceAcrossDenseAndExpertGroups) {
  for (const auto& [world, ep] : std::vector<std::pair<int, int>>{
           {1, 1}, {2, 1}, {2, 2}, {3, 1}, {4, 2}, {4, 4}, {6, 3}, {8, 2}, {8, 4}}) {
    const double ref = ReferenceNorm(world, ep);
    std::vector<double> sharded, replicated, unused;
    ASSERT_TRUE(MeshNorms(world, ep, ShardingMode::kSharded, 0, &sharded, &unused).ok());
    ASSERT_TRUE(MeshNorms(world, ep, ShardingMode::kReplicated, 0, &replicated, &unused).ok());
    for (int r = 0; r < world; ++r) {
      EXPECT_NEAR(sharded[r], ref, ref * 1e-6) << "world " << world << " ep " << ep;
      EXPECT_EQ(sharded[r], sharded[0]);     // identical on every rank
      EXPECT_EQ(replicated[r], sharded[r]);  // bit-identical across modes (G == 1)
    }
  }
}

TEST(GradNormTest, ClipScalesToMaxNorm) {
  std::vector<double> norms, clipped;
  ASSERT_TRUE(MeshNorms(8, 4, ShardingMode::kSharded, 0.5, &norms, &clipped).ok());
  ASSERT_GT(norms[0], 1.0);
  for (int r = 0; r < 8; ++r) EXPECT_NEAR(clipped[r], 0.5, 1e-6);
  // Below the threshold nothing changes.
  ASSERT_TRUE(MeshNorms(4, 2, ShardingMode::kReplicated, 1e6, &norms, &clipped).ok());
  for (int r = 0; r < 4; ++r) EXPECT_EQ(clipped[r], norms[r]);
}

TEST(GradNormTest, BadArgumentsAndNonFiniteNorm) {
  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(auto fp, FlatParam::Create("g", {{"w", {3}}}, &comm));
    std::vector<FlatParam*> groups = {fp.get()};
    if (ClipGradNorm(groups, comm, 0.0).status().code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("max_norm 0 accepted");
    }
    GRADSUM_ASSIGN_OR_RETURN(TensorView g, fp->grad(0));
    g.data<float>()[1] = comm.rank() == 0 ? INFINITY : 1.0f;
    g.data<float>()[0] = 2.0f;
    GRADSUM_RETURN_IF_ERROR(fp->ReduceGrad(true));
    GRADSUM_ASSIGN_OR_RETURN(double norm, ClipGradNorm(groups, comm, 1.0));
    if (!std::isinf(norm)) return absl::InternalError(absl::StrCat("norm ", norm));
    // Gradients are left as they were (the caller skips the step).
    if (comm.rank() == 0 && fp->master_grad()[0] != 4.0f) return absl::InternalError("scaled");
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum
