// WithAgreementCheck over a backend with a small element limit (Communicator::max_count),
// on the thread backend at several world sizes: a count or offset over the limit on one
// rank must fail every rank with InvalidArgument (that rank naming the value, its peers
// naming that rank and repeating its message), not that rank alone while its peers wait
// in the data exchange. The
// mpi backend's limit (INT_MAX) is tested the same way in mpi_backend_test.cc.

#include "collectives/checked_communicator.h"

#include <cstddef>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/forwarding_communicator.h"
#include "collectives/op_descriptor.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

using collectives_internal::MakeAllToAllVCall;
using collectives_internal::MakeBroadcastCall;
using collectives_internal::MakeCall;
using collectives_internal::OpCall;
using collectives_internal::OpKind;

constexpr size_t kLimit = 100;

// Forwards to a thread communicator, but accepts at most kLimit elements per count or
// offset and, like the mpi backend, rejects a larger call on its own rank before any
// exchange (so without the agreement check's own limit the peers would wait for it).
// Blocking calls go through the async forms below, so they are limited too.
class LimitedCommunicator final : public ForwardingCommunicator {
 public:
  explicit LimitedCommunicator(Communicator* inner)
      : ForwardingCommunicator(inner, SyncCalls::kThroughAsync) {}
  explicit LimitedCommunicator(std::unique_ptr<Communicator> owned)
      : ForwardingCommunicator(std::move(owned), SyncCalls::kThroughAsync) {}

  std::string backend() const override { return "limited"; }
  size_t max_count() const override { return kLimit; }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    GRADSUM_RETURN_IF_ERROR(Check(MakeCall(OpKind::kAllReduce, send, recv, count, dtype, op)));
    return inner().AllReduceAsync(send, recv, count, dtype, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    GRADSUM_RETURN_IF_ERROR(
        Check(MakeCall(OpKind::kReduceScatter, send, recv, recv_count, dtype, op)));
    return inner().ReduceScatterAsync(send, recv, recv_count, dtype, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    GRADSUM_RETURN_IF_ERROR(Check(MakeCall(OpKind::kAllGather, send, recv, send_count, dtype)));
    return inner().AllGatherAsync(send, recv, send_count, dtype);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override {
    GRADSUM_RETURN_IF_ERROR(Check(MakeAllToAllVCall(send, send_counts, send_offsets, recv,
                                                    recv_counts, recv_offsets, dtype)));
    return inner().AllToAllVAsync(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                                  dtype);
  }
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    GRADSUM_RETURN_IF_ERROR(Check(MakeBroadcastCall(buf, count, dtype, root)));
    return inner().BroadcastAsync(buf, count, dtype, root);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, inner().Split(color, key));
    if (sub == nullptr) return sub;
    return std::unique_ptr<Communicator>(new LimitedCommunicator(std::move(sub)));
  }

 private:
  absl::Status Check(const OpCall& c) const {
    return collectives_internal::ValidateCall(c, rank(), size(), kLimit);
  }
};

// Every rank sends one float to every peer: rank r's element for peer p is 1000 r + p.
struct OneEach {
  explicit OneEach(int rank, int w)
      : send(static_cast<size_t>(w)),
        recv(static_cast<size_t>(w), -1.0f),
        counts(static_cast<size_t>(w), 1),
        offsets(static_cast<size_t>(w)) {
    for (int p = 0; p < w; ++p) {
      send[p] = static_cast<float>(1000 * rank + p);
      offsets[p] = static_cast<size_t>(p);
    }
  }
  std::vector<float> send, recv;
  std::vector<size_t> counts, offsets;
};

// Expects InvalidArgument whose message holds every one of `words`.
void ExpectInvalid(const absl::Status& s, const std::vector<std::string>& words) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const std::string& w : words) {
    EXPECT_TRUE(absl::StrContains(s.message(), w)) << "missing \"" << w << "\" in: " << s;
  }
}

// One rank over the limit, in each of the ways below; every rank's result is checked, then
// a valid all-to-all-v shows that every communicator is still in step.
enum class Bad { kRecvOffset, kSendCount, kRecvOffsetAsync, kAllReduceCount };

class CheckedLimitTest : public ::testing::TestWithParam<std::tuple<int, Bad>> {};

