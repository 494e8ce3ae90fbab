// Thread backend: conformance at world sizes 1..8 against the single-process reference of
// //collectives:conformance, plus the behaviour only this backend can show in one process
// (timeouts, a rank that never arrives, invalid arguments on one rank, destruction).

#include "collectives/thread_backend.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collectives/conformance.h"
#include "core/half.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"
#include "testing/status_testing.h"

namespace gradsum {
namespace {

using ::gradsum::testing::RunRanks;
using ::gradsum::testing::RunRanksPerRank;

constexpr size_t kCounts[] = {0, 1, 13, 1000, 4099};

class ThreadConformanceTest : public ::testing::TestWithParam<int> {};

TEST_P(ThreadConformanceTest, AllReduceEveryDTypeOpCountAndPlacement) {
  GRADSUM_EXPECT_OK(RunRanks(GetParam(), [](Communicator& comm) -> absl::Status {
    for (DType t : kAllDTypes) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        if (op == ReduceOp::kAvg && !IsFloating(t)) continue;
        for (size_t n : kCounts) {
          for (bool in_place : {false, true}) {
            absl::Status s = conformance::CheckAllReduce(comm, t, op, n, in_place);
            if (!s.ok()) return s;
          }
        }
      }
    }
    return absl::OkStatus();
  }));
}

TEST_P(ThreadConformanceTest, ReduceScatterAndAllGather) {
  GRADSUM_EXPECT_OK(RunRanks(GetParam(), [](Communicator& comm) -> absl::Status {
    for (DType t : kAllDTypes) {
      for (size_t n : {0, 1, 7, 300}) {
        for (bool in_place : {false, true}) {
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
            if (op == ReduceOp::kAvg && !IsFloating(t)) continue;
            absl::Status s = conformance::CheckReduceScatter(comm, t, op, n, in_place);
            if (!s.ok()) return s;
          }
          absl::Status s = conformance::CheckAllGather(comm, t, n, in_place);
          if (!s.ok()) return s;
        }
      }
    }
    return absl::OkStatus();
  }));
}

TEST_P(ThreadConformanceTest, AllToAllVUnevenCountsAndBroadcastFromEveryRoot) {
  GRADSUM_EXPECT_OK(RunRanks(GetParam(), [](Communicator& comm) -> absl::Status {
    for (DType t : kAllDTypes) {
      for (size_t max_count : {0, 1, 5, 200}) {
        conformance::CheckOptions o;
        o.seed = 7 + max_count;
        absl::Status s = conformance::CheckAllToAllV(comm, t, max_count, o);
        if (!s.ok()) return s;
      }
      for (int root = 0; root < comm.size(); ++root) {
        for (size_t n : {0, 3, 1000}) {
          absl::Status s = conformance::CheckBroadcast(comm, t, n, root);
          if (!s.ok()) return s;
        }
      }
    }
    return absl::OkStatus();
  }));
}

TEST_P(ThreadConformanceTest, AsyncSplitAndMismatches) {
  GRADSUM_EXPECT_OK(RunRanks(GetParam(), [](Communicator& comm) -> absl::Status {
    absl::Status s = conformance::CheckAsyncInIssueOrder(comm);
    if (s.ok()) s = conformance::CheckSplit(comm);
    if (s.ok()) s = conformance::CheckMismatchesFail(comm);
    // The group stays usable after mismatches: every rank failed the same calls.
    if (s.ok()) s = conformance::CheckAllReduce(comm, DType::kF32, ReduceOp::kSum, 100, false);
    return s;
  }));
}

TEST_P(ThreadConformanceTest, IntegerValuedInputsAsAnyBackendWouldSee) {
  conformance::CheckOptions o;
  o.rank_ordered_sums = false;
  o.seed = 99;
  GRADSUM_EXPECT_OK(RunRanks(GetParam(), [&](Communicator& comm) -> absl::Status {
    absl::Status s = conformance::CheckAllReduce(comm, DType::kBF16, ReduceOp::kAvg, 1000, true, o);
    if (s.ok())
      s = conformance::CheckReduceScatter(comm, DType::kF16, ReduceOp::kSum, 100, false, o);
    if (s.ok()) s = conformance::CheckAllToAllV(comm, DType::kI32, 50, o);
    return s;
  }));
}

TEST_P(ThreadConformanceTest, PointToPoint) {
  GRADSUM_EXPECT_OK(RunRanks(GetParam(), [](Communicator& comm) -> absl::Status {
    absl::Status s = conformance::CheckPointToPoint(comm);
    // Collectives still line up after point-to-point traffic.
    if (s.ok()) s = conformance::CheckAllReduce(comm, DType::kF32, ReduceOp::kSum, 100, false);
    return s;
  }));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ThreadConformanceTest, ::testing::Range(1, 9),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("W", info.param);
                         });

// Buffers well past the 256 KiB work chunk, so each rank reduces several chunks claimed
// dynamically, including the ragged last one.
TEST(ThreadBackendTest, LargeBuffersSpanManyChunks) {
  GRADSUM_EXPECT_OK(RunRanks(3, [](Communicator& comm) -> absl::Status {
    for (bool in_place : {false, true}) {
      absl::Status s =
          conformance::CheckAllReduce(comm, DType::kF32, ReduceOp::kSum, 200003, in_place);
      if (s.ok())
        s = conformance::CheckAllReduce(comm, DType::kBF16, ReduceOp::kAvg, 300001, in_place);
      if (s.ok())
        s = conformance::CheckReduceScatter(comm, DType::kF64, ReduceOp::kSum, 70001, in_place);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }));
}

TEST(ThreadBackendTest, RejectsBadWorldSizeAndTimeout) {
  EXPECT_EQ(CreateThreadCommunicators(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateThreadCommunicators(1025).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(CreateThreadCommunicators(-3).status().message(), "-3"));
  ThreadBackendOptions o;
  o.timeout = absl::ZeroDuration();
  EXPECT_EQ(CreateThreadCommunicators(2, o).status().code(), absl::StatusCode::kInvalidArgument);
  auto comms = CreateThreadCommunicators(3);
  ASSERT_TRUE(comms.ok());
  EXPECT_EQ((*comms)[2]->rank(), 2);
  EXPECT_EQ((*comms)[2]->size(), 3);
  EXPECT_EQ((*comms)[0]->backend(), "thread");
  EXPECT_EQ((*comms)[0]->timeout(), absl::Seconds(60));
}

// bf16 SUM accumulates in fp32 and rounds once (SEMANTICS.md §7). 1 + 7 * 2^-8: rounding
// after every addition would stay at 1 (each 2^-8 is half an ulp, ties to even); one
// rounding of the exact 1.02734375 gives 1.03125 (3.5 ulps, tie to even 4 ulps).
TEST(ThreadBackendTest, Bf16SumRoundsOnce) {
  GRADSUM_EXPECT_OK(RunRanks(8, [](Communicator& comm) -> absl::Status {
    BF16 x = BF16::FromFloat(comm.rank() == 0 ? 1.0f : 0.00390625f);
    absl::Status s = comm.AllReduce(&x, &x, 1, DType::kBF16, ReduceOp::kSum);
    if (!s.ok()) return s;
    if (x.ToFloat() != 1.03125f) {
      return absl::InternalError(absl::StrCat("bf16 sum is ", x.ToFloat(), ", expected 1.03125"));
    }
    return absl::OkStatus();
  }));
}

TEST(ThreadBackendTest, CountMismatchMessageNamesBothRanks) {
  auto statuses = RunRanksPerRank(3, [](Communicator& comm) {
    std::vector<float> buf(12, 1.0f);
    return comm.AllReduce(buf.data(), buf.data(), comm.rank() == 2 ? 10 : 12, DType::kF32);
  });
  ASSERT_TRUE(statuses.ok());
  for (int r = 0; r < 3; ++r) {
    const absl::Status& s = (*statuses)[r];
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "rank 2 passed count 10, rank 0 passed 12")) << s;
  }
}

TEST(ThreadBackendTest, InvalidArgumentsOnOneRankFailEveryRankWithoutTimeout) {
  const absl::Time start = absl::Now();
  auto statuses = RunRanksPerRank(4, [](Communicator& comm) -> absl::Status {
    std::vector<float> buf(8, 1.0f);
    const int root = comm.rank() == 1 ? 9 : 0;  // out of range on rank 1 only
    absl::Status s = comm.Broadcast(buf.data(), 8, DType::kF32, root);
    if (s.ok()) return absl::InternalError("bad root accepted");
    // Later operations still line up across ranks.
    absl::Status after = comm.AllReduce(buf.data(), buf.data(), 8, DType::kF32);
    if (!after.ok()) return after;
    if (buf[0] != 4.0f) return absl::InternalError(absl::StrCat("sum after error is ", buf[0]));
    return s;
  });
  ASSERT_TRUE(statuses.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  for (int r = 0; r < 4; ++r) {
    const absl::Status& s = (*statuses)[r];
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), r == 1 ? "root 9" : "rank 1 passed invalid")) << s;
  }
}

TEST(ThreadBackendTest, LocalArgumentChecks) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  Communicator& c = *(*comms)[0];
  std::vector<float> a(64), b(64);
  const auto code = [](absl::Status s) { return s.code(); };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code(c.AllReduce(nullptr, b.data(), 4, DType::kF32)), kInvalid);
  EXPECT_EQ(code(c.AllReduce(a.data(), a.data() + 1, 4, DType::kF32)), kInvalid);  // overlap
  EXPECT_EQ(code(c.AllReduce(a.data(), b.data(), 4, DType::kI32, ReduceOp::kAvg)), kInvalid);
  EXPECT_EQ(code(c.AllReduce(a.data(), b.data(), 4, static_cast<DType>(42))), kInvalid);
  EXPECT_EQ(code(c.ReduceScatter(a.data(), b.data(), 4, DType::kF32, ReduceOp::kMax)), kInvalid);
  EXPECT_EQ(code(c.Broadcast(a.data(), 4, DType::kF32, -1)), kInvalid);
  const std::vector<size_t> two = {1, 1};
  const std::vector<size_t> one = {1}, zero = {0};
  EXPECT_EQ(code(c.AllToAllV(a.data(), two, two, b.data(), one, zero, DType::kF32)), kInvalid);
  // Receive blocks of one peer can't overlap in a 1-rank world; send/recv overlap can.
  EXPECT_EQ(code(c.AllToAllV(a.data(), one, zero, a.data(), one, zero, DType::kF32)), kInvalid);
  // Zero elements with null buffers are fine.
  GRADSUM_EXPECT_OK(c.AllReduce(nullptr, nullptr, 0, DType::kF64));
  GRADSUM_EXPECT_OK(c.AllToAllV(nullptr, zero, zero, nullptr, zero, zero, DType::kF32));
}

TEST(ThreadBackendTest, InPlaceConventionsForScatterAndGather) {
  GRADSUM_EXPECT_OK(RunRanks(2, [](Communicator& comm) -> absl::Status {
    std::vector<float> full(9, 1.0f);
    // recv == send (base) on rank 1 overlaps another rank's block: rejected.
    absl::Status s = comm.ReduceScatter(full.data(), full.data(), 4, DType::kF32);
    if (comm.rank() == 1 && s.code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError(
          absl::StrCat("overlapping reduce_scatter accepted: ", s.ToString()));
    }
    if (comm.rank() == 0 && s.code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("rank 0 did not learn of rank 1's bad arguments");
    }
    s = comm.AllGather(full.data(), full.data() + 1, 4, DType::kF32);
    if (s.code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError(absl::StrCat("overlapping all_gather accepted: ", s.ToString()));
    }
    return absl::OkStatus();
  }));
}

TEST(ThreadBackendTest, MissingRankTimesOutThenCommunicatorIsUnusable) {
  ThreadBackendOptions o;
  o.timeout = absl::Milliseconds(200);
  const absl::Time start = absl::Now();
  auto statuses = RunRanksPerRank(
      4,
      [](Communicator& comm) -> absl::Status {
        std::vector<float> buf(16, 1.0f);
        if (comm.rank() == 3) {
          // Arrives late, after the others gave up.
          std::this_thread::sleep_for(std::chrono::milliseconds(600));
          absl::Status late = comm.AllReduce(buf.data(), buf.data(), 16, DType::kF32);
          if (late.code() != absl::StatusCode::kFailedPrecondition) {
            return absl::InternalError(absl::StrCat("late rank got ", late.ToString()));
          }
          return absl::OkStatus();
        }
        absl::Status s = comm.AllReduce(buf.data(), buf.data(), 16, DType::kF32);
        if (s.code() != absl::StatusCode::kDeadlineExceeded) return s;
        if (!absl::StrContains(s.message(), "3")) return absl::InternalError(s.ToString());
        absl::Status later = comm.Barrier();
        if (later.code() != absl::StatusCode::kFailedPrecondition) {
          return absl::InternalError(absl::StrCat("later call got ", later.ToString()));
        }
        return absl::OkStatus();
      },
      o);
  ASSERT_TRUE(statuses.ok());
  for (const absl::Status& s : *statuses) GRADSUM_EXPECT_OK(s);
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(200));
  EXPECT_LT(took, absl::Seconds(20));
}

TEST(ThreadBackendTest, WaitTimeoutLeavesOperationInFlight) {
  GRADSUM_EXPECT_OK(RunRanks(2, [](Communicator& comm) -> absl::Status {
    int64_t x = comm.rank() + 1;
    if (comm.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      return comm.AllReduce(&x, &x, 1, DType::kI64);
    }
    auto work = comm.AllReduceAsync(&x, &x, 1, DType::kI64, ReduceOp::kSum);
    if (!work.ok()) return work.status();
    absl::Status early = (*work)->Wait(absl::Milliseconds(20));
    if (early.code() != absl::StatusCode::kDeadlineExceeded || (*work)->IsCompleted()) {
      return absl::InternalError(absl::StrCat("early wait gave ", early.ToString()));
    }
    absl::Status s = (*work)->Wait(absl::Seconds(30));
    if (!s.ok()) return s;
    if (x != 3) return absl::InternalError(absl::StrCat("sum is ", x));
    return absl::OkStatus();
  }));
}

TEST(ThreadBackendTest, ManyAsyncOperationsCompleteInIssueOrder) {
  GRADSUM_EXPECT_OK(RunRanks(8, [](Communicator& comm) -> absl::Status {
    constexpr int kOps = 200;
    std::vector<int32_t> bufs(kOps);
    std::vector<std::unique_ptr<Work>> works;
    for (int i = 0; i < kOps; ++i) {
      bufs[i] = i * 100 + comm.rank();
      auto w = comm.AllReduceAsync(&bufs[i], &bufs[i], 1, DType::kI32, ReduceOp::kSum);
      if (!w.ok()) return w.status();
      works.push_back(std::move(*w));
    }
    for (int i = 0; i < kOps; ++i) {
      absl::Status s = works[i]->Wait();
      if (!s.ok()) return s;
      if (bufs[i] != i * 800 + 28)
        return absl::InternalError(absl::StrCat("op ", i, " = ", bufs[i]));
    }
    return absl::OkStatus();
  }));
}

// Rank 0 is already waiting inside each operation when rank 1 issues it async, so rank 1
// normally runs the (small) operation during its issue call, on its own thread, instead of
// handing it to its worker. Whichever thread runs it, rank 1's handle must report the
// operation's own result: the values, and a mismatch's InvalidArgument from Wait (not from
// the issue call, which only checks rank 1's own arguments).
TEST(ThreadBackendTest, OperationIssuedWhilePeersWaitGivesTheSameResults) {
  auto comms = CreateThreadCommunicators(2);
  ASSERT_TRUE(comms.ok());
  Communicator& c0 = *(*comms)[0];
  Communicator& c1 = *(*comms)[1];
  for (int round = 0; round < 4; ++round) {
    const bool mismatch = round % 2 == 1;
    std::vector<float> b0 = {1, 2, 3}, b1 = {10, 20, 30};
    absl::Status s0;
    std::thread peer([&] { s0 = c0.AllReduce(b0.data(), b0.data(), 3, DType::kF32); });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let rank 0 arrive
    auto w = c1.AllReduceAsync(b1.data(), b1.data(), mismatch ? 2 : 3, DType::kF32, ReduceOp::kSum);
    ASSERT_TRUE(w.ok()) << w.status();
    const absl::Status s1 = (*w)->Wait();
    peer.join();
    EXPECT_TRUE((*w)->IsCompleted());
    if (mismatch) {
      EXPECT_EQ(s1.code(), absl::StatusCode::kInvalidArgument) << s1;
      EXPECT_TRUE(absl::StrContains(s1.message(), "rank 1 passed count 2, rank 0 passed 3")) << s1;
      EXPECT_EQ(s0.code(), absl::StatusCode::kInvalidArgument) << s0;
      EXPECT_EQ(b1, (std::vector<float>{10, 20, 30}));  // untouched
    } else {
      GRADSUM_EXPECT_OK(s1);
      GRADSUM_EXPECT_OK(s0);
      EXPECT_EQ(b0, (std::vector<float>{11, 22, 33}));
      EXPECT_EQ(b1, (std::vector<float>{11, 22, 33}));
    }
  }
}

