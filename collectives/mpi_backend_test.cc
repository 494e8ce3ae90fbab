// Tests of the mpi backend, run under mpirun at 2 and 4 processes (see BUILD).
//
// Every rank's input is a deterministic function of (dtype, rank, index), so every rank
// computes every other rank's input and the expected result directly, in double
// precision, without any communication. Inputs are chosen so that sums are exact in fp32:
// the expected value of a reduction is then exactly "sum, round once to the dtype".

#include "collectives/mpi_backend.h"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/conformance.h"
#include "core/dtype.h"
#include "core/half.h"
#include "gtest/gtest.h"

namespace gradsum {
namespace {

// ---- Element access by dtype, in double. ----

void SetElement(unsigned char* buf, DType t, size_t i, double v) {
  unsigned char* p = buf + i * DTypeSize(t);
  switch (t) {
    case DType::kF32: {
      float x = static_cast<float>(v);
      std::memcpy(p, &x, 4);
      break;
    }
    case DType::kF64:
      std::memcpy(p, &v, 8);
      break;
    case DType::kBF16: {
      uint16_t b = BF16::FromFloat(static_cast<float>(v)).bits;
      std::memcpy(p, &b, 2);
      break;
    }
    case DType::kF16: {
      uint16_t b = F16::FromFloat(static_cast<float>(v)).bits;
      std::memcpy(p, &b, 2);
      break;
    }
    case DType::kI32: {
      int32_t x = static_cast<int32_t>(v);
      std::memcpy(p, &x, 4);
      break;
    }
    case DType::kI64: {
      int64_t x = static_cast<int64_t>(v);
      std::memcpy(p, &x, 8);
      break;
    }
  }
}

double GetElement(const unsigned char* buf, DType t, size_t i) {
  const unsigned char* p = buf + i * DTypeSize(t);
  switch (t) {
    case DType::kF32: {
      float x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case DType::kF64: {
      double x;
      std::memcpy(&x, p, 8);
      return x;
    }
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return BF16::FromBits(b).ToFloat();
    }
    case DType::kF16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return F16::FromBits(b).ToFloat();
    }
    case DType::kI32: {
      int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case DType::kI64: {
      int64_t x;
      std::memcpy(&x, p, 8);
      return static_cast<double>(x);
    }
  }
  return 0;
}

void SetElement(std::vector<unsigned char>& buf, DType t, size_t i, double v) {
  SetElement(buf.data(), t, i, v);
}

double GetElement(const std::vector<unsigned char>& buf, DType t, size_t i) {
  return GetElement(buf.data(), t, i);
}

// `v` rounded to the dtype, as a double.
double RoundTo(DType t, double v) {
  unsigned char one[8];
  SetElement(one, t, 0, v);
  return GetElement(one, t, 0);
}

// A value large enough that adding the small values below needs the accumulator's extra
// bits: for bf16 (8 significant bits) 256 + 0.25 is not representable, so a backend that
// rounded after every addition would differ from "sum in fp32, round once".
double Big(DType t) {
  switch (t) {
    case DType::kBF16:
      return 256;
    case DType::kF16:
      return 2048;
    case DType::kF32:
      return 1 << 20;
    case DType::kF64:
      return std::ldexp(1.0, 40);
    case DType::kI32:
      return 1 << 20;
    case DType::kI64:
      return std::ldexp(1.0, 40);  // needs 64-bit integers
  }
  return 0;
}

// Rank `rank`'s element `i`, before rounding to the dtype.
double InputValue(DType t, int rank, size_t i) {
  double v = static_cast<double>(static_cast<int>((rank * 7 + i * 13) % 17) - 8);
  if (IsFloating(t)) v *= 0.25;
  if (i % 11 == 0 && rank == 0) v += Big(t);
  return v;
}

std::vector<unsigned char> MakeInput(DType t, int rank, size_t n, size_t index_base = 0) {
  std::vector<unsigned char> buf(n * DTypeSize(t));
  for (size_t i = 0; i < n; ++i) SetElement(buf, t, i, InputValue(t, rank, index_base + i));
  return buf;
}

// Converts a double that is exactly representable in fp32 (all references here are) to
// the dtype the way the backend's single rounding does.
std::vector<unsigned char> FromDoubles(DType t, const std::vector<double>& v) {
  std::vector<unsigned char> buf(v.size() * DTypeSize(t));
  for (size_t i = 0; i < v.size(); ++i) SetElement(buf, t, i, v[i]);
  return buf;
}

// Reference reduction over all ranks of element i of MakeInput(t, r, n, base).
double ReferenceReduce(DType t, ReduceOp op, int world, size_t i) {
  double sum = 0, max = -std::numeric_limits<double>::infinity();
  for (int r = 0; r < world; ++r) {
    const double x = RoundTo(t, InputValue(t, r, i));  // the rounded input
    sum += x;
    max = std::max(max, x);
  }
  switch (op) {
    case ReduceOp::kSum:
      return sum;
    case ReduceOp::kMax:
      return max;
    case ReduceOp::kAvg:
      return sum / world;  // floating dtypes only
  }
  return 0;
}

// Compares element-wise and reports the first difference.
void ExpectSame(const std::vector<unsigned char>& got, const std::vector<unsigned char>& want,
                DType t) {
  ASSERT_EQ(got.size(), want.size());
  const size_t n = got.size() / DTypeSize(t);
  for (size_t i = 0; i < n; ++i) {
    const double g = GetElement(got, t, i), w = GetElement(want, t, i);
    if (g != w) {
      ADD_FAILURE() << "element " << i << " of " << n << " (" << DTypeName(t) << "): got " << g
                    << ", want " << w;
      return;
    }
  }
}

constexpr ReduceOp kAllReduceOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

class MpiBackendTest : public ::testing::Test {
 protected:
  void SetUp() override { comm_ = MakeWorld(absl::Seconds(10)); }

  static std::unique_ptr<Communicator> MakeWorld(absl::Duration timeout) {
    absl::StatusOr<std::unique_ptr<Communicator>> c =
        CreateMpiWorldCommunicator({.timeout = timeout});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  std::unique_ptr<Communicator> comm_;
};

TEST_F(MpiBackendTest, WorldMatchesMpiCommWorld) {
  ASSERT_NE(comm_, nullptr);
  int rank = -1, size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(comm_->rank(), rank);
  EXPECT_EQ(comm_->size(), size);
  EXPECT_EQ(comm_->backend(), "mpi");
  EXPECT_EQ(comm_->timeout(), absl::Seconds(10));
}

TEST_F(MpiBackendTest, AllReduceEveryDTypeOpAndPlacement) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size();
  const size_t n = 1031;  // odd, not a multiple of any world size
  for (DType t : kAllDTypes) {
    for (ReduceOp op : kAllReduceOps) {
      if (op == ReduceOp::kAvg && !IsFloating(t)) continue;  // rejected, tested below
      std::vector<double> want(n);
      for (size_t i = 0; i < n; ++i) want[i] = ReferenceReduce(t, op, world, i);
      const std::vector<unsigned char> expected = FromDoubles(t, want);
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(t), " ", ReduceOpName(op),
                                  in_place ? " in place" : " out of place"));
        std::vector<unsigned char> send = MakeInput(t, comm_->rank(), n);
        std::vector<unsigned char> recv(send.size(), 0xAB);
        void* out = in_place ? send.data() : recv.data();
        ASSERT_TRUE(comm_->AllReduce(send.data(), out, n, t, op).ok());
        ExpectSame(in_place ? send : recv, expected, t);
        if (!in_place) ExpectSame(send, MakeInput(t, comm_->rank(), n), t);  // untouched
      }
    }
  }
}

// More than one of the backend's 2^20-element chunks, in and out of place.
TEST_F(MpiBackendTest, AllReduceLargerThanOneChunk) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size();
  const size_t n = (size_t{1} << 20) + 3;
  for (DType t : {DType::kF32, DType::kBF16}) {
    std::vector<double> want(n);
    for (size_t i = 0; i < n; ++i) want[i] = ReferenceReduce(t, ReduceOp::kSum, world, i);
    const std::vector<unsigned char> expected = FromDoubles(t, want);
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(t), in_place ? " in place" : " out of place"));
      std::vector<unsigned char> send = MakeInput(t, comm_->rank(), n);
      std::vector<unsigned char> recv(send.size(), 0);
      void* out = in_place ? send.data() : recv.data();
      ASSERT_TRUE(comm_->AllReduce(send.data(), out, n, t, ReduceOp::kSum).ok());
      ExpectSame(in_place ? send : recv, expected, t);
    }
  }
}

TEST_F(MpiBackendTest, AllReduceOfNothingSucceeds) {
  ASSERT_NE(comm_, nullptr);
  EXPECT_TRUE(comm_->AllReduce(nullptr, nullptr, 0, DType::kBF16, ReduceOp::kSum).ok());
}

// 256 + 1 + 1 + 1 in bf16: summed in fp32 and rounded once it is 259 -> 260 (nearest even);
// rounding after each addition would give 256 every time.
TEST_F(MpiBackendTest, Bf16SumRoundsOnce) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size();
  BF16 mine = BF16::FromFloat(comm_->rank() == 0 ? 256.0f : 1.0f);
  BF16 out;
  ASSERT_TRUE(comm_->AllReduce(&mine, &out, 1, DType::kBF16, ReduceOp::kSum).ok());
  EXPECT_EQ(out.bits, BF16::FromFloat(256.0f + static_cast<float>(world - 1)).bits)
      << "got " << out.ToFloat();
  if (world == 4) {
    EXPECT_EQ(out.ToFloat(), 260.0f);
  }
}

TEST_F(MpiBackendTest, ReduceScatterEveryDTypeOpAndPlacement) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size(), rank = comm_->rank();
  const size_t block = 257;
  const size_t n = block * world;
  for (DType t : kAllDTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      if (op == ReduceOp::kAvg && !IsFloating(t)) continue;
      std::vector<double> want(block);
      for (size_t i = 0; i < block; ++i) want[i] = ReferenceReduce(t, op, world, rank * block + i);
      const std::vector<unsigned char> expected = FromDoubles(t, want);
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(t), " ", ReduceOpName(op),
                                  in_place ? " in place" : " out of place"));
        std::vector<unsigned char> send = MakeInput(t, rank, n);
        std::vector<unsigned char> recv(block * DTypeSize(t), 0xCD);
        if (in_place) {  // recv is this rank's block of send
          const size_t bytes = block * DTypeSize(t);
          ASSERT_TRUE(
              comm_->ReduceScatter(send.data(), send.data() + rank * bytes, block, t, op).ok());
          ExpectSame(std::vector<unsigned char>(send.begin() + rank * bytes,
                                                send.begin() + (rank + 1) * bytes),
                     expected, t);
        } else {
          ASSERT_TRUE(comm_->ReduceScatter(send.data(), recv.data(), block, t, op).ok());
          ExpectSame(recv, expected, t);
        }
      }
    }
  }
}

TEST_F(MpiBackendTest, ReduceScatterMaxIsInvalidArgument) {
  ASSERT_NE(comm_, nullptr);
  std::vector<float> send(comm_->size()), recv(1);
  absl::Status s = comm_->ReduceScatter(send.data(), recv.data(), 1, DType::kF32, ReduceOp::kMax);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("max"), std::string::npos) << s;
}

TEST_F(MpiBackendTest, AllGatherEveryDTypeAndPlacement) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size(), rank = comm_->rank();
  const size_t n = 129;
  for (DType t : kAllDTypes) {
    std::vector<unsigned char> expected;
    for (int r = 0; r < world; ++r) {
      std::vector<unsigned char> block = MakeInput(t, r, n);
      expected.insert(expected.end(), block.begin(), block.end());
    }
    const size_t bytes = n * DTypeSize(t);
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(t), in_place ? " in place" : " out of place"));
      std::vector<unsigned char> mine = MakeInput(t, rank, n);
      std::vector<unsigned char> recv(world * bytes, 0xEF);
      const void* send = mine.data();
      if (in_place) {
        std::memcpy(recv.data() + rank * bytes, mine.data(), bytes);
        send = recv.data() + rank * bytes;
      }
      ASSERT_TRUE(comm_->AllGather(send, recv.data(), n, t).ok());
      ExpectSame(recv, expected, t);
    }
  }
}

// Elements rank `from` sends to rank `to`; zero for several pairs, including self-sends.
size_t PairCount(int from, int to) { return static_cast<size_t>((from * 3 + to * 5) % 4); }

TEST_F(MpiBackendTest, AllToAllVUnevenCountsWithZeros) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size(), rank = comm_->rank();
  for (DType t : kAllDTypes) {
    SCOPED_TRACE(DTypeName(t));
    // Send blocks in peer order with a one-element gap; receive blocks in reverse peer order.
    std::vector<size_t> send_counts(world), send_offsets(world), recv_counts(world),
        recv_offsets(world);
    size_t at = 0;
    for (int p = 0; p < world; ++p) {
      send_counts[p] = PairCount(rank, p);
      send_offsets[p] = at;
      at += send_counts[p] + 1;
    }
    std::vector<unsigned char> send(at * DTypeSize(t), 0);
    for (int p = 0; p < world; ++p) {
      for (size_t j = 0; j < send_counts[p]; ++j) {
        SetElement(send, t, send_offsets[p] + j, InputValue(t, rank, 100 * p + j));
      }
    }
    size_t recv_total = 0;
    for (int p = world - 1; p >= 0; --p) {
      recv_counts[p] = PairCount(p, rank);
      recv_offsets[p] = recv_total;
      recv_total += recv_counts[p];
    }
    std::vector<unsigned char> recv(recv_total * DTypeSize(t), 0x5A);
    ASSERT_TRUE(comm_
                    ->AllToAllV(send.data(), send_counts, send_offsets, recv.data(), recv_counts,
                                recv_offsets, t)
                    .ok());
    std::vector<unsigned char> expected(recv.size());
    for (int p = 0; p < world; ++p) {
      for (size_t j = 0; j < recv_counts[p]; ++j) {
        SetElement(expected, t, recv_offsets[p] + j, InputValue(t, p, 100 * rank + j));
      }
    }
    ExpectSame(recv, expected, t);
  }
}

TEST_F(MpiBackendTest, BroadcastFromEveryRootEveryDType) {
  ASSERT_NE(comm_, nullptr);
  const size_t n = 77;
  for (DType t : kAllDTypes) {
    for (int root = 0; root < comm_->size(); ++root) {
      SCOPED_TRACE(absl::StrCat(DTypeName(t), " root ", root));
      std::vector<unsigned char> buf = MakeInput(t, comm_->rank(), n);
      ASSERT_TRUE(comm_->Broadcast(buf.data(), n, t, root).ok());
      ExpectSame(buf, MakeInput(t, root, n), t);
    }
  }
}

// Rank 0 arrives late; nobody may leave the barrier before it arrives. All ranks share
// one machine clock, so rank 0's arrival time (sent afterwards over plain MPI) bounds
// every rank's exit time.
TEST_F(MpiBackendTest, BarrierWaitsForEveryRank) {
  ASSERT_NE(comm_, nullptr);
  int64_t rank0_arrival_ns = 0;
  if (comm_->rank() == 0) {
    absl::SleepFor(absl::Milliseconds(300));
    rank0_arrival_ns = absl::ToUnixNanos(absl::Now());
  }
  ASSERT_TRUE(comm_->Barrier().ok());
  const int64_t exit_ns = absl::ToUnixNanos(absl::Now());
  MPI_Bcast(&rank0_arrival_ns, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  EXPECT_GE(exit_ns, rank0_arrival_ns);
}

// Expects `s` to be InvalidArgument mentioning every string in `words`.
void ExpectInvalid(const absl::Status& s, std::initializer_list<const char*> words) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const char* w : words) EXPECT_NE(s.message().find(w), std::string::npos) << w << ": " << s;
}

// A sync call issued while async ones are pending runs after them (the sync fast path on
// the caller's thread must not overtake the queue): the all-reduce sees the async
// all-reduce's result.
TEST_F(MpiBackendTest, SyncCallAfterPendingAsyncRunsSecond) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size();
  std::vector<int64_t> buf(300, comm_->rank() + 1);
  auto first =
      comm_->AllReduceAsync(buf.data(), buf.data(), buf.size(), DType::kI64, ReduceOp::kSum);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(comm_->AllReduce(buf.data(), buf.data(), buf.size(), DType::kI64).ok());
  ASSERT_TRUE((*first)->Wait().ok());
  const int64_t once = static_cast<int64_t>(world) * (world + 1) / 2;
  EXPECT_EQ(buf, std::vector<int64_t>(300, once * world));
}

// Without the agreement decorator the backend only moves data: correct results, local
// argument checks still InvalidArgument, the mismatch check gone (not exercised: it
// would be undefined).
TEST_F(MpiBackendTest, WithoutAgreementCheckDataStillMoves) {
  MpiBackendOptions o;
  o.timeout = absl::Seconds(10);
  o.check_agreement = false;
  absl::StatusOr<std::unique_ptr<Communicator>> raw = CreateMpiWorldCommunicator(o);
  ASSERT_TRUE(raw.ok()) << raw.status();
  Communicator& c = **raw;
  const int world = c.size();
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(c.rank() * 3 + i % 5);
  ASSERT_TRUE(c.AllReduce(v.data(), v.data(), v.size(), DType::kF32).ok());
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_EQ(v[i], static_cast<float>(3 * world * (world - 1) / 2 + world * (i % 5))) << i;
  }
  float x = 0;
  ExpectInvalid(c.AllReduce(nullptr, &x, 1, DType::kF32), {"null"});
  ASSERT_TRUE(c.Barrier().ok());
  conformance::CheckOptions exact;  // MPI's summation order is its own beyond 2 ranks
  exact.rank_ordered_sums = false;
  const absl::Status async = conformance::CheckAsyncInIssueOrder(c, exact);
  ASSERT_TRUE(async.ok()) << async;
}

// blocking_sync_calls = false: sync calls through non-blocking MPI polled with MPI_Test
// (the default, blocking path is what the other tests exercise): the conformance suite,
// with and without the agreement check (whose descriptor exchange is then non-blocking too).
TEST_F(MpiBackendTest, NonBlockingSyncCallsPassTheConformanceSuite) {
  for (bool check : {true, false}) {
    MpiBackendOptions o;
    o.timeout = absl::Seconds(10);
    o.check_agreement = check;
    o.blocking_sync_calls = false;
    absl::StatusOr<std::unique_ptr<Communicator>> c = CreateMpiWorldCommunicator(o);
    ASSERT_TRUE(c.ok()) << c.status();
    conformance::CheckOptions exact;
    exact.rank_ordered_sums = false;
    absl::Status s = conformance::CheckAll(**c, exact);
    EXPECT_TRUE(s.ok()) << "check_agreement=" << check << ": " << s;
    if (check) {
      s = conformance::CheckMismatchesFail(**c);
      EXPECT_TRUE(s.ok()) << s;
    }
  }
}

// Two async in-place all-reduces of one buffer: the second must see the first's result,
// whatever order the handles are waited in.
TEST_F(MpiBackendTest, AsyncOperationsRunInIssueOrder) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size();
  const size_t n = 4096;
  std::vector<double> buf(n), expected(n);
  for (size_t i = 0; i < n; ++i) {
    buf[i] = InputValue(DType::kF64, comm_->rank(), i);
    expected[i] = world * ReferenceReduce(DType::kF64, ReduceOp::kSum, world, i);
  }
  auto first = comm_->AllReduceAsync(buf.data(), buf.data(), n, DType::kF64, ReduceOp::kSum);
  auto second = comm_->AllReduceAsync(buf.data(), buf.data(), n, DType::kF64, ReduceOp::kSum);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE((*second)->Wait(absl::Seconds(20)).ok());
  EXPECT_TRUE((*first)->IsCompleted());
  ASSERT_TRUE((*first)->Wait().ok());
  EXPECT_EQ(buf, expected);
}

TEST_F(MpiBackendTest, SplitByParityWithReversedKeys) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size(), rank = comm_->rank();
  absl::StatusOr<std::unique_ptr<Communicator>> child = comm_->Split(rank % 2, world - rank);
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_NE(*child, nullptr);
  std::vector<int> members;  // old ranks with my parity, ordered by key = descending rank
  for (int r = world - 1; r >= 0; --r) {
    if (r % 2 == rank % 2) members.push_back(r);
  }
  EXPECT_EQ((*child)->size(), static_cast<int>(members.size()));
  EXPECT_EQ((*child)->rank(), std::find(members.begin(), members.end(), rank) - members.begin());
  EXPECT_EQ((*child)->timeout(), comm_->timeout());
  int64_t mine = 1000 + rank, sum = 0;
  ASSERT_TRUE((*child)->AllReduce(&mine, &sum, 1, DType::kI64, ReduceOp::kSum).ok());
  int64_t want = 0;
  for (int r : members) want += 1000 + r;
  EXPECT_EQ(sum, want);
  // The parent is still usable, and ordered independently of the child.
  ASSERT_TRUE(comm_->Barrier().ok());
}

TEST_F(MpiBackendTest, SplitWithNegativeColorReturnsNull) {
  ASSERT_NE(comm_, nullptr);
  const int rank = comm_->rank();
  absl::StatusOr<std::unique_ptr<Communicator>> child = comm_->Split(rank == 0 ? -1 : 7, 0);
  ASSERT_TRUE(child.ok()) << child.status();
  if (rank == 0) {
    EXPECT_EQ(*child, nullptr);
    return;
  }
  ASSERT_NE(*child, nullptr);
  EXPECT_EQ((*child)->size(), comm_->size() - 1);
  EXPECT_EQ((*child)->rank(), rank - 1);
  ASSERT_TRUE((*child)->Barrier().ok());
}

TEST_F(MpiBackendTest, DisagreementsFailEveryRankAndLeaveTheCommunicatorUsable) {
  ASSERT_NE(comm_, nullptr);
  const int rank = comm_->rank();
  std::vector<double> buf(64, 1.0);
  {
    SCOPED_TRACE("dtype");
    const DType t = rank == 0 ? DType::kF64 : DType::kF32;
    ExpectInvalid(comm_->AllReduce(buf.data(), buf.data(), 8, t), {"dtype", "f32", "f64"});
  }
  {
    SCOPED_TRACE("count");
    ExpectInvalid(comm_->AllReduce(buf.data(), buf.data(), rank == 0 ? 8 : 9, DType::kF64),
                  {"element count", "8 vs 9"});
  }
  {
    SCOPED_TRACE("reduce op");
    const ReduceOp op = rank == 0 ? ReduceOp::kMax : ReduceOp::kSum;
    ExpectInvalid(comm_->AllReduce(buf.data(), buf.data(), 8, DType::kF64, op),
                  {"reduce op", "sum", "max"});
  }
  {
    SCOPED_TRACE("operation");
    absl::Status s = rank == 0 ? comm_->Broadcast(buf.data(), 8, DType::kF64, 0)
                               : comm_->AllReduce(buf.data(), buf.data(), 8, DType::kF64);
    ExpectInvalid(s, {"operation", "all_reduce", "broadcast"});
  }
  {
    SCOPED_TRACE("root");
    ExpectInvalid(comm_->Broadcast(buf.data(), 8, DType::kF64, rank == 0 ? 1 : 0), {"root"});
  }
  // No data moved, and the ranks are still in step.
  EXPECT_EQ(buf, std::vector<double>(64, 1.0));
  double one = 1, total = 0;
  ASSERT_TRUE(comm_->AllReduce(&one, &total, 1, DType::kF64).ok());
  EXPECT_EQ(total, comm_->size());
}

// Rank 0 expects one more element from rank 1 than rank 1 sends.
TEST_F(MpiBackendTest, AllToAllVCountDisagreementFailsEveryRank) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size(), rank = comm_->rank();
  std::vector<size_t> counts(world, 2), offsets(world);
  for (int p = 0; p < world; ++p) offsets[p] = 3 * p;
  std::vector<size_t> recv_counts = counts;
  if (rank == 0) recv_counts[1] = 3;
  std::vector<float> send(3 * world, 1.0f), recv(3 * world, 0.0f);
  absl::Status s = comm_->AllToAllV(send.data(), counts, offsets, recv.data(), recv_counts, offsets,
                                    DType::kF32);
  ExpectInvalid(s, {"rank 1 sends 2 elements to rank 0", "expects 3"});
  EXPECT_EQ(recv, std::vector<float>(3 * world, 0.0f));
  ASSERT_TRUE(comm_->Barrier().ok());
}

// Every rank passes the same bad arguments: each fails locally, nobody exchanges anything,
// and the communicator stays in step.
TEST_F(MpiBackendTest, BadLocalArgumentsAreInvalidArgument) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size();
  float x = 0;
  ExpectInvalid(comm_->AllReduce(nullptr, &x, 1, DType::kF32), {"null"});
  ExpectInvalid(comm_->Broadcast(&x, 1, DType::kF32, world), {"root", absl::StrCat(world).c_str()});
  ExpectInvalid(comm_->Broadcast(&x, 1, DType::kF32, -1), {"root -1"});
  ExpectInvalid(comm_->AllReduce(&x, &x, size_t{1} << 33, DType::kF32), {"8589934592"});
  ExpectInvalid(comm_->AllReduce(&x, &x, 1, static_cast<DType>(99)), {"99"});
  ExpectInvalid(comm_->AllReduce(&x, &x, 1, DType::kF32, static_cast<ReduceOp>(7)), {"7"});
  int32_t i = 0;
  ExpectInvalid(comm_->AllReduce(&i, &i, 1, DType::kI32, ReduceOp::kAvg), {"avg", "i32"});
  // Overlaps other than the documented in-place layouts.
  std::vector<float> buf(4 * world + 1);
  ExpectInvalid(comm_->AllReduce(buf.data(), buf.data() + 1, 2, DType::kF32), {"overlap"});
  float* not_my_block = buf.data() + 1;  // in place would be buf + 2 * rank
  ExpectInvalid(comm_->ReduceScatter(buf.data(), not_my_block, 2, DType::kF32),
                {"recv == send + rank * recv_count"});
  ExpectInvalid(comm_->AllGather(not_my_block, buf.data(), 2, DType::kF32),
                {"send == recv + rank * send_count"});
  std::vector<size_t> ones(world, 1), zeros(world, 0), same_offset(world, 0);
  ExpectInvalid(comm_->AllToAllV(buf.data(), zeros, zeros, buf.data() + world, ones, same_offset,
                                 DType::kF32),
                {"recv blocks overlap"});
  std::vector<size_t> short_counts(world + 1, 0);
  std::vector<size_t> counts(world, 0);
  ExpectInvalid(comm_->AllToAllV(&x, short_counts, counts, &x, counts, counts, DType::kF32),
                {"send_counts", absl::StrCat(world + 1).c_str()});
  ASSERT_TRUE(comm_->Barrier().ok());
}

// Rank 0's arguments are bad: it fails locally, its peers fail the same operation with
// InvalidArgument naming rank 0 (no timeout), and the communicator stays in step.
TEST_F(MpiBackendTest, InvalidArgumentsOnOneRankFailItsPeersToo) {
  ASSERT_NE(comm_, nullptr);
  float x = 1;
  const absl::Time start = absl::Now();
  if (comm_->rank() == 0) {
    ExpectInvalid(comm_->AllReduce(nullptr, &x, 1, DType::kF32), {"null"});
  } else {
    ExpectInvalid(comm_->AllReduce(&x, &x, 1, DType::kF32),
                  {"rank 0 passed invalid arguments", "all_reduce", "send buffer is null"});
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(x, 1.0f);
  float sum = 0;
  ASSERT_TRUE(comm_->AllReduce(&x, &sum, 1, DType::kF32).ok());
  EXPECT_EQ(sum, static_cast<float>(comm_->size()));
}

// The last rank's all-to-all-v has a receive offset past INT_MAX (MPI's int counts): the
// agreement check knows the backend's limit (max_count), so that rank fails with the value
// and its peers with InvalidArgument naming it, instead of entering MPI_Alltoallv alone and
// waiting for the watchdog to end the job. Nothing is allocated at that offset: the call
// is rejected before any buffer is touched. The communicator stays in step.
TEST_F(MpiBackendTest, OffsetBeyondIntMaxOnOneRankFailsEveryRank) {
  ASSERT_NE(comm_, nullptr);
  const int world = comm_->size(), rank = comm_->rank(), bad = world - 1;
  EXPECT_EQ(comm_->max_count(), static_cast<size_t>(std::numeric_limits<int>::max()));
  std::vector<float> send(world), recv(world, -1.0f);
  std::vector<size_t> ones(world, 1), offsets(world), recv_offsets(world);
  for (int p = 0; p < world; ++p) {
    send[p] = static_cast<float>(100 * rank + p);
    offsets[p] = recv_offsets[p] = static_cast<size_t>(p);
  }
  if (rank == bad) recv_offsets[0] = size_t{1} << 31;
  absl::Status s =
      comm_->AllToAllV(send.data(), ones, offsets, recv.data(), ones, recv_offsets, DType::kF32);
  if (rank == bad) {
    ExpectInvalid(s, {"all_to_all_v", "recv block for peer 0", "2147483648", "2147483647"});
  } else {
    ExpectInvalid(s, {"all_to_all_v", absl::StrCat("rank ", bad, " passed invalid").c_str(),
                      "recv block for peer 0", "2147483648"});
  }
  for (float v : recv) EXPECT_EQ(v, -1.0f);
  ASSERT_TRUE(
      comm_->AllToAllV(send.data(), ones, offsets, recv.data(), ones, offsets, DType::kF32).ok());
  for (int p = 0; p < world; ++p) EXPECT_EQ(recv[p], static_cast<float>(100 * p + rank));
}

// Rank 0 skips an all-reduce altogether: its barrier pairs with the others' all-reduce,
// which every rank reports; the next operation lines up again.
TEST_F(MpiBackendTest, SkippedOperationIsAnOperationMismatch) {
  ASSERT_NE(comm_, nullptr);
  float x = 1;
  absl::Status s = comm_->rank() == 0 ? comm_->Barrier() : comm_->AllReduce(&x, &x, 1, DType::kF32);
  ExpectInvalid(s, {"operation", "all_reduce vs barrier"});
  EXPECT_EQ(x, 1.0f);
  EXPECT_TRUE(comm_->Barrier().ok());
}

// One rank's sync call against its peers' async form of the same operation (or the options
// form with a per-call timeout, which is async + Wait): the mpi backend would run blocking
// against non-blocking MPI, which never match, so the agreement check fails every rank with
// InvalidArgument, no data moves, and the next operation lines up again.
TEST_F(MpiBackendTest, SyncAgainstAsyncIsADisagreement) {
  ASSERT_NE(comm_, nullptr);
  for (bool per_call_timeout : {false, true}) {
    float x = 1;
    absl::Status s;
    if (comm_->rank() == 0) {
      s = comm_->AllReduce(&x, &x, 1, DType::kF32);
    } else if (per_call_timeout) {
      AllReduceOptions o;
      o.send = &x;
      o.recv = &x;
      o.count = 1;
      o.timeout = absl::Seconds(20);
      s = comm_->AllReduce(o);
    } else {
      absl::StatusOr<std::unique_ptr<Work>> w =
          comm_->AllReduceAsync(&x, &x, 1, DType::kF32, ReduceOp::kSum);
      s = w.ok() ? (*w)->Wait(absl::Seconds(20)) : w.status();
    }
    ExpectInvalid(s, {"sync versus async", "sync vs async"});
    EXPECT_EQ(x, 1.0f);
    EXPECT_TRUE(comm_->Barrier().ok());
  }
}

// With blocking_sync_calls = false a sync call that times out returns DeadlineExceeded
// (with the default blocking calls the job ends instead: mpi_watchdog_test.sh).
TEST_F(MpiBackendTest, AbsentRankMakesOthersFailWithDeadlineExceeded) {
  MpiBackendOptions o;
  o.timeout = absl::Seconds(1);
  o.blocking_sync_calls = false;
  absl::StatusOr<std::unique_ptr<Communicator>> made = CreateMpiWorldCommunicator(o);
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<Communicator> comm = std::move(*made);
  if (comm->rank() == comm->size() - 1) return;  // never arrives
  float x = 1;
  const absl::Time start = absl::Now();
  absl::Status s = comm->AllReduce(&x, &x, 1, DType::kF32);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(absl::Now() - start, absl::Seconds(1));
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  absl::Status later = comm->Barrier();
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
  EXPECT_NE(later.message().find("unusable"), std::string::npos) << later;
}

// A receive whose sender never posts fails after the timeout naming that peer.
TEST_F(MpiBackendTest, PointToPointPeerThatNeverPostsTimesOutNamingIt) {
  // Two ranks only: these leave operations in flight on communicators that other ranks
  // free, and at np4 a stale message then reached a later sub-communicator of the suite
  // (Open MPI reuses context ids); the np2 run covers the behaviour.
  if (comm_->size() != 2) GTEST_SKIP() << "runs at np2";
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(1));
  ASSERT_NE(comm, nullptr);
  const int last = comm->size() - 1;
  if (comm->rank() != 0) return;  // the last rank never sends
  float x[4];
  const absl::Time start = absl::Now();
  absl::Status s = comm->Recv(x, 4, DType::kF32, last);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find(absl::StrCat("rank ", last, " did not post the matching send")),
            std::string::npos)
      << s;
  EXPECT_GE(absl::Now() - start, absl::Seconds(1));
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  EXPECT_EQ(comm->Send(x, 4, DType::kF32, last).code(), absl::StatusCode::kFailedPrecondition);
}

// A rank blocked in a receive on one communicator is named by the where-is-everyone report
// of another communicator with the peer it waits for (a CP ring's neighbour, asked by the
// data-parallel group).
TEST_F(MpiBackendTest, PendingReceiveIsNamedInAnotherCommunicatorsReport) {
  // Two ranks only: these leave operations in flight on communicators that other ranks
  // free, and at np4 a stale message then reached a later sub-communicator of the suite
  // (Open MPI reuses context ids); the np2 run covers the behaviour.
  if (comm_->size() != 2) GTEST_SKIP() << "runs at np2";
  MpiBackendOptions o;
  o.timeout = absl::Seconds(1);
  o.blocking_sync_calls = false;
  absl::StatusOr<std::unique_ptr<Communicator>> other = CreateMpiWorldCommunicator(o);
  ASSERT_TRUE(other.ok()) << other.status();
  std::unique_ptr<Communicator> ring = MakeWorld(absl::Seconds(30));
  ASSERT_NE(ring, nullptr);
  float x = 1;
  if (comm_->rank() == 1) {
    // Waits for rank 0, which first times out in the other communicator's all-reduce.
    absl::Status got = ring->Recv(&x, 1, DType::kF32, 0, /*tag=*/4);
    EXPECT_TRUE(got.ok()) << got;
    // Joins the all-reduce late (OK or DeadlineExceeded), so that no message of it is
    // left in flight towards a communicator that has gone.
    (*other)->AllReduce(&x, &x, 1, DType::kF32).IgnoreError();
    return;
  }
  absl::Status s = (*other)->AllReduce(&x, &x, 1, DType::kF32);
  if (comm_->rank() != 0) return;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("rank 1 (in no operation of this communicator yet; its mpi recv #"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("from world rank 0 is pending"), std::string::npos) << s;
  EXPECT_TRUE(ring->Send(&x, 1, DType::kF32, 1, /*tag=*/4).ok());
}

// The backend-independent conformance suite (//collectives:conformance). Small-integer
// inputs make every summation order exact. With two ranks any order is also the ascending
// one (a + b == b + a), so there the stricter bit-for-bit mode over full-precision random
// inputs applies as well.
TEST_F(MpiBackendTest, ConformanceSuite) {
  ASSERT_NE(comm_, nullptr);
  conformance::CheckOptions exact;
  exact.rank_ordered_sums = false;
  absl::Status s = conformance::CheckAll(*comm_, exact);
  EXPECT_TRUE(s.ok()) << s;
  if (comm_->size() == 2) {
    conformance::CheckOptions ordered;
    ordered.rank_ordered_sums = true;
    ordered.seed = 7;
    s = conformance::CheckAll(*comm_, ordered);
    EXPECT_TRUE(s.ok()) << s;
  }
  s = conformance::CheckMismatchesFail(*comm_);
  EXPECT_TRUE(s.ok()) << s;
  s = conformance::CheckPointToPoint(*comm_);
  EXPECT_TRUE(s.ok()) << s;
}

TEST(MpiBackendFactoryTest, NonPositiveTimeoutIsInvalidArgument) {
  absl::StatusOr<std::unique_ptr<Communicator>> c =
      CreateMpiWorldCommunicator({.timeout = absl::ZeroDuration()});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
}

}  // namespace
}  // namespace gradsum
