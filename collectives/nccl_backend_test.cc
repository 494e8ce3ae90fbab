// The nccl backend at world size 1 on one GPU, each operation compared with the thread
// backend's result on the same host input. Without a usable GPU the device tests skip
// with the CUDA runtime's reason, and the factories' no-device error path is checked.

#include "collectives/nccl_backend.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collectives/communicator.h"
#include "collectives/device_stream.h"
#include "collectives/thread_backend.h"
#include "collectives/timed_communicator.h"
#include "core/dtype.h"
#include "core/half.h"
#include "gtest/gtest.h"
#include "testing/gpu_test_util.h"

namespace gradsum {
namespace {

using Bytes = std::vector<unsigned char>;

// Deterministic host input: small integers (exact in every dtype) with varied signs.
Bytes MakeInput(DType t, size_t n, int salt) {
  Bytes b(n * DTypeSize(t));
  for (size_t i = 0; i < n; ++i) {
    const int v = static_cast<int>((i * 7 + salt * 13) % 23) - 11;
    unsigned char* p = b.data() + i * DTypeSize(t);
    switch (t) {
      case DType::kF32: {
        float x = v;
        std::memcpy(p, &x, 4);
        break;
      }
      case DType::kF64: {
        double x = v;
        std::memcpy(p, &x, 8);
        break;
      }
      case DType::kBF16: {
        uint16_t x = BF16::FromFloat(v).bits;
        std::memcpy(p, &x, 2);
        break;
      }
      case DType::kF16: {
        uint16_t x = F16::FromFloat(v).bits;
        std::memcpy(p, &x, 2);
        break;
      }
      case DType::kI32: {
        int32_t x = v;
        std::memcpy(p, &x, 4);
        break;
      }
      case DType::kI64: {
        int64_t x = v;
        std::memcpy(p, &x, 8);
        break;
      }
    }
  }
  return b;
}

// A device buffer holding a copy of `host`, freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes_ == 0 ? 1 : bytes_), cudaSuccess);
  }
  explicit DeviceBuffer(const Bytes& host) : DeviceBuffer(host.size()) {
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
    // The DMA from pageable memory may still be in flight; NCCL's stream is non-blocking.
    EXPECT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  void* get() const { return ptr_; }
  Bytes ToHost() const {
    Bytes b(bytes_);
    EXPECT_EQ(cudaMemcpy(b.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return b;
  }

 private:
  size_t bytes_;
  void* ptr_ = nullptr;
};

class NcclWorldOneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GRADSUM_SKIP_WITHOUT_GPU();
    absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> threads =
        CreateThreadCommunicators(1);
    ASSERT_TRUE(threads.ok()) << threads.status();
    thread_ = std::move((*threads)[0]);
    // With the agreement check (the default), run over a split of the thread communicator.
    absl::StatusOr<std::unique_ptr<Communicator>> nccl =
        CreateNcclCommunicator(*thread_, {.device = 0, .timeout = absl::Seconds(30)});
    ASSERT_TRUE(nccl.ok()) << nccl.status();
    nccl_ = std::move(*nccl);
    ASSERT_NE(nccl_->device_stream(), nullptr);
  }

  DeviceStream& ds() { return *nccl_->device_stream(); }

  std::unique_ptr<Communicator> thread_;
  std::unique_ptr<Communicator> nccl_;
};

TEST_F(NcclWorldOneTest, Identity) {
  EXPECT_EQ(nccl_->rank(), 0);
  EXPECT_EQ(nccl_->size(), 1);
  EXPECT_EQ(nccl_->backend(), "nccl");
  EXPECT_EQ(ds().device(), 0);
  EXPECT_NE(ds().stream(), nullptr);
}

TEST_F(NcclWorldOneTest, AllReduceMatchesThreadBackend) {
  const size_t n = 1000;
  for (DType t : kAllDTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      if (op == ReduceOp::kAvg && !IsFloating(t)) continue;
      SCOPED_TRACE(absl::StrCat(DTypeName(t), " ", ReduceOpName(op)));
      const Bytes in = MakeInput(t, n, 1);
      Bytes want(in.size());
      ASSERT_TRUE(thread_->AllReduce(in.data(), want.data(), n, t, op).ok());
      DeviceBuffer d(in);
      ASSERT_TRUE(nccl_->AllReduce(d.get(), d.get(), n, t, op).ok());
      EXPECT_EQ(d.ToHost(), want);
    }
  }
}

