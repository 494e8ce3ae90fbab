// The training step's parameter traffic (parallel/unit_schedule.h through MoeLm and the
// Trainer): the order of the issued collectives, seen by a recording communicator; the
// memory accounting against sizes computed by hand from the config; a slow collective
// showing up as exposed time.
#include "parallel/unit_schedule.h"

#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collectives/forwarding_communicator.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"
#include "train/config.h"
#include "train/rank_main.h"
#include "train/step_log.h"
#include "train/test_util.h"
#include "train/trainer.h"

namespace gradsum::train {
namespace {

using parallel::UnitSchedule;
using ::testing::ElementsAreArray;

// One issued collective: operation, element count (recv count for reduce-scatter, send
// count for all-gather), dtype.
struct Op {
  std::string op;
  size_t count;
  DType dtype;
};

// Forwards to `inner` and appends every issued operation to `log` (shared with the
// sub-communicators of Split). Optionally makes all-gathers slow: their Work completes no
// earlier than `gather_delay` after the issue.
class RecordingCommunicator : public ForwardingCommunicator {
 public:
  RecordingCommunicator(Communicator* inner, std::shared_ptr<std::vector<Op>> log,
                        absl::Duration gather_delay)
      : ForwardingCommunicator(inner, SyncCalls::kThroughAsync),
        log_(std::move(log)),
        gather_delay_(gather_delay) {}
  RecordingCommunicator(std::unique_ptr<Communicator> owned, std::shared_ptr<std::vector<Op>> log,
                        absl::Duration gather_delay)
      : ForwardingCommunicator(std::move(owned), SyncCalls::kThroughAsync),
        log_(std::move(log)),
        gather_delay_(gather_delay) {}

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    log_->push_back({"AR", count, dtype});
    return inner().AllReduceAsync(send, recv, count, dtype, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    log_->push_back({"RS", recv_count, dtype});
    return inner().ReduceScatterAsync(send, recv, recv_count, dtype, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    log_->push_back({"AG", send_count, dtype});
    absl::StatusOr<std::unique_ptr<Work>> w = inner().AllGatherAsync(send, recv, send_count, dtype);
    if (!w.ok() || gather_delay_ <= absl::ZeroDuration()) return w;
    return std::unique_ptr<Work>(new SlowWork(std::move(*w), absl::Now() + gather_delay_));
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override {
    log_->push_back({"A2A", 0, dtype});
    return inner().AllToAllVAsync(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                                  dtype);
  }
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    log_->push_back({"BC", count, dtype});
    return inner().BroadcastAsync(buf, count, dtype, root);
  }
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
    log_->push_back({"BAR", 0, DType::kF32});
    return inner().BarrierAsync();
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    absl::StatusOr<std::unique_ptr<Communicator>> sub = inner().Split(color, key);
    if (!sub.ok() || *sub == nullptr) return sub;
    return std::unique_ptr<Communicator>(
        new RecordingCommunicator(std::move(*sub), log_, gather_delay_));
  }

 private:
  // Completes no earlier than `ready` (a slow link).
  class SlowWork : public Work {
   public:
    SlowWork(std::unique_ptr<Work> inner, absl::Time ready)
        : inner_(std::move(inner)), ready_(ready) {}
    absl::Status Wait(absl::Duration timeout) override {
      absl::Status s = inner_->Wait(timeout);
      absl::SleepFor(ready_ - absl::Now());
      return s;
    }
    bool IsCompleted() override { return absl::Now() >= ready_ && inner_->IsCompleted(); }

   private:
    std::unique_ptr<Work> inner_;
    absl::Time ready_;
  };

