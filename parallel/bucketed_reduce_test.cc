#include "parallel/bucketed_reduce.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/thread_backend.h"
#include "core/half.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "parallel/test_util.h"
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

enum class Path { kBucketed, kDeviceBuckets, kPerGroupReplicated, kSharded };

// "Device" bucket memory for the CPU test of the device path: host memory that counts how
// the reducer uses it (a GPU model's is device memory, train/cuda).
class CountingMemory final : public BucketMemory {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    ++live;
    return HostBucketMemory().Allocate(bytes);
  }
  void Free(void* storage) override {
    --live;
    HostBucketMemory().Free(storage);
  }
  absl::Status Zero(void* storage, size_t bytes) override {
    ++zeroes;
    return HostBucketMemory().Zero(storage, bytes);
  }
  absl::Status CopyToHost(const void* storage, void* host, size_t bytes) override {
    ++copies;
    return HostBucketMemory().CopyToHost(storage, host, bytes);
  }
  int live = 0, zeroes = 0, copies = 0;
};

// Reduces G micro-batches of fp32 gradients; returns each group's owned gradient slice
// per rank: result[group][rank].
absl::StatusOr<std::vector<std::vector<std::vector<float>>>> Reduce(int world, Path path, int G,
                                                                    GradPrecision precision) {
  const auto specs = Groups();
  std::vector<std::vector<std::vector<float>>> out(specs.size(),
                                                   std::vector<std::vector<float>>(world));
  absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
    FlatParamOptions opts;
    opts.mode = path == Path::kSharded ? ShardingMode::kSharded : ShardingMode::kReplicated;
    opts.precision = precision;
    std::vector<std::unique_ptr<FlatParam>> owned;
    std::vector<FlatParam*> groups;
    for (const auto& [name, params] : specs) {
      GRADSUM_ASSIGN_OR_RETURN(auto g, FlatParam::Create(name, params, &comm, opts));
      groups.push_back(g.get());
      owned.push_back(std::move(g));
    }
    std::unique_ptr<BucketedGradReducer> reducer;
    const bool bucketed = path == Path::kBucketed || path == Path::kDeviceBuckets;
    // Device buckets: f32 gradients accumulate in the bucket views themselves; bf16 ones
    // in the group's fp32 buffer, rounded into the views when handed over (as the GPU store,
    // parallel/cuda).
    const bool in_views = path == Path::kDeviceBuckets && precision == GradPrecision::kF32;
    CountingMemory memory;
    const BucketedGradDevice device{&comm, &memory};
    if (bucketed) {
      // A tiny cap: several buckets, and groups split across buckets.
      GRADSUM_ASSIGN_OR_RETURN(
          reducer, BucketedGradReducer::Create(groups, /*cap=*/40, 0,
                                               path == Path::kDeviceBuckets ? &device : nullptr));
      if (reducer->bucketer().num_buckets() < 3) return absl::InternalError("too few buckets");
    }
    for (int m = 0; m < G; ++m) {
      const bool last = m == G - 1;
      for (int gi = static_cast<int>(groups.size()) - 1; gi >= 0; --gi) {  // backward order
        FlatParam& g = *groups[gi];
        for (int k = 0; k < g.num_params(); ++k) {
          GRADSUM_ASSIGN_OR_RETURN(TensorView t, g.grad(k));
          float* dst = in_views ? reducer->grad_view(gi, k).data<float>() : t.data<float>();
          for (int64_t i = 0; i < t.numel(); ++i) {
            dst[i] += static_cast<float>(Noise(g.entries()[k].name, i, comm.rank(), m));
          }
          if (path == Path::kDeviceBuckets && !in_views && last) {
            BF16* view = reducer->grad_view(gi, k).data<BF16>();
            for (int64_t i = 0; i < t.numel(); ++i) view[i] = BF16::FromFloat(t.data<float>()[i]);
          }
        }
        if (bucketed) {
          if (last) GRADSUM_RETURN_IF_ERROR(reducer->GroupReady(gi));
        } else {
          GRADSUM_RETURN_IF_ERROR(g.ReduceGrad(last));
        }
      }
      if (bucketed && last) GRADSUM_RETURN_IF_ERROR(reducer->Finish());
    }
    if (path == Path::kDeviceBuckets) {
      // One copy to the host per bucket, then the views zeroed for the next step.
      const int buckets = reducer->bucketer().num_buckets();
      if (memory.live != buckets || memory.copies != buckets || memory.zeroes < buckets) {
        return absl::InternalError(absl::StrCat(memory.live, " buckets allocated, ", memory.copies,
                                                " copies, ", memory.zeroes, " zeroes for ", buckets,
                                                " buckets"));
      }
      for (int gi = 0; gi < static_cast<int>(groups.size()); ++gi) {
        for (int k = 0; k < groups[gi]->num_params(); ++k) {
          TensorView v = reducer->grad_view(gi, k);
          const char* bytes = static_cast<const char*>(v.raw());
          for (int64_t i = 0; i < v.numel() * static_cast<int64_t>(DTypeSize(v.dtype())); ++i) {
            if (bytes[i] != 0) return absl::InternalError("a bucket view was not zeroed");
          }
        }
      }
      reducer.reset();
      if (memory.live != 0) return absl::InternalError("bucket storage leaked");
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
    for (GradPrecision dt : {GradPrecision::kF32, GradPrecision::kBF16Wire}) {
      const std::string what = absl::StrCat("world ", world, " ", GradPrecisionName(dt));
      auto bucketed = Reduce(world, Path::kBucketed, 3, dt);
      auto device = Reduce(world, Path::kDeviceBuckets, 3, dt);
      auto per_group = Reduce(world, Path::kPerGroupReplicated, 3, dt);
      ASSERT_TRUE(bucketed.ok()) << bucketed.status();
      ASSERT_TRUE(device.ok()) << device.status();
      ASSERT_TRUE(per_group.ok()) << per_group.status();
      ExpectSame(*bucketed, *per_group, what + " G=3 vs per-group");
      ExpectSame(*device, *per_group, what + " G=3 device buckets vs per-group");
      auto bucketed1 = Reduce(world, Path::kBucketed, 1, dt);
      auto sharded1 = Reduce(world, Path::kSharded, 1, dt);
      ASSERT_TRUE(bucketed1.ok() && sharded1.ok());
      ExpectSame(*bucketed1, *sharded1, what + " G=1 vs sharded");
    }
  }
  // Not vacuous: the reduced value is the rank sum of the inputs (world 2, G 1, fp32).
  auto r = Reduce(2, Path::kBucketed, 1, GradPrecision::kF32);
  ASSERT_TRUE(r.ok());
  const float want =
      static_cast<float>(Noise("norm0.g", 0, 0, 0)) + static_cast<float>(Noise("norm0.g", 0, 1, 0));
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
  // Device buckets: a communicator of another size, or no memory, is refused by name.
  auto single = CreateThreadCommunicators(1);
  ASSERT_TRUE(single.ok());
  CountingMemory memory;
  const BucketedGradDevice other_size{(*single)[0].get(), &memory};
  auto mismatched = BucketedGradReducer::Create({a->get()}, 40, 0, &other_size);
  EXPECT_EQ(mismatched.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mismatched.status().message().find("rank 0 of 1"), std::string::npos)
      << mismatched.status();
  const BucketedGradDevice no_memory{(*comms)[0].get(), nullptr};
  EXPECT_EQ(BucketedGradReducer::Create({a->get()}, 40, 0, &no_memory).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<Communicator*> one_comm = {(*comms)[0].get()};
  EXPECT_EQ(
      BucketedUnitReducers::Create({a->get(), a->get()}, 40, 0, &one_comm, &memory).status().code(),
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