TEST_P(CheckedLimitTest, OneRankOverTheBackendLimitFailsEveryRank) {
  const auto [world, bad] = GetParam();
  const int bad_rank = world - 1;
  absl::StatusOr<std::vector<absl::Status>> results = testing::RunRanksPerRank(
      world,
      [&, world = world, bad = bad](Communicator& thread_comm) -> absl::Status {
        std::unique_ptr<Communicator> comm =
            WithAgreementCheck(std::make_unique<LimitedCommunicator>(&thread_comm));
        const int r = comm->rank();
        EXPECT_EQ(comm->max_count(), kLimit);
        const bool me = r == bad_rank;
        absl::Status s;
        if (bad == Bad::kAllReduceCount) {
          std::vector<float> x(kLimit + 1, 1.0f);
          s = comm->AllReduce(x.data(), x.data(), me ? kLimit + 1 : kLimit, DType::kF32);
          if (me) {
            ExpectInvalid(s, {"all_reduce", "count 101", "limit of 100"});
          } else {
            ExpectInvalid(s, {"all_reduce", absl::StrCat("rank ", bad_rank, " passed invalid"),
                              "count 101", "limit of 100"});
          }
          EXPECT_EQ(x[0], 1.0f);  // no data moved
        } else {
          OneEach a(r, world);
          std::vector<float> big_send(kLimit + 1 + world, 0.0f);
          const float* send = a.send.data();
          if (me && bad == Bad::kSendCount) {
            a.counts[0] = kLimit + 1;  // what rank 0 does not expect, and over the limit
            send = big_send.data();
          }
          std::vector<size_t> send_counts = a.counts, recv_counts(world, 1);
          if (me && bad != Bad::kSendCount) a.offsets[0] = kLimit + 1;  // recv block 0
          std::vector<size_t> send_offsets(world);
          for (int p = 0; p < world; ++p) send_offsets[p] = p;
          if (bad == Bad::kRecvOffsetAsync) {
            absl::StatusOr<std::unique_ptr<Work>> w =
                comm->AllToAllVAsync(send, send_counts, send_offsets, a.recv.data(), recv_counts,
                                     a.offsets, DType::kF32);
            s = w.ok() ? (*w)->Wait() : w.status();
          } else {
            s = comm->AllToAllV(send, send_counts, send_offsets, a.recv.data(), recv_counts,
                                a.offsets, DType::kF32);
          }
          if (me) {
            ExpectInvalid(
                s, {"all_to_all_v",
                    bad == Bad::kSendCount ? "send block for peer 0" : "recv block for peer 0",
                    "101", "limit of 100"});
          } else {
            // With the bad rank's own message.
            ExpectInvalid(s, {"all_to_all_v", absl::StrCat("rank ", bad_rank, " passed invalid"),
                              "block for peer 0", "101", "limit of 100"});
          }
          for (float v : a.recv) EXPECT_EQ(v, -1.0f);  // no data moved
        }
        // Still in step: a valid exchange delivers every peer's element.
        OneEach ok(r, world);
        GRADSUM_RETURN_IF_ERROR(comm->AllToAllV(ok.send.data(), ok.counts, ok.offsets,
                                                ok.recv.data(), ok.counts, ok.offsets,
                                                DType::kF32));
        for (int p = 0; p < world; ++p) EXPECT_EQ(ok.recv[p], static_cast<float>(1000 * p + r));
        return absl::OkStatus();
      },
      // A peer left waiting for the bad rank would fail with DeadlineExceeded after this.
      {.timeout = absl::Seconds(20)});
  ASSERT_TRUE(results.ok()) << results.status();
  for (int r = 0; r < world; ++r)
    EXPECT_TRUE((*results)[r].ok()) << "rank " << r << ": " << (*results)[r];
}

INSTANTIATE_TEST_SUITE_P(Worlds, CheckedLimitTest,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(Bad::kRecvOffset, Bad::kSendCount,
                                                              Bad::kRecvOffsetAsync,
                                                              Bad::kAllReduceCount)));

TEST(CheckedCommunicatorTest, ReportsTheInnerLimit) {
  absl::StatusOr<std::vector<absl::Status>> results =
      testing::RunRanksPerRank(2, [](Communicator& thread_comm) -> absl::Status {
        EXPECT_EQ(
            WithAgreementCheck(std::make_unique<LimitedCommunicator>(&thread_comm))->max_count(),
            kLimit);
        // The thread backend has no limit of its own.
        EXPECT_EQ(thread_comm.max_count(), std::numeric_limits<size_t>::max());
        return absl::OkStatus();
      });
  ASSERT_TRUE(results.ok()) << results.status();
}

}  // namespace
}  // namespace gradsum