TEST_F(NcclWorldOneTest, ReduceScatterAllGatherBroadcastAllToAllVMatchThreadBackend) {
  const size_t n = 333;
  for (DType t : kAllDTypes) {
    SCOPED_TRACE(DTypeName(t));
    const Bytes in = MakeInput(t, n, 2);
    Bytes want(in.size());
    DeviceBuffer d_in(in), d_out(in.size());

    ASSERT_TRUE(thread_->ReduceScatter(in.data(), want.data(), n, t, ReduceOp::kSum).ok());
    ASSERT_TRUE(nccl_->ReduceScatter(d_in.get(), d_out.get(), n, t, ReduceOp::kSum).ok());
    EXPECT_EQ(d_out.ToHost(), want);

    ASSERT_TRUE(thread_->AllGather(in.data(), want.data(), n, t).ok());
    ASSERT_TRUE(nccl_->AllGather(d_in.get(), d_out.get(), n, t).ok());
    EXPECT_EQ(d_out.ToHost(), want);

    Bytes host_bcast = in;
    ASSERT_TRUE(thread_->Broadcast(host_bcast.data(), n, t, 0).ok());
    DeviceBuffer d_bcast(in);
    ASSERT_TRUE(nccl_->Broadcast(d_bcast.get(), n, t, 0).ok());
    EXPECT_EQ(d_bcast.ToHost(), host_bcast);

    // A self-exchange of the middle 300 elements into the start of the output.
    const std::vector<size_t> counts = {300}, send_offsets = {20}, recv_offsets = {0};
    Bytes host_out(in.size(), 0);
    ASSERT_TRUE(
        thread_
            ->AllToAllV(in.data(), counts, send_offsets, host_out.data(), counts, recv_offsets, t)
            .ok());
    DeviceBuffer d_a2a(host_out);
    ASSERT_TRUE(
        nccl_->AllToAllV(d_in.get(), counts, send_offsets, d_a2a.get(), counts, recv_offsets, t)
            .ok());
    EXPECT_EQ(d_a2a.ToHost(), host_out);
  }
  EXPECT_TRUE(nccl_->Barrier().ok());
}