TEST(ThreadBackendTest, SyncCallsRunAfterPendingAsyncOnes) {
  GRADSUM_EXPECT_OK(RunRanks(4, [](Communicator& comm) -> absl::Status {
    // The async all-gather is issued first, so it must run first on every rank even though
    // the sync all-reduce (which could run on the caller's thread) comes before its Wait.
    const int32_t mine = comm.rank() + 1;
    std::vector<int32_t> gathered(4, -1);
    auto gather = comm.AllGatherAsync(&mine, gathered.data(), 1, DType::kI32);
    if (!gather.ok()) return gather.status();
    int64_t sum = comm.rank();
    GRADSUM_RETURN_IF_ERROR(comm.AllReduce(&sum, &sum, 1, DType::kI64));
    GRADSUM_RETURN_IF_ERROR((*gather)->Wait());
    if (sum != 6) return absl::InternalError(absl::StrCat("sum ", sum));
    for (int p = 0; p < 4; ++p) {
      if (gathered[p] != p + 1) return absl::InternalError(absl::StrCat("gathered[", p, "]"));
    }
    return absl::OkStatus();
  }));
}

TEST(ThreadBackendTest, ManySmallSyncOperationsMixedKinds) {
  // Exercises the reused rendezvous: thousands of back-to-back operations of different
  // kinds and sizes, each checked against its closed-form result.
  GRADSUM_EXPECT_OK(RunRanks(8, [](Communicator& comm) -> absl::Status {
    const int w = comm.size(), r = comm.rank();
    for (int i = 0; i < 1500; ++i) {
      const size_t n = 1 + static_cast<size_t>(i % 37) * 5;
      std::vector<int32_t> v(n * w);
      for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<int32_t>(i + r * 7 + k);
      if (i % 3 == 0) {
        GRADSUM_RETURN_IF_ERROR(comm.AllReduce(v.data(), v.data(), v.size(), DType::kI32));
        for (size_t k = 0; k < v.size(); ++k) {
          const int32_t want = static_cast<int32_t>(w * (i + k) + 7 * w * (w - 1) / 2);
          if (v[k] != want) return absl::InternalError(absl::StrCat("op ", i, " elem ", k));
        }
      } else if (i % 3 == 1) {
        std::vector<int32_t> out(n, -1);
        GRADSUM_RETURN_IF_ERROR(comm.ReduceScatter(v.data(), out.data(), n, DType::kI32));
        for (size_t k = 0; k < n; ++k) {
          const size_t idx = static_cast<size_t>(r) * n + k;
          const int32_t want = static_cast<int32_t>(w * (i + idx) + 7 * w * (w - 1) / 2);
          if (out[k] != want) return absl::InternalError(absl::StrCat("op ", i, " elem ", k));
        }
      } else {
        std::vector<int32_t> all(n * w, -1);
        GRADSUM_RETURN_IF_ERROR(comm.AllGather(v.data(), all.data(), n, DType::kI32));
        for (int p = 0; p < w; ++p) {
          for (size_t k = 0; k < n; ++k) {
            if (all[p * n + k] != static_cast<int32_t>(i + p * 7 + k)) {
              return absl::InternalError(absl::StrCat("op ", i, " peer ", p, " elem ", k));
            }
          }
        }
      }
    }
    return absl::OkStatus();
  }));
}

// The options forms (communicator.h) give the positional results, checked against closed
// forms, on every operation.
TEST(CommunicatorOptionsTest, OptionsFormsGiveThePositionalResults) {
  GRADSUM_EXPECT_OK(RunRanks(3, [](Communicator& comm) -> absl::Status {
    const int w = comm.size(), r = comm.rank();
    int64_t x = r + 1, sum = 0;
    GRADSUM_RETURN_IF_ERROR(
        comm.AllReduce({.send = &x, .recv = &sum, .count = 1, .dtype = DType::kI64}));
    if (sum != 6) return absl::InternalError(absl::StrCat("all_reduce ", sum));
    std::vector<int32_t> full = {1, 2, 3}, mine(1, -1), gathered(3, -1);
    GRADSUM_RETURN_IF_ERROR(comm.ReduceScatter(
        {.send = full.data(), .recv = mine.data(), .recv_count = 1, .dtype = DType::kI32}));
    if (mine[0] != 3 * (r + 1)) return absl::InternalError("reduce_scatter");
    const int32_t me = 10 * r;
    GRADSUM_RETURN_IF_ERROR(comm.AllGather(
        {.send = &me, .recv = gathered.data(), .send_count = 1, .dtype = DType::kI32}));
    if (gathered != std::vector<int32_t>({0, 10, 20})) return absl::InternalError("all_gather");
    double b = r == 2 ? 7.5 : 0.0;
    GRADSUM_RETURN_IF_ERROR(
        comm.Broadcast({.buf = &b, .count = 1, .dtype = DType::kF64, .root = 2}));
    if (b != 7.5) return absl::InternalError("broadcast");
    std::vector<size_t> ones(w, 1), offsets = {0, 1, 2};
    std::vector<int32_t> send = {100 * r, 100 * r + 1, 100 * r + 2}, recv(3, -1);
    auto a2a = comm.AllToAllVAsync({.send = send.data(),
                                    .send_counts = ones,
                                    .send_offsets = offsets,
                                    .recv = recv.data(),
                                    .recv_counts = ones,
                                    .recv_offsets = offsets,
                                    .dtype = DType::kI32,
                                    .timeout = absl::Seconds(30)});
    if (!a2a.ok()) return a2a.status();
    GRADSUM_RETURN_IF_ERROR((*a2a)->Wait());
    for (int p = 0; p < w; ++p) {
      if (recv[p] != 100 * p + r) return absl::InternalError("all_to_all_v");
    }
    return comm.Barrier(BarrierOptions{.timeout = absl::Seconds(30)});
  }));
}

