#ifndef GRADSUM_COLLECTIVES_TIMED_COMMUNICATOR_H_
#define GRADSUM_COLLECTIVES_TIMED_COMMUNICATOR_H_

// A Communicator decorator that measures this rank's communication, for the per-step
// comm columns of the training log and the step benchmark. Sub-communicators made by
// Split() share the timer, so the EP and EDP groups count too. Two numbers:
// - exposed: the wall time the rank's thread spent inside collective calls (issuing them,
//   running a synchronous one, waiting on an async one): time compute was blocked.
// - busy: the summed duration of the collectives, each from its issue to its completion.
//   A synchronous one counts its call; an async one counts from its issue to the
//   completion time its backend stamped (Work::CompletionTime; the thread and mpi backends
//   stamp), read whenever the completion is first seen: its Wait returning, an
//   IsCompleted, any issue or wait through the same timer, or TakeBusy (which checks every
//   collective in flight). So an overlapped collective that nobody waits on is timed
//   exactly, without a polling thread. (The watcher thread that polled every 100 us cost
//   ~600 wake-ups per 60 ms training step per rank, preempting compute on small machines.)
//   For a backend that does not stamp, the moment the completion was seen counts.
//
//   auto timer = std::make_shared<CommTimer>();
//   TimedCommunicator world(std::move(inner_world), timer);
//   ... train ...
//   absl::Duration blocked = timer->Take();        // exposed, and reset
//   CommTimer::Exposed e = timer->TakeByKind();    // the same, split by CommKind
//   absl::Duration busy = timer->TakeBusy();       // summed durations, and reset
//
// Both include waiting for slower ranks inside a collective: on shared memory, moving the
// bytes and waiting for the peers cannot be told apart from one side. The exposed time is
// also kept by the kind of collective that blocked (CommKind), so that a step's record can
// say which collectives compute waited for.
//
// Over a stream-ordered device backend (inner->device_stream() non-null: nccl) the same
// decorator times each operation on the device stream instead, through the capability's
// markers (collectives/device_stream.h; CUDA events on the NCCL stream), so that the
// device's collectives count in the same timer as the host's:
// - busy: each operation's duration on the stream, from a marker recorded before it to
//   one recorded after it (a host agreement exchange between the two included). Time the
//   stream spent waiting for earlier work (a fence on the compute stream, the previous
//   operation) is not in it.
// - exposed: the host time the caller spent in the issuing call and in Wait, capped at
//   that duration: the part of the block during which the collective itself ran (the rest
//   is the GPU finishing compute queued before the fence). The host runs ahead of the GPU
//   only between the model's syncs, so a wait on a collective while compute was still
//   queued may still count. It is attributed to the operation's CommKind; a
//   BeginCoalescing .. EndCoalescing group to kOther, AllReduceCoalescedAsync to
//   kAllReduce.
//   Counted once, when the operation is first waited for successfully, found complete by
//   IsCompleted(), or dropped complete; one dropped unfinished is not counted. A
//   coalesced group counts as one operation (begin and end it through this decorator's
//   device_stream()); the Works of the operations inside it are not timed. Blocking calls
//   are the async form and a Wait.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/forwarding_communicator.h"

namespace gradsum {

// The kinds of collective a rank's exposed time is attributed to. kSpAllToAll: the
// all-to-alls of a sequence-parallel group (SEMANTICS.md §12; a communicator split with
// SplitAs counts its all-to-alls so); kCpRing: the key/value exchanges of a
// context-parallel group's ring (§16; the same way). kOther: broadcasts, barriers, Split, and an
// nccl coalesced group as a whole.
enum class CommKind : int {
  kAllGather = 0,
  kReduceScatter,
  kAllReduce,
  kAllToAll,
  kSpAllToAll,
  kCpRing,
  kOther
};
inline constexpr int kNumCommKinds = 7;
// "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "sp_all_to_all", "cp_ring",
// "other".
const char* CommKindName(CommKind kind);

class CommTimer {
 public:
  // Exposed (blocked) time, attributed to the kind of collective that blocked.
  void Add(absl::Duration d, CommKind kind) {
    nanos_[static_cast<int>(kind)].fetch_add(absl::ToInt64Nanoseconds(d));
  }
  // One collective of `kind` issued.
  void CountCall(CommKind kind) { calls_[static_cast<int>(kind)].fetch_add(1); }
  absl::Duration Total() const;
  // The exposed time since the last take, in total and by kind (indexed by CommKind; the
  // kinds sum to the total exactly), and resets it to zero.
  struct Exposed {
    absl::Duration total;
    absl::Duration by_kind[kNumCommKinds];
    // Collectives issued since the last take, by kind (a Split counts as kOther; the
    // operations of a coalesced group count one each).
    int64_t calls[kNumCommKinds] = {};
  };
  Exposed TakeByKind();
  // TakeByKind().total.
  absl::Duration Take() { return TakeByKind().total; }