TEST_F(NcclWorldOneTest, CoalescedAllReducesCompleteTogether) {
  const Bytes a = MakeInput(DType::kBF16, 4096, 3), b = MakeInput(DType::kBF16, 17, 4);
  Bytes want_a(a.size()), want_b(b.size());
  ASSERT_TRUE(thread_->AllReduce(a.data(), want_a.data(), 4096, DType::kBF16).ok());
  ASSERT_TRUE(thread_->AllReduce(b.data(), want_b.data(), 17, DType::kBF16).ok());
  DeviceBuffer da(a), db(b);
  const DeviceStream::Buffer buffers[] = {{da.get(), da.get(), 4096}, {db.get(), db.get(), 17}};
  absl::StatusOr<std::unique_ptr<Work>> w = ds().AllReduceCoalescedAsync(buffers, DType::kBF16);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Wait(absl::Seconds(30)).ok());
  EXPECT_TRUE((*w)->IsCompleted());
  EXPECT_EQ(da.ToHost(), want_a);
  EXPECT_EQ(db.ToHost(), want_b);
  // A Work from inside an open group cannot be waited on yet.
  ASSERT_TRUE(ds().BeginCoalescing().ok());
  EXPECT_TRUE(ds().coalescing());
  absl::StatusOr<std::unique_ptr<Work>> inner =
      nccl_->AllReduceAsync(da.get(), da.get(), 4096, DType::kBF16, ReduceOp::kSum);
  ASSERT_TRUE(inner.ok());
  EXPECT_EQ((*inner)->Wait(absl::Seconds(1)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ds().BeginCoalescing().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::unique_ptr<Work>> group = ds().EndCoalescing();
  ASSERT_TRUE(group.ok());
  EXPECT_FALSE(ds().coalescing());
  EXPECT_TRUE((*group)->Wait(absl::Seconds(30)).ok());
  EXPECT_TRUE((*inner)->Wait(absl::Seconds(30)).ok());
}

TEST_F(NcclWorldOneTest, SplitAndBadArguments) {
  absl::StatusOr<std::unique_ptr<Communicator>> child = nccl_->Split(0, 0);
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_NE(*child, nullptr);
  EXPECT_EQ((*child)->size(), 1);
  EXPECT_NE((*child)->device_stream(), nullptr);
  absl::StatusOr<std::unique_ptr<Communicator>> none = nccl_->Split(-1, 0);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);

  // Rejected by the agreement check's local validation (the backend's CheckBuffer), which
  // would name this rank to its peers.
  std::vector<float> host(8, 1.0f);
  absl::Status s = nccl_->AllReduce(host.data(), host.data(), 8, DType::kF32);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("host memory"), std::string::npos) << s;
  DeviceBuffer d(8 * sizeof(int32_t));
  s = nccl_->AllReduce(d.get(), d.get(), 8, DType::kI32, ReduceOp::kAvg);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(nccl_->Broadcast(d.get(), 8, DType::kI32, 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(nccl_->Barrier().ok());  // still usable
}

// TimedCommunicator over the nccl backend (its DeviceStream capability): each collective's
// duration on the NCCL stream counts as busy
// time, and the caller's blocked time as exposed time only up to that duration; the time
// the stream was held by earlier work (here a host function on another stream that the
// NCCL stream waits for, as it waits for the compute stream) is neither.
void HoldStream(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

TEST_F(NcclWorldOneTest, TimedCountsTheCollectiveNotTheStreamWaitBeforeIt) {
  auto timer = std::make_shared<CommTimer>();
  auto timed = std::make_unique<TimedCommunicator>(std::move(nccl_), timer);
  EXPECT_EQ(timed->backend(), "nccl");
  ASSERT_NE(timed->device_stream(), nullptr);
  const size_t n = 1 << 20;
  const Bytes in = MakeInput(DType::kF32, n, 3);
  DeviceBuffer d(in);

  // An async all-reduce, waited for: counted once, exposed <= busy, the result unchanged.
  absl::StatusOr<std::unique_ptr<Work>> w =
      timed->AllReduceAsync(d.get(), d.get(), n, DType::kF32, ReduceOp::kSum);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Wait().ok());
  EXPECT_TRUE((*w)->IsCompleted());
  absl::Duration exposed = timer->Take(), busy = timer->TakeBusy();
  EXPECT_GT(busy, absl::ZeroDuration());
  EXPECT_LE(exposed, busy);
  EXPECT_EQ(d.ToHost(), in);

  // The NCCL stream held for 300 ms before a synchronous all-reduce: the caller blocks
  // through the hold, but the counted time is the all-reduce's own (far less).
  cudaStream_t side = nullptr;
  cudaEvent_t held = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&held, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaLaunchHostFunc(side, HoldStream, nullptr), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(held, side), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(timed->device_stream()->stream(), held, 0), cudaSuccess);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(timed->AllReduce(d.get(), d.get(), n, DType::kF32).ok());
  const absl::Duration blocked = absl::Now() - start;
  exposed = timer->Take();
  busy = timer->TakeBusy();
  EXPECT_GE(blocked, absl::Milliseconds(300));
  EXPECT_GT(busy, absl::ZeroDuration());
  EXPECT_LT(busy, blocked / 2) << "the 300 ms hold was counted as communication";
  EXPECT_LE(exposed, busy);
  cudaEventDestroy(held);
  cudaStreamDestroy(side);

  // Split gives a timed child on the same timer (a Mesh over the timed world is timed).
  absl::StatusOr<std::unique_ptr<Communicator>> child = timed->Split(0, 0);
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_NE(*child, nullptr);
  ASSERT_NE((*child)->device_stream(), nullptr);
  ASSERT_TRUE((*child)->AllReduce(d.get(), d.get(), n, DType::kF32).ok());
  EXPECT_GT(timer->TakeBusy(), absl::ZeroDuration());
  timer->Take();

  // A coalesced group counts as one operation when it completes.
  ASSERT_TRUE(timed->device_stream()->BeginCoalescing().ok());
  ASSERT_TRUE(timed->AllReduceAsync(d.get(), d.get(), n / 2, DType::kF32, ReduceOp::kSum).ok());
  absl::StatusOr<std::unique_ptr<Work>> group = timed->device_stream()->EndCoalescing();
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_TRUE((*group)->Wait().ok());
  EXPECT_LE(timer->Take(), timer->TakeBusy());
}

TEST(NcclFileBootstrapTest, WorldOfOne) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const std::string path = absl::StrCat(::testing::TempDir(), "/nccl_id_world_one");
  // No host communicator to check agreement over: the check must be turned off.
  absl::StatusOr<std::unique_ptr<Communicator>> nccl =
      CreateNcclCommunicatorFromFile(path, 0, 1, {.device = 0});
  EXPECT_EQ(nccl.status().code(), absl::StatusCode::kInvalidArgument) << nccl.status();
  nccl = CreateNcclCommunicatorFromFile(path, 0, 1, {.device = 0, .check_agreement = false});
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_NE((*nccl)->device_stream(), nullptr);
  EXPECT_EQ((*nccl)->size(), 1);
  EXPECT_TRUE((*nccl)->Barrier().ok());
}

// Where no GPU can be used, both factories must say so with CUDA's reason, not crash.
TEST(NcclNoDeviceTest, FactoriesReportMissingDevice) {
  std::string why;
  if (::gradsum::testing::CudaDeviceAvailable(&why)) {
    GTEST_SKIP() << "a CUDA device is present; the no-device path is not reachable";
  }
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> threads = CreateThreadCommunicators(1);
  ASSERT_TRUE(threads.ok());
  absl::StatusOr<std::unique_ptr<Communicator>> nccl = CreateNcclCommunicator(*(*threads)[0]);
  EXPECT_EQ(nccl.status().code(), absl::StatusCode::kFailedPrecondition) << nccl.status();
  EXPECT_NE(nccl.status().message().find(why), std::string::npos) << nccl.status();
  const NcclBackendOptions unchecked = {.check_agreement = false};
  nccl = CreateNcclCommunicatorFromFile(::testing::TempDir() + "/unused_id", 0, 1, unchecked);
  EXPECT_EQ(nccl.status().code(), absl::StatusCode::kFailedPrecondition) << nccl.status();
  nccl = CreateNcclCommunicatorFromFile(::testing::TempDir() + "/unused_id", 3, 2, unchecked);
  EXPECT_EQ(nccl.status().code(), absl::StatusCode::kInvalidArgument) << nccl.status();
  // A file bootstrap with the agreement check on is refused before any device work.
  nccl = CreateNcclCommunicatorFromFile(::testing::TempDir() + "/unused_id", 0, 1);
  EXPECT_EQ(nccl.status().code(), absl::StatusCode::kInvalidArgument) << nccl.status();
  EXPECT_NE(nccl.status().message().find("check_agreement"), std::string::npos) << nccl.status();
}

}  // namespace
}  // namespace gradsum