// A per-call timeout shorter than the communicator's: the call returns DeadlineExceeded
// after about that long (the operation stays in flight, as documented), and an async
// handle's argument-less Wait() uses the options' timeout.
TEST(CommunicatorOptionsTest, PerCallTimeoutBoundsTheWait) {
  auto comms = CreateThreadCommunicators(2, {.timeout = absl::Seconds(60)});
  ASSERT_TRUE(comms.ok());
  float x = 1;  // must outlive the in-flight operation: the communicators go first
  const absl::Time start = absl::Now();
  const absl::Status s = (*comms)[0]->AllReduce({.send = &x,
                                                 .recv = &x,
                                                 .count = 1,
                                                 .dtype = DType::kF32,
                                                 .timeout = absl::Milliseconds(100)});
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  auto w = (*comms)[0]->BarrierAsync(BarrierOptions{.timeout = absl::Milliseconds(100)});
  ASSERT_TRUE(w.ok());
  EXPECT_EQ((*w)->Wait().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  // Rank 1 never joined; destroying the communicators breaks the group instead of hanging.
  comms->clear();
}

TEST(ThreadBackendTest, DestroyingWithOperationInFlightDoesNotHang) {
  auto comms = CreateThreadCommunicators(2);
  ASSERT_TRUE(comms.ok());
  float x = 1.0f;
  auto work = (*comms)[0]->AllReduceAsync(&x, &x, 1, DType::kF32, ReduceOp::kSum);
  ASSERT_TRUE(work.ok());
  // Rank 1 never joins; destroying rank 0 aborts the op instead of waiting 60 s.
  const absl::Time start = absl::Now();
  (*comms)[0].reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  absl::Status s = (*work)->Wait(absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  // The surviving rank sees the broken group.
  EXPECT_EQ((*comms)[1]->Barrier().code(), absl::StatusCode::kFailedPrecondition);
  comms->clear();
}

TEST(ThreadBackendTest, PointToPointPeerThatNeverPostsTimesOutNamingIt) {
  ThreadBackendOptions o;
  o.timeout = absl::Milliseconds(200);
  const absl::Time start = absl::Now();
  auto statuses = RunRanksPerRank(
      2,
      [](Communicator& comm) -> absl::Status {
        std::vector<float> buf(8, 1.0f);
        if (comm.rank() == 1) {
          // Stopped: posts its send only after rank 0 gave up.
          std::this_thread::sleep_for(std::chrono::milliseconds(600));
          absl::Status late = comm.Send(buf.data(), 8, DType::kF32, 0);
          if (late.code() != absl::StatusCode::kFailedPrecondition ||
              !absl::StrContains(late.message(), "rank 1 did not post")) {
            return absl::InternalError(absl::StrCat("late rank got ", late.ToString()));
          }
          return absl::OkStatus();
        }
        absl::Status s = comm.Recv(buf.data(), 8, DType::kF32, 1);
        if (s.code() != absl::StatusCode::kDeadlineExceeded ||
            !absl::StrContains(s.message(), "recv from rank 1 (rank 0 of 2)") ||
            !absl::StrContains(s.message(), "rank 1 did not post the matching send")) {
          return absl::InternalError(absl::StrCat("waiting rank got ", s.ToString()));
        }
        return absl::OkStatus();
      },
      o);
  ASSERT_TRUE(statuses.ok());
  for (const absl::Status& s : *statuses) GRADSUM_EXPECT_OK(s);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

TEST(ThreadBackendTest, PointToPointInvalidSideFailsItsPeerAtOnce) {
  const absl::Time start = absl::Now();
  GRADSUM_EXPECT_OK(RunRanks(2, [](Communicator& comm) -> absl::Status {
    std::vector<float> buf(8, 1.0f);
    if (comm.rank() == 0) {
      absl::Status s = comm.Send(nullptr, 8, DType::kF32, 1);
      if (s.code() != absl::StatusCode::kInvalidArgument ||
          !absl::StrContains(s.message(), "null buffer with count 8")) {
        return absl::InternalError(absl::StrCat("invalid rank got ", s.ToString()));
      }
      // Peer or tag out of range: refused at issue, naming the value.
      s = comm.Send(buf.data(), 8, DType::kF32, 2);
      if (!absl::StrContains(s.message(), "peer 2 is outside [0, 2)")) {
        return absl::InternalError(s.ToString());
      }
      s = comm.Recv(buf.data(), 8, DType::kF32, 1, -3);
      if (!absl::StrContains(s.message(), "tag -3 is outside")) {
        return absl::InternalError(s.ToString());
      }
      return absl::OkStatus();
    }
    absl::Status s = comm.Recv(buf.data(), 8, DType::kF32, 0);
    if (s.code() != absl::StatusCode::kInvalidArgument ||
        !absl::StrContains(s.message(), "rank 0 passed invalid arguments to its send to rank 1")) {
      return absl::InternalError(absl::StrCat("peer got ", s.ToString()));
    }
    return absl::OkStatus();
  }));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));  // well before the 60 s timeout
}

TEST(ThreadBackendTest, DestroyingWithPointToPointPendingFailsThePeer) {
  auto comms = CreateThreadCommunicators(2);
  ASSERT_TRUE(comms.ok());
  float x = 0.0f, y = 0.0f;
  auto recv = (*comms)[0]->RecvAsync(&x, 1, DType::kF32, 1);
  ASSERT_TRUE(recv.ok());
  auto pending = (*comms)[1]->RecvAsync(&y, 1, DType::kF32, 0, /*tag=*/9);
  ASSERT_TRUE(pending.ok());
  const absl::Time start = absl::Now();
  (*comms)[1].reset();  // "dies" with its receive posted
  absl::Status s = (*recv)->Wait(absl::Seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not the 60 s timeout
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 1")) << s;
  // The dead rank's own Work outlives its communicator.
  EXPECT_EQ((*pending)->Wait(absl::Seconds(1)).code(), absl::StatusCode::kFailedPrecondition);
  comms->clear();
}

TEST(ThreadBackendTest, SubCommunicatorsOutliveAndPredeceaseTheirParents) {
  std::vector<std::unique_ptr<Communicator>> subs(4);
  {
    auto statuses = RunRanksPerRank(4, [&](Communicator& comm) -> absl::Status {
      auto sub = comm.Split(comm.rank() / 2, 0);
      if (!sub.ok()) return sub.status();
      auto tmp = comm.Split(0, comm.rank());
      if (!tmp.ok()) return tmp.status();
      tmp->reset();  // a child destroyed while the parent lives
      subs[comm.rank()] = std::move(*sub);
      return absl::OkStatus();
    });
    ASSERT_TRUE(statuses.ok());
    for (const absl::Status& s : *statuses) GRADSUM_EXPECT_OK(s);
  }
  // The parents are gone; the children still work.
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(4);
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      int32_t v = r;
      results[r] = subs[r]->AllReduce(&v, &v, 1, DType::kI32);
      if (results[r].ok() && v != (r < 2 ? 1 : 5)) results[r] = absl::InternalError("bad sum");
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) GRADSUM_EXPECT_OK(s);
}

}  // namespace
}  // namespace gradsum
