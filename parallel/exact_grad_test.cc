// Exact-gradient mode (GradPrecision::kExact, SEMANTICS.md §11): the reduced
// gradient and the global norm are the same bits for every world size, micro-batch count,
// sharding mode and reduction path (FlatParam's own, BucketedGradReducer), with the
// contributions ("sequences") split differently over ranks and micro-batches, and equal to
// an independent reference (testing/exact_sum_reference.h: __int128 sums of each
// contribution rounded to the LSB).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/exact_sum.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "optim/grad_norm.h"
#include "parallel/bucketed_reduce.h"
#include "parallel/exact_grad_testing.h"
#include "parallel/flat_param.h"
#include "parallel/test_util.h"
#include "testing/exact_sum_reference.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

namespace ref = exact_reference;
using exact_grad_testing::Config;
using exact_grad_testing::Contribution;
using exact_grad_testing::GroupSpecs;
using exact_grad_testing::kSequences;
using exact_grad_testing::MakeContribution;
using exact_grad_testing::Reference;
using exact_grad_testing::Result;
using sharding_testing::DenseSpecs;
using testing::RunRanks;

int64_t Numel(const ParamSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  return n;
}

// Every rank's RankStep on the thread backend; the ranks' owned slices together and the
// norm, which every rank must report identically.
absl::StatusOr<Result> RunMesh(const Config& cfg, int shift, int nan_rank = -1,
                               double max_norm = 0) {
  Result out;
  for (const auto& g : Reference().grads) out.grads.emplace_back(g.size(), -12345.0f);
  std::vector<double> norms(cfg.world, 0.0);
  std::vector<std::vector<std::vector<float>>> per_rank(cfg.world, out.grads);
  absl::Status s = RunRanks(cfg.world, [&](Communicator& comm) -> absl::Status {
    return exact_grad_testing::RankStep(comm, cfg, shift, nan_rank, max_norm,
                                        &per_rank[comm.rank()], &norms[comm.rank()]);
  });
  if (!s.ok()) return s;
  for (int r = 0; r < cfg.world; ++r) {
    if (std::memcmp(&norms[r], &norms[0], sizeof(double)) != 0) {
      return absl::InternalError(absl::StrCat("rank ", r, " norm ", norms[r], " != ", norms[0]));
    }
    for (size_t g = 0; g < out.grads.size(); ++g) {
      for (size_t i = 0; i < out.grads[g].size(); ++i) {
        if (per_rank[r][g][i] != -12345.0f) out.grads[g][i] = per_rank[r][g][i];
      }
    }
  }
  out.norm = norms[0];
  return out;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<Config> AllConfigs() {
  std::vector<Config> c;
  for (int w : {1, 2, 3, 4}) {
    for (int g : {1, 2, 3}) {
      c.push_back({w, g, ShardingMode::kSharded, true, false});
      c.push_back({w, g, ShardingMode::kSharded, false, false});
      c.push_back({w, g, ShardingMode::kReplicated, true, false});
      c.push_back({w, g, ShardingMode::kReplicated, true, true});
    }
  }
  return c;
}

TEST(ExactGradTest, EveryMeshGivesTheReferenceBits) {
  const Result want = Reference();
  ASSERT_TRUE(std::isfinite(want.norm));
  for (const Config& cfg : AllConfigs()) {
    for (int shift : {0, 5}) {
      absl::StatusOr<Result> got = RunMesh(cfg, shift);
      ASSERT_TRUE(got.ok()) << cfg.Name() << ": " << got.status();
      for (size_t g = 0; g < want.grads.size(); ++g) {
        for (size_t i = 0; i < want.grads[g].size(); ++i) {
          ASSERT_EQ(Bits(got->grads[g][i]), Bits(want.grads[g][i]))
              << cfg.Name() << " shift " << shift << " group " << g << " element " << i << ": "
              << got->grads[g][i] << " vs " << want.grads[g][i];
        }
      }
      ASSERT_EQ(got->norm, want.norm) << cfg.Name();
    }
  }
}

TEST(ExactGradTest, ClippedGradientsAreTheSameBitsAtEveryMesh) {
  const Result want = Reference();
  const double max_norm = want.norm / 3;
  const float scale = static_cast<float>(max_norm / (want.norm + 1e-6));  // PyTorch's rule
  for (const Config& cfg : {Config{1, 1, ShardingMode::kSharded, true, false},
                            Config{3, 2, ShardingMode::kSharded, false, false},
                            Config{4, 3, ShardingMode::kReplicated, true, true}}) {
    absl::StatusOr<Result> got = RunMesh(cfg, 1, -1, max_norm);
    ASSERT_TRUE(got.ok()) << cfg.Name() << ": " << got.status();
    EXPECT_EQ(got->norm, want.norm) << cfg.Name();
    for (size_t g = 0; g < want.grads.size(); ++g) {
      for (size_t i = 0; i < want.grads[g].size(); ++i) {
        ASSERT_EQ(Bits(got->grads[g][i]), Bits(want.grads[g][i] * scale)) << cfg.Name();
      }
    }
  }
}

TEST(ExactGradTest, AccurateAgainstLongDouble) {
  // The exact mode still equals the real sum to fp32 rounding (SEMANTICS.md §11).
  const Result want = Reference();
  const auto specs = GroupSpecs();
  for (size_t g = 0; g < specs.size(); ++g) {
    size_t base = 0;
    for (size_t p = 0; p < specs[g].size(); ++p) {
      const int64_t n = Numel(specs[g][p]);
      std::vector<long double> sum(n, 0.0L);
      for (int j = 0; j < kSequences; ++j) {
        const Contribution c = MakeContribution(g, p, j, n);
        for (size_t i = 0; i < c.values.size(); ++i) sum[c.offset + i] += c.values[i];
      }
      for (int64_t i = 0; i < n; ++i) {
        const long double err = std::fabs(want.grads[g][base + i] - sum[i]);
        EXPECT_LE(err, std::fabs(sum[i]) * std::ldexp(1.0L, -24) + std::ldexp(1.0L, -57));
      }
      base += n;
    }
  }
}

TEST(ExactGradTest, ARejectedContributionMakesTheGroupNaNOnEveryRank) {
  const Result want = Reference();
  for (const Config& cfg : {Config{2, 2, ShardingMode::kSharded, true, false},
                            Config{3, 1, ShardingMode::kReplicated, true, false},
                            Config{2, 2, ShardingMode::kReplicated, true, true}}) {
    absl::StatusOr<Result> got = RunMesh(cfg, 0, /*nan_rank=*/1);
    ASSERT_TRUE(got.ok()) << cfg.Name() << ": " << got.status();
    for (float x : got->grads[0]) ASSERT_TRUE(std::isnan(x)) << cfg.Name();
    for (size_t i = 0; i < want.grads[1].size(); ++i) {
      ASSERT_EQ(Bits(got->grads[1][i]), Bits(want.grads[1][i])) << cfg.Name();
    }
    EXPECT_TRUE(std::isnan(got->norm)) << cfg.Name();
  }
}

TEST(ExactGradTest, MisuseIsReported) {
  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    FlatParamOptions exact_opts;
    exact_opts.precision = GradPrecision::kExact;
    GRADSUM_ASSIGN_OR_RETURN(auto ex, FlatParam::Create("ex", DenseSpecs(), &comm, exact_opts));
    GRADSUM_ASSIGN_OR_RETURN(auto plain, FlatParam::Create("plain", DenseSpecs(), &comm));
    if (ex->grad(0).status().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("fp32 grad() in exact mode was accepted");
    }
    if (plain->exact_grad(0).status().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("exact_grad() outside exact mode was accepted");
    }
    if (ex->exact_grad(99).status().code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("bad index accepted");
    }
    const std::vector<float> three(3, 1.0f);
    absl::Status range = ex->AddExactGrad(0, 5, three);  // param 0 has 7 elements
    if (range.code() != absl::StatusCode::kInvalidArgument ||
        range.message().find("offset 5") == absl::string_view::npos) {
      return absl::InternalError(absl::StrCat("out-of-range AddExactGrad: ", range.ToString()));
    }
    if (ex->AddExactGrad(0, -1, three).code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("negative offset accepted");
    }
    if (ex->FoldReducedGrad(std::vector<float>(ex->shard_numel()), true).code() !=
        absl::StatusCode::kUnimplemented) {
      return absl::InternalError("FoldReducedGrad in exact mode was accepted");
    }
    GRADSUM_RETURN_IF_ERROR(ex->StartGradReduce(true));
    if (ex->exact_grad(0).status().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("exact_grad() during a reduction was accepted");
    }
    GRADSUM_RETURN_IF_ERROR(ex->FinishGradReduce());
    std::vector<FlatParam*> mixed = {ex.get(), plain.get()};
    if (GlobalGradNorm(mixed, comm).status().code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("a norm over exact and fp32 groups was accepted");
    }
    FlatParamOptions rep = exact_opts;
    rep.mode = ShardingMode::kReplicated;
    GRADSUM_ASSIGN_OR_RETURN(auto r1, FlatParam::Create("r1", DenseSpecs(), &comm, rep));
    FlatParamOptions rep_plain;
    rep_plain.mode = ShardingMode::kReplicated;
    GRADSUM_ASSIGN_OR_RETURN(auto r2, FlatParam::Create("r2", DenseSpecs(), &comm, rep_plain));
    if (BucketedGradReducer::Create({r1.get(), r2.get()}).status().code() !=
        absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("a reducer over exact and fp32 groups was accepted");
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum
