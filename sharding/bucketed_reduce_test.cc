#include "sharding/bucketed_reduce.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/thread_backend.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "sharding/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

using sharding_testing::DenseSpecs;
using sharding_testing::Noise;
using testing::RunRanks;

std::vector<std::pair<std::string, std::vector<ParamSpec>>> Groups() {
  return {{"dense", DenseSpecs()},
          {"norm0", {{"norm0.g", {3}}}},
          {"norm1", {{"norm1.g", {5}}, {"norm1.b", {2}}}}};
}

enum class Path { kBucketed, kPerGroupReplicated, kSharded };

// Reduces G micro-batches of fp32 gradients; returns each group's owned gradient slice
// per rank: result[group][rank].
absl::StatusOr<std::vector<std::vector<std::vector<float>>>> Reduce(int world, Path path, int G,
                                                                    DType reduce_dtype) {
  const auto specs = Groups();
  std::vector<std::vector<std::vector<float>>> out(specs.size(),
                                                   std::vector<std::vector<float>>(world));
  absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
    FlatParamOptions opts;
    opts.mode = path == Path::kSharded ? ShardingMode::kSharded : ShardingMode::kReplicated;
    opts.reduce_dtype = reduce_dtype;
    std::vector<std::unique_ptr<FlatParam>> owned;
    std::vector<FlatParam*> groups;
    for (const auto& [name, params] : specs) {
      GRADSUM_ASSIGN_OR_RETURN(auto g, FlatParam::Create(name, params, &comm, opts));
      groups.push_back(g.get());
      owned.push_back(std::move(g));
    }
    std::unique_ptr<BucketedGradReducer> reducer;
    if (path == Path::kBucketed) {
      // A tiny cap: several buckets, and groups split across buckets.
      GRADSUM_ASSIGN_OR_RETURN(reducer, BucketedGradReducer::Create(groups, /*cap=*/40));
      if (reducer->bucketer().num_buckets() < 3) return absl::InternalError("too few buckets");
    }
    for (int m = 0; m < G; ++m) {
      const bool last = m == G - 1;
      for (int gi = static_cast<int>(groups.size()) - 1; gi >= 0; --gi) {  // backward order
        FlatParam& g = *groups[gi];
        for (int k = 0; k < g.num_params(); ++k) {
          GRADSUM_ASSIGN_OR_RETURN(TensorView t, g.grad(k));
          for (int64_t i = 0; i < t.numel(); ++i) {
            t.data<float>()[i] += static_cast<float>(Noise(g.entries()[k].name, i, comm.rank(), m));
          }
        }
        if (path == Path::kBucketed) {
          if (last) GRADSUM_RETURN_IF_ERROR(reducer->GroupReady(gi));
        } else {
          GRADSUM_RETURN_IF_ERROR(g.ReduceGrad(last));
        }
      }
      if (path == Path::kBucketed && last) GRADSUM_RETURN_IF_ERROR(reducer->Finish());
    }
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      absl::Span<const float> o = groups[gi]->owned_grad();
      out[gi][comm.rank()].assign(o.begin(), o.end());
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return out;
}

void ExpectSame(const std::vector<std::vector<std::vector<float>>>& a,
                const std::vector<std::vector<std::vector<float>>>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t g = 0; g < a.size(); ++g) {
    for (size_t r = 0; r < a[g].size(); ++r) {
      ASSERT_EQ(a[g][r].size(), b[g][r].size()) << what;
      EXPECT_TRUE(a[g][r].empty() ||
                  std::memcmp(a[g][r].data(), b[g][r].data(), a[g][r].size() * 4) == 0)
          << what << " group " << g << " rank " << r;
    }
  }
}

TEST(BucketedGradReducerTest, BitIdenticalToPerGroupAllReduceAndToSharded) {
  for (int world : {1, 2, 3, 5, 8}) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      const std::string what = absl::StrCat("world ", world, " ", DTypeName(dt));
      auto bucketed = Reduce(world, Path::kBucketed, 3, dt);
      auto per_group = Reduce(world, Path::kPerGroupReplicated, 3, dt);
      ASSERT_TRUE(bucketed.ok()) << bucketed.status();
      ASSERT_TRUE(per_group.ok()) << per_group.status();
      ExpectSame(*bucketed, *per_group, what + " G=3 vs per-group");
      auto bucketed1 = Reduce(world, Path::kBucketed, 1, dt);
      auto sharded1 = Reduce(world, Path::kSharded, 1, dt);
      ASSERT_TRUE(bucketed1.ok() && sharded1.ok());
      ExpectSame(*bucketed1, *sharded1, what + " G=1 vs sharded");
    }
  }
  // Not vacuous: the reduced value is the rank sum of the inputs (world 2, G 1, fp32).
  auto r = Reduce(2, Path::kBucketed, 1, DType::kF32);
  ASSERT_TRUE(r.ok());
  const float want = static_cast<float>(Noise("norm0.g", 0, 0, 0)) + static_cast<float>(Noise("norm0.g", 0, 1, 0));
  const std::vector<float>& norm0_rank0 = (*r)[1][0];  // group "norm0", owned slice of rank 0
  ASSERT_FALSE(norm0_rank0.empty());
  EXPECT_EQ(norm0_rank0[0], want);
}

TEST(BucketedGradReducerTest, MisuseIsRefused) {
  auto comms = CreateThreadCommunicators(2);
  ASSERT_TRUE(comms.ok());
  FlatParamOptions rep;
  rep.mode = ShardingMode::kReplicated;
  auto sharded = FlatParam::Create("s", {{"w", {4}}}, (*comms)[0].get());
  auto a = FlatParam::Create("a", {{"w", {4}}}, (*comms)[0].get(), rep);
  auto b = FlatParam::Create("b", {{"w", {4}}}, (*comms)[1].get(), rep);
  ASSERT_TRUE(sharded.ok() && a.ok() && b.ok());
  EXPECT_EQ(BucketedGradReducer::Create({}).status().code(), absl::StatusCode::kInvalidArgument);
  auto not_rep = BucketedGradReducer::Create({sharded->get()});
  EXPECT_EQ(not_rep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(not_rep.status().message().find("\"s\""), std::string::npos);
  EXPECT_EQ(BucketedGradReducer::Create({a->get(), b->get()}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BucketedGradReducer::Create({a->get()}, 0).status().code(),
            absl::StatusCode::kInvalidArgument);

  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(auto x, FlatParam::Create("x", {{"w", {4}}}, &comm, rep));
    GRADSUM_ASSIGN_OR_RETURN(auto y, FlatParam::Create("y", {{"v", {3}}}, &comm, rep));
    GRADSUM_ASSIGN_OR_RETURN(auto reducer, BucketedGradReducer::Create({x.get(), y.get()}, 1));
    if (reducer->GroupReady(2).code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("bad index accepted");
    }
    GRADSUM_RETURN_IF_ERROR(reducer->GroupReady(1));
    // Refused before touching the bucket, whose all-reduce may be in flight.
    if (reducer->GroupReady(1).code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("double hand-over accepted");
    }
    if (reducer->Finish().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("Finish with a group missing accepted");
    }
    GRADSUM_RETURN_IF_ERROR(reducer->GroupReady(0));
    return reducer->Finish();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum
