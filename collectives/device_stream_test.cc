// The decorators over a stream-ordered device backend, without a GPU: a fake device
// backend (the thread backend dressed with a DeviceStream whose clock advances a fixed
// device time per operation, and which refuses buffers marked as host memory), under the
// agreement check run over a separate host communicator and the timer, stacked as the nccl
// rank stacks them (TimedCommunicator over WithAgreementCheckOver). The same paths run on a
// GPU in nccl_backend_test.

#include "collectives/device_stream.h"

#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "collectives/checked_communicator.h"
#include "collectives/communicator.h"
#include "collectives/forwarding_communicator.h"
#include "collectives/timed_communicator.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

// The device time of one operation on the fake stream.
constexpr absl::Duration kOpTime = absl::Milliseconds(5);

// A point of the fake stream's clock.
class FakeMarker final : public StreamMarker {
 public:
  explicit FakeMarker(absl::Duration at) : at_(at) {}
  bool Reached() override { return true; }
  absl::StatusOr<absl::Duration> ElapsedSince(StreamMarker& start) override {
    return at_ - static_cast<FakeMarker&>(start).at_;
  }

 private:
  const absl::Duration at_;
};

class DoneWork final : public Work {
 public:
  absl::Status Wait(absl::Duration) override { return absl::OkStatus(); }
  bool IsCompleted() override { return true; }
};

// The thread backend as a stream-ordered device backend. Every operation advances the
// stream's clock by kOpTime and counts in ops(); inside a coalesced group it runs at issue
// (the thread backend's blocking form) and its Work is complete.
class FakeDeviceComm final : public ForwardingCommunicator, public DeviceStream {
 public:
  explicit FakeDeviceComm(std::unique_ptr<Communicator> inner)
      : ForwardingCommunicator(std::move(inner), SyncCalls::kThroughAsync) {}

  // Buffers CheckBuffer refuses, as the nccl backend refuses host memory.
  void MarkHost(const void* p) { host_.insert(p); }
  int ops() const { return ops_; }

  std::string backend() const override { return "fake_device"; }
  DeviceStream* device_stream() override { return this; }

  // ---- DeviceStream. ----
  CUstream_st* stream() const override { return nullptr; }
  int device() const override { return 0; }
  absl::Status CheckBuffer(const void* p) const override {
    if (host_.count(p) > 0) {
      return absl::InvalidArgumentError("is host memory; the fake device needs device memory");
    }
    return absl::OkStatus();
  }
  absl::Status BeginCoalescing() override {
    if (group_) return absl::FailedPreconditionError("fake: a group is already open");
    group_ = true;
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Work>> EndCoalescing() override {
    if (!group_) return absl::FailedPreconditionError("fake: no open group");
    group_ = false;
    return std::unique_ptr<Work>(new DoneWork());
  }
  bool coalescing() const override { return group_; }
  absl::StatusOr<std::unique_ptr<Work>> AllReduceCoalescedAsync(absl::Span<const Buffer> buffers,
                                                                DType dtype, ReduceOp op) override {
    GRADSUM_RETURN_IF_ERROR(BeginCoalescing());
    for (const Buffer& b : buffers) {
      GRADSUM_RETURN_IF_ERROR(AllReduceAsync(b.send, b.recv, b.count, dtype, op).status());
    }
    return EndCoalescing();
  }
  absl::StatusOr<std::unique_ptr<StreamMarker>> RecordMarker() override {
    return std::unique_ptr<StreamMarker>(new FakeMarker(clock_));
  }

  // ---- Operations. ----
  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    return Enqueue([&] { return inner().AllReduce(send, recv, count, dtype, op); },
                   [&] { return inner().AllReduceAsync(send, recv, count, dtype, op); });
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    return Enqueue([&] { return inner().AllGather(send, recv, send_count, dtype); },
                   [&] { return inner().AllGatherAsync(send, recv, send_count, dtype); });
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, inner().Split(color, key));
    if (sub == nullptr) return sub;
    return std::unique_ptr<Communicator>(new FakeDeviceComm(std::move(sub)));
  }

 private:
  template <typename Sync, typename Async>
  absl::StatusOr<std::unique_ptr<Work>> Enqueue(Sync&& sync, Async&& async) {
    ++ops_;
    clock_ += kOpTime;
    if (!group_) return async();
    GRADSUM_RETURN_IF_ERROR(sync());
    return std::unique_ptr<Work>(new DoneWork());
  }

  std::set<const void*> host_;
  absl::Duration clock_;
  bool group_ = false;
  int ops_ = 0;
};

// Counts every operation issued on the host exchange (blocking ones through the async
// forms), its splits into the same counter.
class CountingCommunicator final : public ForwardingCommunicator {
 public:
  CountingCommunicator(std::unique_ptr<Communicator> inner, std::shared_ptr<int> count)
      : ForwardingCommunicator(std::move(inner), SyncCalls::kThroughAsync),
        count_(std::move(count)) {}
  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    ++*count_;
    return inner().AllReduceAsync(send, recv, count, dtype, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    ++*count_;
    return inner().BroadcastAsync(buf, count, dtype, root);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, inner().Split(color, key));
    if (sub == nullptr) return sub;
    return std::unique_ptr<Communicator>(new CountingCommunicator(std::move(sub), count_));
  }

 private:
  std::shared_ptr<int> count_;
};

// One rank's stack, as AttachNcclView builds it: the timer over the agreement check over the
// fake device, with the exchange over a separate (counted) host communicator.
struct Stack {
  FakeDeviceComm* device = nullptr;  // owned by `comm`
  std::shared_ptr<int> exchanges = std::make_shared<int>(0);
  std::shared_ptr<CommTimer> timer = std::make_shared<CommTimer>();
  std::unique_ptr<TimedCommunicator> comm;
};

absl::StatusOr<Stack> MakeStack(Communicator& world) {
  Stack s;
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> data, world.Split(0, world.rank()));
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> host, world.Split(0, world.rank()));
  auto device = std::make_unique<FakeDeviceComm>(std::move(data));
  s.device = device.get();
  GRADSUM_ASSIGN_OR_RETURN(
      std::unique_ptr<Communicator> checked,
      WithAgreementCheckOver(std::move(device),
                             std::make_unique<CountingCommunicator>(std::move(host), s.exchanges)));
  s.comm = std::make_unique<TimedCommunicator>(std::move(checked), s.timer);
  return s;
}

void ExpectInvalid(const absl::Status& s, const std::vector<std::string>& words) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const std::string& w : words) {
    EXPECT_TRUE(absl::StrContains(s.message(), w)) << "missing \"" << w << "\" in: " << s;
  }
}

TEST(DeviceStreamDecoratorsTest, AgreementRunsOverTheHostExchange) {
  constexpr int kWorld = 3;
  const absl::Status status = testing::RunRanks(kWorld, [&](Communicator& world) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(Stack s, MakeStack(world));
    const int r = world.rank();
    // The capability reaches through both decorators.
    DeviceStream* ds = s.comm->device_stream();
    EXPECT_NE(ds, nullptr);
    if (ds == nullptr) return absl::OkStatus();
    EXPECT_EQ(s.comm->backend(), "fake_device");

    // A valid call: one descriptor exchange on the host, one operation on the device.
    float x[2] = {1.0f + r, 2.0f};
    GRADSUM_RETURN_IF_ERROR(s.comm->AllReduce(x, x, 2, DType::kF32));
    EXPECT_EQ(x[0], 6.0f);
    EXPECT_EQ(x[1], 6.0f);
    EXPECT_EQ(*s.exchanges, 1);
    EXPECT_EQ(s.device->ops(), 1);

    // Rank 2's buffer is host memory: every rank fails, no data moves, nothing hangs.
    float y[2] = {1.0f, 1.0f};
    if (r == 2) s.device->MarkHost(y);
    absl::Status bad = s.comm->AllReduce(y, y, 2, DType::kF32);
    if (r == 2) {
      ExpectInvalid(bad, {"all_reduce send buffer is host memory"});
    } else {
      ExpectInvalid(bad, {"rank 2 passed invalid", "all_reduce send buffer is host memory"});
    }
    EXPECT_EQ(s.device->ops(), 1);

    // Ranks that disagree on the count all fail, naming it.
    ExpectInvalid(s.comm->AllReduce(x, x, r == 0 ? 1 : 2, DType::kF32),
                  {"fake_device all_reduce", "element count"});
    EXPECT_EQ(s.device->ops(), 1);

    // Inside a coalesced group no descriptor is exchanged (a fused launch is checked by
    // nobody); the operations still run.
    const int exchanged = *s.exchanges;
    GRADSUM_RETURN_IF_ERROR(ds->BeginCoalescing());
    float a = 1.0f, b = 2.0f;
    GRADSUM_RETURN_IF_ERROR(
        s.comm->AllReduceAsync(&a, &a, 1, DType::kF32, ReduceOp::kSum).status());
    GRADSUM_RETURN_IF_ERROR(
        s.comm->AllReduceAsync(&b, &b, 1, DType::kF32, ReduceOp::kSum).status());
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Work> group, ds->EndCoalescing());
    GRADSUM_RETURN_IF_ERROR(group->Wait());
    EXPECT_EQ(a, 3.0f);
    EXPECT_EQ(b, 6.0f);
    const DeviceStream::Buffer buffers[] = {{&a, &a, 1}, {&b, &b, 1}};
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Work> fused,
                             ds->AllReduceCoalescedAsync(buffers, DType::kF32));
    GRADSUM_RETURN_IF_ERROR(fused->Wait());
    EXPECT_EQ(a, 9.0f);
    EXPECT_EQ(b, 18.0f);
    EXPECT_EQ(*s.exchanges, exchanged);
    EXPECT_EQ(s.device->ops(), 5);

    // A split is checked over the same split of the exchange, and still has the capability.
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> pair, s.comm->Split(r / 2, r));
    EXPECT_NE(pair->device_stream(), nullptr);
    const int before = *s.exchanges;
    float z = 1.0f;
    GRADSUM_RETURN_IF_ERROR(pair->AllReduce(&z, &z, 1, DType::kF32));
    EXPECT_EQ(z, r < 2 ? 2.0f : 1.0f);
    EXPECT_EQ(*s.exchanges, before + 1);
    return absl::OkStatus();
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(DeviceStreamDecoratorsTest, WithAgreementCheckOverNeedsTheSameRanks) {
  const absl::Status status = testing::RunRanks(2, [&](Communicator& world) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> data, world.Split(0, world.rank()));
    // Reversed ranks in the exchange.
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> host, world.Split(0, -world.rank()));
    absl::StatusOr<std::unique_ptr<Communicator>> checked =
        WithAgreementCheckOver(std::move(data), std::move(host));
    ExpectInvalid(checked.status(), {"rank", "exchange"});
    return absl::OkStatus();
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Rank 1 issues every operation 100 ms after rank 0, so rank 0 is blocked far longer than
// the operation's device time (kOpTime): its busy time is exactly the device time between
// the markers, and its exposed time is capped at it, by kind; a blocking call is timed the
// same way (not as its host duration), a coalesced group as one operation.
TEST(DeviceStreamDecoratorsTest, TimerCountsTheDeviceTimeBetweenMarkers) {
  const absl::Status status = testing::RunRanks(2, [&](Communicator& world) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(Stack s, MakeStack(world));
    const bool late = world.rank() == 1;
    auto maybe_wait = [&] {
      if (late) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    };
    auto part = [](const CommTimer::Exposed& e, CommKind k) {
      return e.by_kind[static_cast<int>(k)];
    };
    float x = 1.0f;
    float gathered[2];

    maybe_wait();
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Work> w,
                             s.comm->AllReduceAsync(&x, &x, 1, DType::kF32, ReduceOp::kSum));
    GRADSUM_RETURN_IF_ERROR(w->Wait());
    EXPECT_TRUE(w->IsCompleted());
    maybe_wait();
    GRADSUM_RETURN_IF_ERROR(s.comm->AllGather(&x, gathered, 1, DType::kF32));
    EXPECT_EQ(gathered[0], 2.0f);
    EXPECT_EQ(gathered[1], 2.0f);
    EXPECT_EQ(s.timer->TakeBusy(), 2 * kOpTime);
    CommTimer::Exposed e = s.timer->TakeByKind();
    if (!late) {
      EXPECT_EQ(part(e, CommKind::kAllReduce), kOpTime);
      EXPECT_EQ(part(e, CommKind::kAllGather), kOpTime);
      EXPECT_EQ(e.total, 2 * kOpTime);
    }

    // A group of two operations: one operation of kind "other", two operations' time.
    DeviceStream* ds = s.comm->device_stream();
    maybe_wait();
    GRADSUM_RETURN_IF_ERROR(ds->BeginCoalescing());
    GRADSUM_RETURN_IF_ERROR(
        s.comm->AllReduceAsync(&x, &x, 1, DType::kF32, ReduceOp::kSum).status());
    GRADSUM_RETURN_IF_ERROR(
        s.comm->AllReduceAsync(&x, &x, 1, DType::kF32, ReduceOp::kSum).status());
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Work> group, ds->EndCoalescing());
    GRADSUM_RETURN_IF_ERROR(group->Wait());
    EXPECT_EQ(x, 8.0f);
    EXPECT_EQ(s.timer->TakeBusy(), 2 * kOpTime);
    e = s.timer->TakeByKind();
    if (!late) {
      EXPECT_EQ(part(e, CommKind::kOther), 2 * kOpTime);
    }

    // The fused all-reduce counts as an all-reduce.
    const DeviceStream::Buffer buffers[] = {{&x, &x, 1}};
    maybe_wait();
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Work> fused,
                             ds->AllReduceCoalescedAsync(buffers, DType::kF32));
    GRADSUM_RETURN_IF_ERROR(fused->Wait());
    EXPECT_EQ(s.timer->TakeBusy(), kOpTime);
    e = s.timer->TakeByKind();
    if (!late) {
      EXPECT_EQ(part(e, CommKind::kAllReduce), kOpTime);
    }

    // A split is timed on the device stream into the same timer.
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> child, s.comm->Split(0, 0));
    EXPECT_NE(child->device_stream(), nullptr);
    s.timer->Take();  // the split's own (host) time
    GRADSUM_RETURN_IF_ERROR(child->AllReduce(&x, &x, 1, DType::kF32));
    EXPECT_EQ(s.timer->TakeBusy(), kOpTime);
    return absl::OkStatus();
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace gradsum