  // Busy time: summed collective durations.
  void AddBusy(absl::Duration d) { busy_nanos_.fetch_add(absl::ToInt64Nanoseconds(d)); }
  // Stamps the completion of every tracked async collective found complete, then returns
  // the busy total and resets it (collectives still in flight count in a later Take).
  absl::Duration TakeBusy() {
    Poll();
    return absl::Nanoseconds(busy_nanos_.exchange(0));
  }

  // An async collective in flight, tracked until its completion is seen.
  struct InFlight {
    Work* work = nullptr;  // owned by the TimedWork that tracks it
    absl::Time issued;
    bool done = false;
  };
  void Track(std::shared_ptr<InFlight> op);
  // Marks `op` complete (if it was not), adding its duration to busy: up to its stamped
  // completion time, or up to now if it has none (still in flight, or not stamped).
  void Complete(InFlight& op);
  // Checks every tracked collective for completion.
  void Poll();

  CommTimer() = default;
  CommTimer(const CommTimer&) = delete;
  CommTimer& operator=(const CommTimer&) = delete;

 private:
  void CompleteLocked(InFlight& op, absl::Time now);

  std::atomic<int64_t> nanos_[kNumCommKinds] = {};  // exposed, by CommKind
  std::atomic<int64_t> calls_[kNumCommKinds] = {};  // issued, by CommKind
  std::atomic<int64_t> busy_nanos_{0};
  std::mutex mu_;
  std::vector<std::shared_ptr<InFlight>> in_flight_;  // guarded by mu_
};

class TimedCommunicator : public ForwardingCommunicator {
 public:
  // Owns `inner`. `timer` must not be null.
  TimedCommunicator(std::unique_ptr<Communicator> inner, std::shared_ptr<CommTimer> timer);
  // Does not own `inner`, which must outlive this object.
  TimedCommunicator(Communicator* inner, std::shared_ptr<CommTimer> timer);
  ~TimedCommunicator() override;

  const std::shared_ptr<CommTimer>& timer() const { return timer_; }
  // Over a device backend: this decorator's view of the inner capability (a coalesced group
  // begun and ended through it is timed as one operation); null over a host backend.
  DeviceStream* device_stream() override;

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override;
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override;
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override;
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override;
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override;
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override;
  // Timed as the group's all-to-all kind; only the send counts as a call (see the .cc).
  absl::StatusOr<std::unique_ptr<Work>> SendAsync(const void* buf, size_t count, DType dtype,
                                                  int peer, int tag = 0) override;
  absl::StatusOr<std::unique_ptr<Work>> RecvAsync(void* buf, size_t count, DType dtype, int peer,
                                                  int tag = 0) override;
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override;
  // Split, with the sub-communicator's all-to-alls counted as `all_to_all_kind` (e.g. the
  // sequence-parallel group's as kSpAllToAll). Its own splits keep that kind.
  absl::StatusOr<std::unique_ptr<Communicator>> SplitAs(int color, int key,
                                                        CommKind all_to_all_kind);

  // Synchronous forms forwarded as such over a host backend, so the inner backend's sync
  // fast path (no allocation, no hand-off) is kept; each counts its call as both exposed
  // and busy time, as a sync call through the async form would. Over a device backend:
  // the async form and a Wait, timed on the stream.
  // (Defaults repeated: a default argument belongs to the declaration it is called through.)
  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp op = ReduceOp::kSum) override;
  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                             ReduceOp op = ReduceOp::kSum) override;
  absl::Status AllGather(const void* send, void* recv, size_t send_count, DType dtype) override;
  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_counts,
                         absl::Span<const size_t> send_offsets, void* recv,
                         absl::Span<const size_t> recv_counts,
                         absl::Span<const size_t> recv_offsets, DType dtype) override;
  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root) override;
  absl::Status Barrier() override;
  using Communicator::AllGather;
  using Communicator::AllGatherAsync;
  using Communicator::AllReduce;
  using Communicator::AllReduceAsync;
  using Communicator::AllToAllV;
  using Communicator::AllToAllVAsync;
  using Communicator::Barrier;
  using Communicator::BarrierAsync;
  using Communicator::Broadcast;
  using Communicator::BroadcastAsync;
  using Communicator::ReduceScatter;
  using Communicator::ReduceScatterAsync;

 private:
  class TimedStream;  // the device-backend path (timed_communicator.cc)

  // Times an async operation issued by `issue`: on the stream over a device backend.
  template <typename F>
  absl::StatusOr<std::unique_ptr<Work>> Timed(CommKind kind, F&& issue, bool count_call = true);
  template <typename F>
  absl::Status TimeSync(CommKind kind, F&& call);
  absl::StatusOr<std::unique_ptr<Work>> Wrap(CommKind kind, absl::Time start,
                                             absl::StatusOr<std::unique_ptr<Work>> work);

  std::shared_ptr<CommTimer> timer_;
  CommKind all_to_all_kind_ = CommKind::kAllToAll;
  std::unique_ptr<TimedStream> stream_;  // non-null over a device backend
};

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_TIMED_COMMUNICATOR_H_
