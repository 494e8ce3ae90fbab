#include "train/rank_main.h"

#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"
#include "train/moe_lm.h"
#include "train/test_util.h"

namespace gradsum::train {
namespace {

using ::testing::HasSubstr;

// The estimate counts the parameters without building MoeLmParamShapes' list: compare with
// the list for a few small models.
TEST(ResourcesTest, ParameterCountMatchesTheModelsShapes) {
  // The last three with the attention block (GQA: 4 query heads over 2 kv heads).
  for (const auto& [dim, layers, experts, expert_dim, attention] :
       std::vector<std::tuple<int, int, int, int, bool>>{{8, 2, 4, 8, false},
                                                         {16, 3, 8, 5, false},
                                                         {1, 1, 1, 1, false},
                                                         {8, 2, 4, 8, true},
                                                         {16, 3, 8, 5, true},
                                                         {32, 1, 2, 3, true}}) {
    TrainConfig c = TinyConfig(2, 2, 1, TrainConfig::fsdp);
    if (attention) {
      c.mutable_model()->set_attention(ModelConfig::causal);
      c.mutable_model()->set_heads(4);
      c.mutable_model()->set_kv_heads(2);
    }
    c.mutable_model()->set_dim(dim);
    c.mutable_model()->set_layers(layers);
    c.mutable_model()->set_experts(experts);
    c.mutable_model()->set_top_k(1);
    c.mutable_model()->set_expert_dim(expert_dim);
    int64_t want = 0;
    for (const auto& [name, shape] : MoeLmParamShapes(c.model())) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      want += n;
    }
    absl::StatusOr<ResourceEstimate> r = EstimateResources(c);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_GT(want, 0);
    EXPECT_EQ(static_cast<int64_t>(r->params), want)
        << dim << " " << layers << " " << experts << " attention " << attention;
  }
}

// hsdp holds its shard group's share: N / P ways counted (the experts' split, the smaller),
// so a shard group of one EP group holds what replicated holds, and one group of the whole
// world at ep 1 what fsdp holds.
TEST(ResourcesTest, HsdpParameterBytesFollowTheShardGroup) {
  auto bytes = [](TrainConfig::Sharding sharding, int ep, int shard_group) {
    TrainConfig c = TinyConfig(4, ep, 1, sharding);
    c.mutable_parallelism()->set_shard_group(shard_group);
    absl::StatusOr<ResourceEstimate> r = EstimateResources(c);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->parameter_bytes : 0;
  };
  EXPECT_EQ(bytes(TrainConfig::hsdp, 2, 2), bytes(TrainConfig::replicated, 2, 0));
  EXPECT_EQ(bytes(TrainConfig::hsdp, 1, 4), bytes(TrainConfig::fsdp, 1, 0));
  EXPECT_LT(bytes(TrainConfig::hsdp, 1, 2), bytes(TrainConfig::replicated, 1, 0));
  EXPECT_GT(bytes(TrainConfig::hsdp, 1, 2), bytes(TrainConfig::fsdp, 1, 0));
}

TEST(ResourcesTest, TooBigForTheMachineIsResourceExhaustedNamingTheSizes) {
  TrainConfig c = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  EXPECT_TRUE(CheckResourceBounds(c, uint64_t{1} << 40).ok());
  absl::Status s = CheckResourceBounds(c, 1024);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("more than this machine's 0.0 GiB"));
  EXPECT_THAT(s.message(), HasSubstr("model.dim=8"));
  EXPECT_THAT(s.message(), HasSubstr("data.micro_batch=2 x data.seq_len=16"));
  // The thread backend holds every rank in one process.
  c.mutable_comm()->set_backend(TrainConfig::thread);
  absl::StatusOr<ResourceEstimate> threads = EstimateResources(c);
  c.mutable_comm()->set_backend(TrainConfig::mpi);
  absl::StatusOr<ResourceEstimate> mpi = EstimateResources(c);
  ASSERT_TRUE(threads.ok() && mpi.ok());
  EXPECT_EQ(threads->process_bytes, 2 * mpi->process_bytes);
  // A billion-wide model on this machine.
  c.mutable_model()->set_dim(1000000000);
  s = CheckResourceBounds(c, MachineMemoryBytes());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("model.dim=1000000000"));
}

TEST(ResourcesTest, CountsBeyondTheKernelsIndexRangeAreInvalidArgument) {
  TrainConfig c = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  c.mutable_data()->set_micro_batch(1 << 30);
  absl::Status s = CheckResourceBounds(c, UINT64_MAX);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("data.micro_batch=1073741824 x data.seq_len=16"));
  c = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  c.mutable_model()->set_dim(2000000000);
  c.mutable_model()->set_expert_dim(2000000000);
  c.mutable_model()->set_experts(2000000000);
  s = CheckResourceBounds(c, UINT64_MAX);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("more than 2^62"));
}