  std::shared_ptr<std::vector<Op>> log_;
  absl::Duration gather_delay_;
};

struct RankRun {
  std::vector<Op> log;             // the timed steps' collectives
  std::vector<StepMetrics> steps;  // their records
};

// Builds the Trainer of `config` on recording communicators and runs `steps` steps; the
// log holds only what those steps issued (not the trainer's set-up).
absl::StatusOr<std::vector<RankRun>> Record(const TrainConfig& config, int steps,
                                            absl::Duration gather_delay = absl::ZeroDuration()) {
  const int world_size = config.parallelism().world();
  std::vector<RankRun> runs(world_size);
  // Reads the config's lazily built default strings once before the rank threads do
  // (protobuf builds them on first use; TSan does not see inside the library).
  GRADSUM_RETURN_IF_ERROR(ValidateConfig(config));
  absl::Status s = testing::RunRanks(world_size, [&](Communicator& world) -> absl::Status {
    auto log = std::make_shared<std::vector<Op>>();
    RecordingCommunicator recording(&world, log, gather_delay);
    GRADSUM_ASSIGN_OR_RETURN(RankMesh mesh, MakeRankMesh(&recording, config.parallelism()));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                             Trainer::Create(config, mesh.comms()));
    log->clear();
    RankRun& run = runs[world.rank()];
    for (int i = 0; i < steps; ++i) {
      GRADSUM_ASSIGN_OR_RETURN(StepMetrics r, trainer->Step());
      run.steps.push_back(r);
    }
    run.log = *log;
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return runs;
}

// TinyConfig at world 2, ep 1 (F = 2): every unit is sharded over 2 ranks. Flat sizes:
// emb V*D = 2048; layers.l norm + router D + D*E = 40; experts E*3*D*H = 768; head
// D + D*V = 2056. All even, so shards are halves and nothing is padded.
constexpr size_t kEmb = 2048, kLayer = 40, kExperts = 768, kHead = 2056;

// The parameter gathers and gradient reduce-scatters, by unit, in issue order.
std::vector<std::string> UnitTraffic(const std::vector<Op>& log) {
  std::vector<std::string> out;
  for (const Op& op : log) {
    if ((op.op != "AG" && op.op != "RS") || op.dtype != DType::kF32) continue;
    const size_t n = op.count * 2;  // a shard of two
    const char* unit = n == kEmb       ? "emb"
                       : n == kLayer   ? "L"
                       : n == kExperts ? "X"
                       : n == kHead    ? "head"
                                       : "?";
    out.push_back(absl::StrCat(op.op, " ", unit));
  }
  return out;
}

// FSDP2's order, written out for L = 2 (stages emb, layer 0, layer 1, head): gather a
// stage's units, prefetch the next stage's, compute; the head turns; backward re-gathers
// one layer ahead and reduce-scatters each unit right after its backward (experts before
// the norm/router unit: their gradients are complete first); the embedding's backward
// reads no parameters, so it is not re-gathered.
const std::vector<std::string> kMicroBatch = {
    "AG emb",  "AG L", "AG X",  // stage 0 + prefetch layer 0
    "AG L",    "AG X",          // prefetch layer 1 (during layer 0)
    "AG head",                  // prefetch the head (during layer 1)
    "AG L",    "AG X",          // re-gather layer 1 (during the head)
    "RS head",                  // the head's gradient is complete
    "AG L",    "AG X",          // re-gather layer 0 (during layer 1's backward)
    "RS X",    "RS L",          // layer 1
    "RS X",    "RS L",          // layer 0
    "RS emb",                   // the embedding
};

// An evaluation (Trainer::Evaluate, UnitSchedule::RunForward) after a step: each stage's
// units gathered with the next stage's prefetched, the head's included, and not one
// gradient reduce-scatter.
TEST(UnitScheduleTest, AnEvaluationOnlyGathers) {
  TrainConfig config = TinyConfig(2, 1, 1, TrainConfig::fsdp);
  config.mutable_log()->set_eval_every(1);
  std::vector<std::vector<Op>> logs(2);
  ASSERT_TRUE(ValidateConfig(config).ok());
  absl::Status s = testing::RunRanks(2, [&](Communicator& world) -> absl::Status {
    auto log = std::make_shared<std::vector<Op>>();
    RecordingCommunicator recording(&world, log, absl::ZeroDuration());
    GRADSUM_ASSIGN_OR_RETURN(RankMesh mesh, MakeRankMesh(&recording, config.parallelism()));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                             Trainer::Create(config, mesh.comms()));
    GRADSUM_RETURN_IF_ERROR(trainer->Step().status());
    log->clear();
    GRADSUM_RETURN_IF_ERROR(trainer->Evaluate().status());
    logs[world.rank()] = *log;
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (const std::vector<Op>& log : logs) {
    EXPECT_THAT(UnitTraffic(log), ElementsAreArray(std::vector<std::string>{
                                      "AG emb", "AG L", "AG X", "AG L", "AG X", "AG head"}));
  }
}

TEST(UnitScheduleTest, CollectivesAreIssuedInFsdpOrder) {
  TrainConfig config = TinyConfig(2, 1, 1, TrainConfig::fsdp);
  auto runs = Record(config, 1);
  ASSERT_TRUE(runs.ok()) << runs.status();
  for (const RankRun& run : *runs) {
    EXPECT_THAT(UnitTraffic(run.log), ElementsAreArray(kMicroBatch));
  }
}

// HSDP (SEMANTICS.md §7), world 4 in shard groups of 2 (ep 1): the fsdp order inside the
// group (shards of two, as above), and on the last micro-batch each unit's cross-replica
// all-reduce of its accumulated shard (fp32, a shard's elements), started one stage after
// its reduce-scatter (UnitStore::AdvanceReduce: the head's during layer 0's backward, a
// layer's during the next stage's) and the embedding's, the last, when the step finishes.
TEST(UnitScheduleTest, HsdpAllReducesEachShardAcrossReplicasOneStageLater) {
  TrainConfig config = TinyConfig(4, 1, 2, TrainConfig::hsdp);
  config.mutable_parallelism()->set_shard_group(2);
  auto runs = Record(config, 1);
  ASSERT_TRUE(runs.ok()) << runs.status();
  std::vector<std::string> want;
  // Micro-batch 1 of 2: fsdp's order; micro-batch 2 adds the all-reduces.
  want.insert(want.end(), kMicroBatch.begin(), kMicroBatch.end());
  const std::vector<std::string> last = {
      "AG emb",  "AG L", "AG X", "AG L", "AG X", "AG head", "AG L", "AG X",
      "RS head", "AG L", "AG X", "RS X", "RS L", "AR head",  // layer 1; the head's all-reduce
      "RS X",    "RS L", "AR L", "AR X",                     // layer 0; layer 1's all-reduces
      "RS emb",  "AR L", "AR X",                             // the embedding; layer 0's
      "AR emb",                                              // the step's end
  };
  want.insert(want.end(), last.begin(), last.end());
  for (const RankRun& run : *runs) {
    std::vector<std::string> traffic;
    for (const Op& op : run.log) {
      if (op.dtype != DType::kF32 || (op.op != "AG" && op.op != "RS" && op.op != "AR")) continue;
      const size_t n = op.count * 2;
      const char* unit = n == kEmb       ? "emb"
                         : n == kLayer   ? "L"
                         : n == kExperts ? "X"
                         : n == kHead    ? "head"
                                         : nullptr;
      if (unit != nullptr) traffic.push_back(absl::StrCat(op.op, " ", unit));
    }
    EXPECT_THAT(traffic, ElementsAreArray(want));
  }
}

TEST(UnitScheduleTest, EveryMicroBatchOrOnlyTheLastReduceScatters) {
  TrainConfig config = TinyConfig(2, 1, 2, TrainConfig::fsdp);
  std::vector<std::string> twice = kMicroBatch;
  twice.insert(twice.end(), kMicroBatch.begin(), kMicroBatch.end());
  auto runs = Record(config, 1);
  ASSERT_TRUE(runs.ok()) << runs.status();
  EXPECT_THAT(UnitTraffic((*runs)[0].log), ElementsAreArray(twice));

  // requires_gradient_sync off for the first micro-batch: gathers only, then the same
  // traffic with the reduce-scatters.
  config.mutable_parallelism()->set_reduce_every_micro_batch(false);
  std::vector<std::string> last_only;
  for (const std::string& op : kMicroBatch) {
    if (op.rfind("AG", 0) == 0) last_only.push_back(op);
  }
  last_only.insert(last_only.end(), kMicroBatch.begin(), kMicroBatch.end());
  runs = Record(config, 1);
  ASSERT_TRUE(runs.ok()) << runs.status();
  EXPECT_THAT(UnitTraffic((*runs)[1].log), ElementsAreArray(last_only));
}

// Replicated mode: no gathers; the gradients go through GradBucketer on the last
// micro-batch, one bucketer per communicator. With a 4 KiB first bucket: on the world,
// `out` (8 KiB) travels alone right after the head's backward, and the rest of the
// world's parameters (2136 floats) once the embedding's backward is done; on the EDP
// group, the 24 expert matrices of 64 floats fill a first bucket of 16 and a second of 8,
// both complete when layer 0's backward hands over its experts.
TEST(UnitScheduleTest, ReplicatedBucketsAreIssuedAsBackwardCompletesThem) {
  TrainConfig config = TinyConfig(2, 1, 2, TrainConfig::replicated);
  config.mutable_comm()->set_first_bucket_mb(4096.0 / (1 << 20));
  auto runs = Record(config, 1);
  ASSERT_TRUE(runs.ok()) << runs.status();
  std::vector<size_t> reduces;
  for (const Op& op : (*runs)[0].log) {
    if (op.op == "AR" && op.dtype == DType::kF32 && op.count > 64) reduces.push_back(op.count);
  }
  EXPECT_THAT(UnitTraffic((*runs)[0].log), ::testing::IsEmpty());  // no unit gathers
  const size_t out = 8 * 256;
  EXPECT_THAT(reduces,
              ElementsAreArray({out, size_t{16 * 64}, size_t{8 * 64}, kEmb + 2 * kLayer + 8}));
}

TEST(UnitScheduleTest, PeakUnshardedBytesFollowTheSchedule) {
  const size_t f32 = 4;
  const int64_t full = (kEmb + 2 * (kLayer + kExperts) + kHead) * f32;
  // Held at once at most: a layer and the prefetched next one, the embedding with layer
  // 0, or the last layer with the head.
  const int64_t peak =
      std::max({kEmb + kLayer + kExperts, 2 * (kLayer + kExperts), kLayer + kExperts + kHead}) *
      f32;
  struct Case {
    TrainConfig::Sharding sharding;
    bool reshard_after_forward;
    TrainConfig::FloatDType compute_dtype;
    int64_t want_peak, want_full;
  };
  for (const Case& c :
       {Case{TrainConfig::fsdp, true, TrainConfig::f32, peak, full},
        Case{TrainConfig::fsdp, true, TrainConfig::bf16, peak / 2, full / 2},
        Case{TrainConfig::fsdp, false, TrainConfig::f32, full, full},  // all held by the head
        Case{TrainConfig::replicated, true, TrainConfig::f32, full, full}}) {
    TrainConfig config = TinyConfig(2, 1, 2, c.sharding);
    config.mutable_parallelism()->set_reshard_after_forward(c.reshard_after_forward);
    config.mutable_precision()->set_compute_dtype(c.compute_dtype);
    auto runs = Record(config, 2);
    ASSERT_TRUE(runs.ok()) << runs.status();
    for (const RankRun& run : *runs) {
      for (const StepMetrics& r : run.steps) {
        const std::string what = absl::StrCat(TrainConfig::Sharding_Name(c.sharding), " reshard ",
                                              c.reshard_after_forward, " ",
                                              TrainConfig::FloatDType_Name(c.compute_dtype));
        EXPECT_EQ(r.full_param_bytes(), c.want_full) << what;
        EXPECT_EQ(r.peak_unsharded_param_bytes(), c.want_peak) << what;
      }
    }
  }
}

// A gather that takes 150 ms: the first one (the embedding's) has no compute before it to
// hide behind, so at least that long is exposed; exposed time never exceeds the
// collectives' summed durations.
TEST(UnitScheduleTest, SlowGatherShowsAsExposedTime) {
  TrainConfig config = TinyConfig(2, 1, 1, TrainConfig::fsdp);
  const absl::Duration delay = absl::Milliseconds(150);
  auto runs = Record(config, 1, delay);
  ASSERT_TRUE(runs.ok()) << runs.status();
  for (const RankRun& run : *runs) {
    const StepMetrics& r = run.steps[0];
    EXPECT_GE(r.comm_exposed_s(), absl::ToDoubleSeconds(delay));
    EXPECT_GE(r.comm_s(), r.comm_exposed_s());
    EXPECT_GE(r.step_s(), r.comm_exposed_s());
    // The split by kind: the slow gathers are where the time went, and the parts add up.
    EXPECT_GE(CommExposedSeconds(r, CommKind::kAllGather), absl::ToDoubleSeconds(delay));
    double parts = 0;
    for (int k = 0; k < kNumCommKinds; ++k) {
      parts += CommExposedSeconds(r, static_cast<CommKind>(k));
    }
    EXPECT_NEAR(parts, r.comm_exposed_s(), 1e-9);
  }
}

TEST(UnitScheduleTest, CreateRejectsBadStageLayouts) {
  EXPECT_EQ(UnitSchedule::Create(2, {{0}, {2}}, {true, true}, {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // unit out of range
  EXPECT_EQ(UnitSchedule::Create(2, {{0}, {1}, {0}}, {true, true, true}, {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // unit 0 in stages 0 and 2 only
  EXPECT_EQ(UnitSchedule::Create(3, {{0}, {1}}, {true, true}, {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // unit 2 never read
  EXPECT_EQ(UnitSchedule::Create(1, {{0}}, {true, false}, {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // flags do not match the stages
  EXPECT_TRUE(UnitSchedule::Create(2, {{0}, {0, 1}, {1}}, {false, true, true}, {}).ok());
}

}  // namespace
}  // namespace gradsum::train