TEST(CatchExceptionsTest, ExceptionsBecomeStatuses) {
  EXPECT_TRUE(CatchExceptions([] { return absl::OkStatus(); }).ok());
  absl::Status s = CatchExceptions([]() -> absl::Status { throw std::runtime_error("oops"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("oops"));
  s = CatchExceptions([]() -> absl::Status { throw std::bad_alloc(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  s = CatchExceptions([]() -> absl::Status { throw 42; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  // What std::thread throws when the system refuses a thread: the limits, not "uncaught".
  s = CatchExceptions([]() -> absl::Status {
    throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("could not start a thread"));
  EXPECT_THAT(s.message(), HasSubstr("kernel.threads-max is"));
}

// Per rank: its thread and the workers of its world, EP and EDP communicators (and SP's).
// The process's own count at world 16 (4 x 16 + 2, measured with /proc) agrees.
TEST(ThreadsTest, ThreadBackendThreadsCountsRanksAndCommunicatorWorkers) {
  TrainConfig c = TinyConfig(4, 2, 1, TrainConfig::fsdp);
  EXPECT_EQ(ThreadBackendThreads(c), 16);
  c.mutable_parallelism()->set_sp(2);
  EXPECT_EQ(ThreadBackendThreads(c), 20);
}

TEST(ThreadsTest, StartingThreadsThatFitSucceedsAndTheLimitsAreNamed) {
  EXPECT_TRUE(CheckThreadsCanStart(64, "64 test threads").ok());
  EXPECT_TRUE(CheckThreadsCanStart(0, "no threads").ok());
  // More threads than any limit allows: every limit that applies is reached, and named.
  const std::string limits = ThreadLimits(int64_t{1} << 40);
  EXPECT_THAT(limits, HasSubstr("kernel.threads-max is "));
  EXPECT_THAT(limits, HasSubstr(", reached"));
  EXPECT_THAT(ThreadLimits(0), HasSubstr("none reached by this count"));
}

// HSDP's groups (SEMANTICS.md §7) as MakeRankMesh builds them: world 8, EP 2, shard
// groups of 4 consecutive ranks replicated twice; shard_group 0 on the thread backend is
// the whole world (one host).
TEST(RankMeshTest, HsdpGroupsFromTheConfig) {
  ParallelismConfig p;
  p.set_world(8);
  p.set_ep(2);
  p.set_sharding(TrainConfig::hsdp);
  p.set_shard_group(4);
  absl::Status s = testing::RunRanks(8, [&](Communicator& world) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(RankMesh m, MakeRankMesh(&world, p));
    const int w = world.rank(), f = w / 2;
    Mesh& mesh = *m.mesh;
    const std::vector<int> got = {mesh.shard_size(),
                                  mesh.group(MeshAxis::kDpShard).size(),
                                  mesh.group(MeshAxis::kDpShard).rank(),
                                  mesh.group(MeshAxis::kDpReplicate).size(),
                                  mesh.group(MeshAxis::kDpReplicate).rank(),
                                  mesh.group(MeshAxis::kEdpShard).size(),
                                  mesh.group(MeshAxis::kEdpShard).rank(),
                                  mesh.group(MeshAxis::kEdpReplicate).size(),
                                  mesh.group(MeshAxis::kEdpReplicate).rank()};
    const std::vector<int> want = {4, 4, w % 4, 2, w / 4, 2, f % 2, 2, w / 4};
    if (got != want) return absl::InternalError(absl::StrCat("rank ", w, ": groups differ"));
    // The shard group's ranks are consecutive: an all-gather of world ranks shows them.
    int64_t mine = w, all[4];
    GRADSUM_RETURN_IF_ERROR(mesh.group(MeshAxis::kDpShard).AllGather(&mine, all, 1, DType::kI64));
    for (int i = 0; i < 4; ++i) {
      if (all[i] != w / 4 * 4 + i) return absl::InternalError("shard group not consecutive");
    }
    // The expert shard group: the same EP slot p, f in this shard group.
    GRADSUM_RETURN_IF_ERROR(mesh.group(MeshAxis::kEdpShard).AllGather(&mine, all, 1, DType::kI64));
    for (int i = 0; i < 2; ++i) {
      if (all[i] != (w / 4 * 2 + i) * 2 + w % 2) {
        return absl::InternalError("expert shard group is not the EDP ranks of the group");
      }
    }
    ParallelismConfig host = p;
    host.set_shard_group(0);
    GRADSUM_ASSIGN_OR_RETURN(int n, ResolveShardGroup(world, host));
    if (n != 8) return absl::InternalError(absl::StrCat("shard_group 0 gave ", n));
    ParallelismConfig bad = p;
    bad.set_shard_group(3);
    absl::StatusOr<int> b = ResolveShardGroup(world, bad);
    if (b.status().code() != absl::StatusCode::kInvalidArgument ||
        !absl::StrContains(b.status().message(), "parallelism.shard_group=3")) {
      return absl::InternalError(absl::StrCat("shard_group 3: ", b.status().ToString()));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum::train
