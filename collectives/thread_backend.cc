// The thread backend (see thread_backend.h).
//
// Structure:
// - A `Group` is the state the W ranks of one communicator share: one rendezvous (every
//   rank's posted arguments, an arrival counter, a finish counter, the chunk counters of
//   the data phase) reused by every operation, and the failure once the group is broken.
// - One operation = arrive (post a pointer to my arguments, bump `arrived`, wait until all
//   W have arrived or the deadline) -> every rank checks the same arguments the same way
//   (so all fail alike on a mismatch) -> data phase (each rank reads its peers' buffers
//   directly, shared memory) -> end barrier (bump `finished`; nobody returns while a peer
//   may still touch its buffers or read its posted arguments).
// - The counters are monotonic: operation u of the group completes its arrival when
//   `arrived` reaches (u + 1) * W, and its end barrier when `finished` does. No rank can
//   arrive at operation u + 1 before every rank has left operation u's data phase, so one
//   rendezvous suffices and nothing is reset between operations.
// - Waiting spins briefly (only when there are at least as many cores as ranks), then
//   blocks on a futex, so 8 ranks on 2 cores do not burn CPU.
// - Synchronous calls run on the caller's thread with no allocation and no formatting
//   (unless they fail). Asynchronous calls are queued per communicator and run in issue
//   order by a worker thread, or by the caller's thread when it waits on one nobody has
//   started (the queue, the worker and the claims: collectives/progress_queue.h, shared
//   with the mpi backend). A synchronous call issued while async ones are pending takes the queue
//   too. A small async call (<= 64 KiB) whose peers are all already waiting in it, with nothing of
//   its rank queued, runs during the issue call and returns a completed handle.
//
// Synchronisation uses std atomics, std::mutex and raw futexes, not absl::Mutex: the system
// abseil is not built with ThreadSanitizer, which then cannot see absl::Mutex's ordering
// and reports false races. Every value that crosses threads is published through a std
// atomic (release/acquire), which TSan sees; the futex only puts waiters to sleep.

#include "collectives/thread_backend.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/op_descriptor.h"
#include "collectives/progress_queue.h"
#include "collectives/reduce_kernels.h"

namespace gradsum {
namespace {

using Clock = std::chrono::steady_clock;
using collectives_internal::HasCount;
using collectives_internal::HasDType;
using collectives_internal::HasReduceOp;
using collectives_internal::MakeAllToAllVCall;
using collectives_internal::MakeBroadcastCall;
using collectives_internal::MakeCall;
using collectives_internal::OpCall;
using collectives_internal::OpKind;
using collectives_internal::OpKindName;
using collectives_internal::PointToPointLabel;
using collectives_internal::ProgressQueue;

// A status that shares no heap state with `s`. absl::Status copies share a refcounted
// message; the system abseil is not TSan-instrumented, so TSan cannot see that refcount's
// atomics and reports a race when copies die on different threads. Statuses that cross
// threads here are therefore always fresh copies.
absl::Status Fresh(const absl::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(s.code(), std::string(s.message()));
}

// ---- Waiting: bounded spinning, then a futex. ----

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Something waiters can sleep on: Notify() after changing any state they test.
class Event {
 public:
  void Notify() {
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&epoch_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
              nullptr, 0);
    }
  }

  // Waits until done() (which reads atomics with acquire) or `deadline`; returns done().
  // Spins up to `spin` first, then sleeps. *slept (if given) is how long the wait lasted
  // when it had to sleep, zero when it was done without sleeping.
  template <typename Done>
  bool Wait(const Done& done, Clock::time_point deadline, Clock::duration spin,
            Clock::duration* slept = nullptr) {
    if (slept != nullptr) *slept = Clock::duration::zero();
    if (done()) return true;
    const Clock::time_point start = Clock::now();
    if (spin > Clock::duration::zero()) {
      const Clock::time_point spin_end = start + spin;
      for (int i = 1;; ++i) {
        CpuRelax();
        if (done()) return true;
        if (i % 64 == 0 && Clock::now() >= spin_end) break;
      }
    }
    struct Stamp {  // records the wait's length however the loop below returns
      Clock::duration* slept;
      Clock::time_point start;
      ~Stamp() {
        if (slept != nullptr) *slept = std::max(Clock::now() - start, Clock::duration(1));
      }
    } stamp{slept, start};
    for (;;) {
      const uint32_t seen = epoch_.load(std::memory_order_seq_cst);
      if (done()) return true;
      timespec rel;
      timespec* timeout = nullptr;
      if (deadline != Clock::time_point::max()) {
        const Clock::time_point now = Clock::now();
        if (now >= deadline) return done();
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now);
        rel.tv_sec = static_cast<time_t>(ns.count() / 1000000000);
        rel.tv_nsec = static_cast<long>(ns.count() % 1000000000);
        timeout = &rel;
      }
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (!done()) {
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&epoch_), FUTEX_WAIT_PRIVATE, seen, timeout,
                nullptr, 0);
      }
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

 private:
  std::atomic<uint32_t> epoch_{0};
  std::atomic<int> sleepers_{0};
};

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word");

// The most a waiter spins before sleeping: spinning pays only when every rank can run at
// once; with more ranks than cores the peer we wait for needs our core. Each rank adapts
// its budget below this (AdaptSpin), so a loaded machine stops spinning.
Clock::duration SpinFor(int world) {
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores == 0 || static_cast<unsigned>(world) > cores) return Clock::duration::zero();
  return std::chrono::microseconds(50);
}

// ---- Arguments and the shared rendezvous. ----

// What one rank passes to an operation; peers read it through Group::posted.
struct OpArgs {
  OpCall call;
  int color = 0;  // split only
  int key = 0;
  // Non-null when this rank's own arguments were invalid: the caller got the error at
  // issue time, and the peers fail with InvalidArgument instead of waiting for a timeout.
  const std::string* local_error = nullptr;
};

// One posted point-to-point operation (SendAsync / RecvAsync), shared by its channel and
// its Work handle.
struct P2POp {
  bool send = false;
  int src = 0, dst = 0, tag = 0;  // the pair and tag it matches on
  const void* send_buf = nullptr;
  void* recv_buf = nullptr;
  size_t count = 0;
  DType dtype = DType::kF32;
  std::string local_error;  // non-empty: this side's arguments were invalid
  Clock::time_point deadline;
  std::atomic<bool> done{false};
  absl::Status status;      // written before done
  absl::Time completed_at;  // written before done

  int owner() const { return send ? src : dst; }
  int peer() const { return send ? dst : src; }
  std::string Label() const { return PointToPointLabel(send, peer(), tag); }
};

struct P2PChannel {
  std::deque<std::shared_ptr<P2POp>> sends, recvs;
};

struct Group;

struct alignas(64) Posted {
  const OpArgs* args = nullptr;  // published by the `arrived` increment
  std::atomic<uint32_t> op{0};   // index + 1 of the last operation this rank arrived at
};

struct Group {
  Group(int size_in, absl::Duration timeout_in)
      : size(size_in), timeout(timeout_in), spin(SpinFor(size_in)), posted(size_in) {}
  const int size;
  const absl::Duration timeout;
  const Clock::duration spin;
  std::vector<Posted> posted;
  Event event;  // notified on every arrival completion, finish completion, and breakage
  alignas(64) std::atomic<uint32_t> arrived{0};
  alignas(64) std::atomic<uint32_t> finished{0};
  // Work chunks of the data phase claimed so far; operation u uses next_chunk[u % 2], which
  // the last rank to finish operation u resets for operation u + 2.
  alignas(64) std::atomic<size_t> next_chunk[2] = {{0}, {0}};
  alignas(64) std::atomic<bool> broken{false};

  std::mutex mu;
  absl::StatusCode failure_code = absl::StatusCode::kOk;  // guarded by mu
  std::string failure;                                    // guarded by mu; set once, when broken
  // Split only: the new groups by color, made by the first member to need them; the last
  // member to take its group clears the map.
  std::map<int, std::shared_ptr<Group>> split_groups;  // guarded by mu
  int split_taken = 0;                                 // guarded by mu

  // Point-to-point: the posted, unmatched sends and receives of each (source, destination,
  // tag), in issue order; whoever posts the second half of a pair moves the data. Waiters
  // sleep on p2p_event (notified on every completion and when the group breaks).
  std::mutex p2p_mu;
  std::map<std::tuple<int, int, int>, P2PChannel> channels;  // guarded by p2p_mu
  Event p2p_event;

  void Break(absl::StatusCode code, absl::string_view why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (failure_code == absl::StatusCode::kOk) {
        failure_code = code;
        failure = std::string(why);
      }
    }
    broken.store(true, std::memory_order_release);
    event.Notify();
    p2p_event.Notify();
  }
  absl::Status Failure() {
    std::lock_guard<std::mutex> lock(mu);
    return absl::Status(failure_code, failure);
  }
};

class ThreadCommunicator;

// One issued asynchronous operation, shared by the queue and its Work handle. Owns what
// the caller's spans pointed to.
struct OpState final : ProgressQueue::Task {
  OpArgs args;
  std::vector<size_t> send_counts, send_offsets, recv_counts, recv_offsets;
  std::string local_error;
  std::atomic<bool> done{false};
  Event event;
  absl::Status status;                         // written before done
  absl::Time completed_at;                     // written before done
  std::unique_ptr<Communicator> split_result;  // Split only; read after done
  // Runs it (the queue runs tasks only while their communicator lives: ~ThreadCommunicator
  // stops the queue first).
  ThreadCommunicator* runner = nullptr;
  absl::Status result;  // Run's, for Finish

  void Run() override;  // after ThreadCommunicator
  void Finish() override { Complete(std::move(result)); }

  void Complete(absl::Status s) {
    status = std::move(s);
    completed_at = absl::Now();
    done.store(true, std::memory_order_release);
    event.Notify();
  }
};

class ThreadWork : public Work {
 public:
  // `queue` runs the operation; `timeout` is its group's.
  ThreadWork(std::shared_ptr<OpState> op, std::shared_ptr<ProgressQueue> queue,
             absl::Duration timeout)
      : op_(std::move(op)), queue_(std::move(queue)), timeout_(timeout) {}

  absl::Status Wait(absl::Duration timeout) override;

  bool IsCompleted() override { return op_->done.load(std::memory_order_acquire); }
  absl::Time CompletionTime() override {
    return IsCompleted() ? op_->completed_at : absl::InfiniteFuture();
  }

 private:
  std::shared_ptr<OpState> op_;
  std::shared_ptr<ProgressQueue> queue_;
  const absl::Duration timeout_;
};

// The larger of the bytes one rank's call reads and writes in its buffers (its own
// share, not the whole group's).
size_t PayloadBytes(const OpCall& c, int w) {
  if (!HasDType(c.kind)) return 0;
  const size_t elem = DTypeSize(c.dtype);
  switch (c.kind) {
    case OpKind::kReduceScatter:
    case OpKind::kAllGather:
      return c.count * static_cast<size_t>(w) * elem;
    case OpKind::kAllToAllV: {
      size_t sent = 0, received = 0;
      for (size_t n : c.send_counts) sent += n;
      for (size_t n : c.recv_counts) received += n;
      return std::max(sent, received) * elem;
    }
    default:
      return c.count * elem;
  }
}

// Operations up to this size run on the issuing thread when its peers are already waiting
// in them (ThreadCommunicator::Issue). Larger ones go to the worker even then: their data
// phase is long enough that running it beside the caller's compute, on a core a waiting
// peer leaves free, pays for the hand-off.
constexpr size_t kIssueInlineBytes = size_t{64} << 10;

// An operation that completed during its issue call (ThreadCommunicator::Issue).
class DoneWork : public Work {
 public:
  DoneWork(absl::Status status, absl::Time completed_at)
      : status_(std::move(status)), completed_at_(completed_at) {}
  absl::Status Wait(absl::Duration /*timeout*/) override { return Fresh(status_); }
  bool IsCompleted() override { return true; }
  absl::Time CompletionTime() override { return completed_at_; }

 private:
  const absl::Status status_;
  const absl::Time completed_at_;
};

// ---- Point-to-point. ----

void CompleteP2P(P2POp& op, absl::Status s) {
  op.status = std::move(s);
  op.completed_at = absl::Now();
  op.done.store(true, std::memory_order_release);
}

// A matched send and receive: moves the data, or fails both sides alike (each message
// naming its peer). Runs on the thread that posted the second half, outside p2p_mu.
void RunMatched(Group& g, P2POp& send, P2POp& recv) {
  absl::Status send_status, recv_status;
  if (!send.local_error.empty() || !recv.local_error.empty()) {
    const bool sender_bad = !send.local_error.empty();
    const P2POp& bad = sender_bad ? send : recv;
    const std::string why = absl::StrCat("rank ", bad.owner(), " passed invalid arguments to its ",
                                         bad.Label(), ": ", bad.local_error);
    send_status = absl::InvalidArgumentError(absl::StrCat(send.Label(), ": ", why));
    recv_status = absl::InvalidArgumentError(absl::StrCat(recv.Label(), ": ", why));
  } else if (send.count != recv.count || send.dtype != recv.dtype) {
    const std::string sends = absl::StrCat(send.count, " ", DTypeName(send.dtype));
    const std::string expects = absl::StrCat(recv.count, " ", DTypeName(recv.dtype));
    send_status = absl::InvalidArgumentError(
        absl::StrCat(send.Label(), ": size mismatch: rank ", send.dst, " expects ", expects,
                     " elements, this rank (", send.src, ") sends ", sends));
    recv_status = absl::InvalidArgumentError(
        absl::StrCat(recv.Label(), ": size mismatch: rank ", recv.src, " sends ", sends,
                     " elements, this rank (", recv.dst, ") expects ", expects));
  } else if (send.count > 0) {
    std::memcpy(recv.recv_buf, send.send_buf, send.count * DTypeSize(send.dtype));
  }
  CompleteP2P(send, std::move(send_status));
  CompleteP2P(recv, std::move(recv_status));
  g.p2p_event.Notify();
}

class P2PWork : public Work {
 public:
  P2PWork(std::shared_ptr<Group> group, std::shared_ptr<P2POp> op)
      : group_(std::move(group)), op_(std::move(op)) {}

  absl::Status Wait(absl::Duration timeout) override {
    Group& g = *group_;
    P2POp& op = *op_;
    const Clock::time_point wait_end =
        timeout == absl::InfiniteDuration()
            ? Clock::time_point::max()
            : Clock::now() + absl::ToChronoNanoseconds(std::max(timeout, absl::ZeroDuration()));
    const auto done = [&] { return op.done.load(std::memory_order_acquire); };
    g.p2p_event.Wait([&] { return done() || g.broken.load(std::memory_order_acquire); },
                     std::min(wait_end, op.deadline), Clock::duration::zero());
    if (done()) return Fresh(op.status);
    const bool broken = g.broken.load(std::memory_order_acquire);
    if (!broken && Clock::now() < op.deadline) {
      return absl::DeadlineExceededError(absl::StrCat(op.Label(), " still in flight after waiting ",
                                                      absl::FormatDuration(timeout)));
    }
    // The peer never posted its half (or the group broke): withdraw the operation, unless
    // the peer matched it meanwhile (then its copy finishes without waiting on anyone).
    if (!Withdraw(g, op_)) {
      g.p2p_event.Wait(done, Clock::time_point::max(), Clock::duration::zero());
      return Fresh(op.status);
    }
    absl::Status s;
    if (broken) {
      s = absl::FailedPreconditionError(
          absl::StrCat(op.Label(), ": the thread communicator is unusable after an earlier ",
                       "failure: ", g.Failure().message()));
    } else {
      s = absl::DeadlineExceededError(absl::StrCat(
          op.Label(), " (rank ", op.owner(), " of ", g.size, "): rank ", op.peer(),
          " did not post the matching ", op.send ? "recv" : "send", " within the timeout of ",
          absl::FormatDuration(g.timeout), " (stopped, hung or gone)"));
      g.Break(s.code(), s.message());
    }
    CompleteP2P(op, Fresh(s));
    g.p2p_event.Notify();
    return s;
  }

  bool IsCompleted() override { return op_->done.load(std::memory_order_acquire); }
  absl::Time CompletionTime() override {
    return IsCompleted() ? op_->completed_at : absl::InfiniteFuture();
  }

  // Takes `op` off its channel if it is still unmatched there; false if it was matched.
  static bool Withdraw(Group& g, const std::shared_ptr<P2POp>& op) {
    std::lock_guard<std::mutex> lock(g.p2p_mu);
    auto it = g.channels.find({op->src, op->dst, op->tag});
    if (it == g.channels.end()) return false;
    auto& queue = op->send ? it->second.sends : it->second.recvs;
    auto pos = std::find(queue.begin(), queue.end(), op);
    if (pos == queue.end()) return false;
    queue.erase(pos);
    if (it->second.sends.empty() && it->second.recvs.empty()) g.channels.erase(it);
    return true;
  }

 private:
  const std::shared_ptr<Group> group_;
  const std::shared_ptr<P2POp> op_;
};

const char* Ptr(const void* p, size_t off_bytes) { return static_cast<const char*>(p) + off_bytes; }
char* Ptr(void* p, size_t off_bytes) { return static_cast<char*>(p) + off_bytes; }

// Elements per work chunk of a reduction over n elements on w ranks: about n / w for
// small buffers (so every rank gets a share), at most 256 KiB for large ones (so ranks can
// balance), always a multiple of 64 bytes (no two claimers share a cache line). 0 if n == 0.
size_t ChunkElems(size_t n, size_t elem, int w) {
  if (n == 0) return 0;
  const size_t unit = std::max<size_t>(1, 64 / elem);
  const size_t per_rank = (n + static_cast<size_t>(w) - 1) / static_cast<size_t>(w);
  const size_t cap = (size_t{256} << 10) / elem;
  const size_t c = std::min(per_rank, cap);
  return (c + unit - 1) / unit * unit;
}

OpArgs ToArgs(OpCall call) {
  OpArgs a;
  a.call = call;
  return a;
}

class ThreadCommunicator : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<Group> group, int rank)
      : group_(std::move(group)),
        rank_(rank),
        spin_(group_->spin),
        srcs_(group_->size),
        dsts_(group_->size),
        queue_(ProgressQueue::Start()) {}

  ~ThreadCommunicator() override {
    const bool busy = queue_->BeginStop();
    // The same for a send or receive of ours that no peer has matched yet: its peer
    // would otherwise wait for it until the timeout.
    const bool abandoning = AbandonP2P() || busy;
    // If an operation of ours is still waiting for peers, break the group so that it (and
    // the peers, who can no longer complete with us) return instead of hanging.
    if (abandoning) {
      group_->Break(absl::StatusCode::kFailedPrecondition,
                    absl::StrCat("rank ", rank_, "'s thread communicator was destroyed with an ",
                                 "operation in flight"));
    }
    // The worker runs what is queued (failing fast on the broken group); a caller running
    // an operation inline finishes it before we go away.
    queue_->FinishStop();
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  std::string backend() const override { return "thread"; }
  absl::Duration timeout() const override { return group_->timeout; }

  // ---- Async forms: queued. ----

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    return Issue(ToArgs(MakeCall(OpKind::kAllReduce, send, recv, count, dtype, op)));
  }

  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    return Issue(ToArgs(MakeCall(OpKind::kReduceScatter, send, recv, recv_count, dtype, op)));
  }

  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    return Issue(ToArgs(MakeCall(OpKind::kAllGather, send, recv, send_count, dtype)));
  }

  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override {
    return Issue(ToArgs(MakeAllToAllVCall(send, send_counts, send_offsets, recv, recv_counts,
                                          recv_offsets, dtype)));
  }

  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    return Issue(ToArgs(MakeBroadcastCall(buf, count, dtype, root)));
  }

  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
    return Issue(ToArgs(MakeCall(OpKind::kBarrier, nullptr, nullptr, 0, DType::kF32)));
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    OpArgs a = ToArgs(MakeCall(OpKind::kSplit, nullptr, nullptr, 0, DType::kF32));
    a.color = color;
    a.key = key;
    auto op = std::make_shared<OpState>();
    op->args = a;
    op->runner = this;
    queue_->Push(op);
    ThreadWork work(op, queue_, group_->timeout);
    absl::Status s = work.Wait(OperationWaitLimit());
    if (!s.ok()) return s;
    return std::move(op->split_result);
  }

  // ---- Point-to-point: posted at issue on the pair's channel (see Group). ----

  absl::StatusOr<std::unique_ptr<Work>> SendAsync(const void* buf, size_t count, DType dtype,
                                                  int peer, int tag) override {
    return PostP2P(/*send=*/true, buf, nullptr, count, dtype, peer, tag);
  }
  absl::StatusOr<std::unique_ptr<Work>> RecvAsync(void* buf, size_t count, DType dtype, int peer,
                                                  int tag) override {
    return PostP2P(/*send=*/false, nullptr, buf, count, dtype, peer, tag);
  }

  // ---- Sync forms: on the caller's thread, no allocation. ----

  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp op) override {
    return RunSync(ToArgs(MakeCall(OpKind::kAllReduce, send, recv, count, dtype, op)));
  }
  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                             ReduceOp op) override {
    return RunSync(ToArgs(MakeCall(OpKind::kReduceScatter, send, recv, recv_count, dtype, op)));
  }
  absl::Status AllGather(const void* send, void* recv, size_t send_count, DType dtype) override {
    return RunSync(ToArgs(MakeCall(OpKind::kAllGather, send, recv, send_count, dtype)));
  }
  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_counts,
                         absl::Span<const size_t> send_offsets, void* recv,
                         absl::Span<const size_t> recv_counts,
                         absl::Span<const size_t> recv_offsets, DType dtype) override {
    return RunSync(ToArgs(MakeAllToAllVCall(send, send_counts, send_offsets, recv, recv_counts,
                                            recv_offsets, dtype)));
  }
  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root) override {
    return RunSync(ToArgs(MakeBroadcastCall(buf, count, dtype, root)));
  }
  absl::Status Barrier() override {
    return RunSync(ToArgs(MakeCall(OpKind::kBarrier, nullptr, nullptr, 0, DType::kF32)));
  }

  // Runs a queued operation (ProgressQueue::Task::Run, under the queue's claim).
  absl::Status RunQueued(OpState& op) { return Execute(op.args, &op.split_result); }

 private:
  absl::Status CheckLocal(const OpArgs& a) const {
    return collectives_internal::ValidateCall(a.call, rank_, size());
  }

  absl::StatusOr<std::unique_ptr<Work>> PostP2P(bool send, const void* send_buf, void* recv_buf,
                                                size_t count, DType dtype, int peer, int tag) {
    Group& g = *group_;
    absl::Status local = collectives_internal::ValidatePointToPoint(
        send, send ? send_buf : recv_buf, count, dtype, peer, tag, g.size);
    // A call invalid in its count, dtype or buffer is still posted (when its peer and tag
    // name a channel), so that the peer fails at once instead of waiting for the timeout.
    if (!local.ok() && (peer < 0 || peer >= g.size || tag < 0 || tag > kMaxTag)) return local;
    auto op = std::make_shared<P2POp>();
    op->send = send;
    op->src = send ? rank_ : peer;
    op->dst = send ? peer : rank_;
    op->tag = tag;
    op->send_buf = send_buf;
    op->recv_buf = recv_buf;
    op->count = count;
    op->dtype = dtype;
    if (!local.ok()) op->local_error = std::string(local.message());
    op->deadline = g.timeout == absl::InfiniteDuration()
                       ? Clock::time_point::max()
                       : Clock::now() + absl::ToChronoNanoseconds(g.timeout);
    std::shared_ptr<P2POp> match;
    {
      std::lock_guard<std::mutex> lock(g.p2p_mu);
      if (g.broken.load(std::memory_order_acquire)) {
        return absl::FailedPreconditionError(
            absl::StrCat(op->Label(), ": the thread communicator is unusable after an earlier ",
                         "failure: ", g.Failure().message()));
      }
      P2PChannel& ch = g.channels[{op->src, op->dst, tag}];
      auto& theirs = send ? ch.recvs : ch.sends;
      if (theirs.empty()) {
        (send ? ch.sends : ch.recvs).push_back(op);
      } else {
        match = std::move(theirs.front());
        theirs.pop_front();
        if (ch.sends.empty() && ch.recvs.empty()) g.channels.erase({op->src, op->dst, tag});
      }
    }
    if (match != nullptr) {
      if (send) {
        RunMatched(g, *op, *match);
      } else {
        RunMatched(g, *match, *op);
      }
    }
    if (!local.ok()) return local;
    return std::unique_ptr<Work>(new P2PWork(group_, std::move(op)));
  }

  // Fails this rank's unmatched point-to-point operations (at destruction); true if any.
  bool AbandonP2P() {
    std::vector<std::shared_ptr<P2POp>> mine;
    {
      Group& g = *group_;
      std::lock_guard<std::mutex> lock(g.p2p_mu);
      for (auto it = g.channels.begin(); it != g.channels.end();) {
        for (auto* queue : {&it->second.sends, &it->second.recvs}) {
          for (auto op = queue->begin(); op != queue->end();) {
            if ((*op)->owner() == rank_) {
              mine.push_back(std::move(*op));
              op = queue->erase(op);
            } else {
              ++op;
            }
          }
        }
        if (it->second.sends.empty() && it->second.recvs.empty()) {
          it = g.channels.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (const auto& op : mine) {
      CompleteP2P(*op, absl::FailedPreconditionError(
                           absl::StrCat(op->Label(), ": rank ", rank_,
                                        "'s thread communicator was destroyed with it pending")));
    }
    group_->p2p_event.Notify();
    return !mine.empty();
  }

  // Runs a synchronous call on this thread when nothing of ours is queued or running;
  // otherwise queues it behind the pending async operations and waits.
  absl::Status RunSync(const OpArgs& a) {
    if (absl::Status local = CheckLocal(a); !local.ok()) {
      // Queued like an async call, so the peers learn of it and later calls line up.
      return Issue(a, std::move(local)).status();
    }
    if (!queue_->TryClaim()) {
      absl::StatusOr<std::unique_ptr<Work>> work = Issue(a, absl::OkStatus());  // checked above
      if (!work.ok()) return work.status();
      return (*work)->Wait(OperationWaitLimit());
    }
    absl::Status s = Execute(a, nullptr);
    queue_->Release();
    return s;
  }

  // Issues an async operation (a locally invalid one too: it takes its place in the
  // sequence, so the peers learn of it and later calls still line up).
  absl::StatusOr<std::unique_ptr<Work>> Issue(const OpArgs& args) {
    return Issue(args, CheckLocal(args));
  }
  // The same, for a call whose local check (`local`, CheckLocal's result) was already made.
  absl::StatusOr<std::unique_ptr<Work>> Issue(const OpArgs& args, absl::Status local) {
    // The last rank to issue a small operation runs it at once, on its own thread, when
    // every peer is already waiting in it and nothing of its own is queued: the peers are
    // ready for the data phase, so it does not block, and waking the worker for it would
    // only cost two context switches (on a busy core, the woken worker preempts the
    // caller).
    if (local.ok() && args.call.kind != OpKind::kSplit &&
        PayloadBytes(args.call, size()) <= kIssueInlineBytes &&
        queue_->TryClaim([&] { return PeersWaiting(); })) {
      absl::Status s = Execute(args, nullptr);
      queue_->Release();
      return std::unique_ptr<Work>(new DoneWork(std::move(s), absl::Now()));
    }
    auto op = std::make_shared<OpState>();
    op->args = args;
    if (args.call.kind == OpKind::kAllToAllV) {
      const OpCall& c = args.call;
      op->send_counts.assign(c.send_counts.begin(), c.send_counts.end());
      op->send_offsets.assign(c.send_offsets.begin(), c.send_offsets.end());
      op->recv_counts.assign(c.recv_counts.begin(), c.recv_counts.end());
      op->recv_offsets.assign(c.recv_offsets.begin(), c.recv_offsets.end());
      op->args.call.send_counts = op->send_counts;
      op->args.call.send_offsets = op->send_offsets;
      op->args.call.recv_counts = op->recv_counts;
      op->args.call.recv_offsets = op->recv_offsets;
    }
    if (!local.ok()) {
      op->local_error = std::string(local.message());
      op->args.local_error = &op->local_error;
    }
    op->runner = this;
    queue_->Push(op);
    if (!local.ok()) return local;
    return std::unique_ptr<Work>(new ThreadWork(std::move(op), queue_, group_->timeout));
  }

  // Whether every peer is already waiting in this rank's next operation. Called under the
  // queue's lock with nothing of this rank's queued or running, so op_index_ is this rank's
  // next operation and nobody else may change it meanwhile.
  bool PeersWaiting() const {
    const uint32_t w = static_cast<uint32_t>(size());
    return group_->arrived.load(std::memory_order_acquire) + 1 == (op_index_ + 1) * w;
  }

  absl::Status Broken(OpKind kind) {
    return absl::FailedPreconditionError(
        absl::StrCat(OpKindName(kind), ": the thread communicator is unusable after an earlier ",
                     "failure: ", group_->Failure().message()));
  }

  // Runs one operation to completion on the calling thread.
  absl::Status Execute(const OpArgs& mine, std::unique_ptr<Communicator>* split_result) {
    Group& g = *group_;
    const int w = g.size;
    const OpKind kind = mine.call.kind;
    if (g.broken.load(std::memory_order_acquire)) return Broken(kind);
    const uint32_t u = op_index_;
    const uint32_t target = (u + 1) * static_cast<uint32_t>(w);  // wraps like the counters
    g.posted[rank_].args = &mine;
    g.posted[rank_].op.store(u + 1, std::memory_order_relaxed);
    if (g.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == target) {
      g.event.Notify();
    } else {
      const Clock::time_point deadline = g.timeout == absl::InfiniteDuration()
                                             ? Clock::time_point::max()
                                             : Clock::now() + absl::ToChronoNanoseconds(g.timeout);
      Clock::duration slept;
      g.event.Wait(
          [&] {
            return g.arrived.load(std::memory_order_acquire) == target ||
                   g.broken.load(std::memory_order_acquire);
          },
          deadline, spin_, &slept);
      AdaptSpin(slept);
      if (g.arrived.load(std::memory_order_acquire) != target) {
        // Timed out, or the group broke: withdraw my arrival, unless the last peer arrived
        // meanwhile (then the operation runs after all, with every buffer still valid).
        uint32_t v = g.arrived.load(std::memory_order_acquire);
        while (v != target &&
               !g.arrived.compare_exchange_weak(v, v - 1, std::memory_order_acq_rel)) {
        }
        if (v != target) {
          ++op_index_;
          // Someone else broke the group while we waited: report that failure as ours.
          if (g.broken.load(std::memory_order_acquire)) return g.Failure();
          std::vector<int> missing;
          for (int p = 0; p < w; ++p) {
            if (p != rank_ && g.posted[p].op.load(std::memory_order_relaxed) != u + 1) {
              missing.push_back(p);
            }
          }
          absl::Status s = absl::DeadlineExceededError(absl::StrCat(
              OpKindName(kind), " #", u, ": rank ", rank_, " waited ",
              absl::FormatDuration(g.timeout), " for rank", missing.size() > 1 ? "s " : " ",
              absl::StrJoin(missing, ", "), " to arrive"));
          g.Break(s.code(), s.message());
          return s;
        }
      }
    }
    // Every peer has posted; their arguments stay put until they pass the end barrier.
    absl::Status agreed = CheckAgreement(u);
    if (agreed.ok()) RunDataPhase(u, split_result);
    if (g.finished.fetch_add(1, std::memory_order_acq_rel) + 1 == target) {
      g.next_chunk[u % 2].store(0, std::memory_order_relaxed);  // for operation u + 2
      g.event.Notify();
    } else {
      // No deadline: each peer's data phase is local work that always finishes, and no
      // rank may return while a peer may still read or write its buffers.
      Clock::duration slept;
      g.event.Wait([&] { return g.finished.load(std::memory_order_acquire) == target; },
                   Clock::time_point::max(), spin_, &slept);
      AdaptSpin(slept);
    }
    ++op_index_;
    return agreed;
  }

  // Adaptive spinning. `slept` is how long a wait that had to sleep lasted (zero when
  // spinning sufficed). Double the budget (up to the group's cap) after a wait that ended
  // while spinning; add 1 us after one that slept but ended within the cap (the peer was
  // running, only a little late: a longer spin would have saved the futex round trip);
  // halve it after a longer one (a descheduled peer). On a loaded machine the budget falls
  // to nothing within a few operations and stays low while long waits keep coming; it
  // grows back once waits are short again. (Halving after every sleep, as before, kept a
  // budget of zero at zero for good: a waiter that does not spin always sleeps.)
  void AdaptSpin(Clock::duration slept) {
    if (slept == Clock::duration::zero()) {
      spin_ = std::min(group_->spin, spin_ * 2 + std::chrono::microseconds(1));
    } else if (slept < group_->spin) {
      spin_ = std::min(group_->spin, spin_ + std::chrono::microseconds(1));
    } else {
      spin_ /= 2;
    }
  }

  const OpArgs& Args(int p) const { return *group_->posted[p].args; }

  // Identical on every rank (same inputs, same order), so every rank fails alike. Formats
  // nothing unless there is a failure.
  absl::Status CheckAgreement(uint32_t u) const {
    const int w = size();
    for (int p = 0; p < w; ++p) {
      if (Args(p).local_error != nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(OpKindName(Args(rank_).call.kind), " #", u, ": rank ", p,
                         " passed invalid arguments: ", *Args(p).local_error));
      }
    }
    const OpCall& a0 = Args(0).call;
    for (int p = 1; p < w; ++p) {
      const OpCall& a = Args(p).call;
      const auto mismatch = [&](absl::string_view field, const auto& mine, const auto& theirs) {
        return absl::InvalidArgumentError(
            absl::StrCat(OpKindName(a0.kind), " #", u, ": ranks disagree on ", field, ": rank ", p,
                         " passed ", field, " ", mine, ", rank 0 passed ", theirs));
      };
      if (a.kind != a0.kind) {
        return absl::InvalidArgumentError(
            absl::StrCat("operation #", u, ": ranks disagree on the operation: rank ", p,
                         " called ", OpKindName(a.kind), ", rank 0 called ", OpKindName(a0.kind)));
      }
      if (HasDType(a.kind) && a.dtype != a0.dtype) {
        return mismatch("dtype", DTypeName(a.dtype), DTypeName(a0.dtype));
      }
      if (HasReduceOp(a.kind) && a.op != a0.op) {
        return mismatch("reduce op", ReduceOpName(a.op), ReduceOpName(a0.op));
      }
      if (HasCount(a.kind) && a.count != a0.count) {
        return mismatch("count", a.count, a0.count);
      }
      if (a.kind == OpKind::kBroadcast && a.root != a0.root) {
        return mismatch("root", a.root, a0.root);
      }
    }
    if (a0.kind == OpKind::kAllToAllV) {
      for (int p = 0; p < w; ++p) {
        for (int q = 0; q < w; ++q) {
          if (Args(p).call.send_counts[q] != Args(q).call.recv_counts[p]) {
            return absl::InvalidArgumentError(absl::StrCat(
                OpKindName(a0.kind), " #", u, ": count matrix mismatch: rank ", p, " sends ",
                Args(p).call.send_counts[q], " elements to rank ", q, ", but rank ", q, " expects ",
                Args(q).call.recv_counts[p], " from rank ", p));
          }
        }
      }
    }
    return absl::OkStatus();
  }

  // The data movement of one agreed operation, run by this rank on shared buffers.
  void RunDataPhase(uint32_t u, std::unique_ptr<Communicator>* split_result) {
    const OpCall& mine = Args(rank_).call;
    const int w = size();
    const size_t elem = HasDType(mine.kind) ? DTypeSize(mine.dtype) : 1;
    std::atomic<size_t>& next_chunk = group_->next_chunk[u % 2];
    switch (mine.kind) {
      case OpKind::kAllReduce: {
        // Reduce-scatter then all-gather in one pass over shared memory: the buffer is cut
        // into chunks; whoever claims a chunk reduces it over every rank's send (ascending
        // rank order) and writes the result into every rank's recv. Only the claimer
        // touches that chunk of any buffer, so in place is safe, and the values do not
        // depend on who claimed what. Claiming dynamically (rather than a fixed 1/W each)
        // keeps all ranks busy when one of them is descheduled on a loaded machine.
        const size_t n = mine.count;
        const size_t chunk = ChunkElems(n, elem, w);
        const size_t chunks = chunk == 0 ? 0 : (n + chunk - 1) / chunk;
        for (size_t c; (c = next_chunk.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
          const size_t lo = c * chunk, hi = std::min(n, lo + chunk);
          for (int p = 0; p < w; ++p) {
            srcs_[p] = Ptr(Args(p).call.send, lo * elem);
            // Every rank's recv gets the rounded result (my own first).
            dsts_[p] = Ptr(Args((rank_ + p) % w).call.recv, lo * elem);
          }
          ReduceInto(mine.dtype, mine.op, srcs_, hi - lo, dsts_);
        }
        break;
      }
      case OpKind::kReduceScatter: {
        // Block r (for rank r) in chunks, claimed like all-reduce's; the claimer writes
        // into rank r's recv.
        const size_t n = mine.count;
        const size_t chunk = ChunkElems(n, elem, w);
        const size_t per_block = chunk == 0 ? 0 : (n + chunk - 1) / chunk;
        const size_t tasks = per_block * static_cast<size_t>(w);
        for (size_t t; (t = next_chunk.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
          const size_t block = t / per_block;
          const size_t lo = (t % per_block) * chunk, hi = std::min(n, lo + chunk);
          for (int p = 0; p < w; ++p) srcs_[p] = Ptr(Args(p).call.send, (block * n + lo) * elem);
          dsts_[0] = Ptr(Args(static_cast<int>(block)).call.recv, lo * elem);
          ReduceInto(mine.dtype, mine.op, srcs_, hi - lo, absl::MakeConstSpan(dsts_.data(), 1));
        }
        break;
      }
      case OpKind::kAllGather: {
        const size_t bytes = mine.count * elem;
        for (int p = 0; p < w; ++p) {
          char* dst = Ptr(mine.recv, static_cast<size_t>(p) * bytes);
          if (dst != Args(p).call.send && bytes > 0) std::memcpy(dst, Args(p).call.send, bytes);
        }
        break;
      }
      case OpKind::kAllToAllV:
        for (int p = 0; p < w; ++p) {
          const size_t bytes = mine.recv_counts[p] * elem;
          if (bytes == 0) continue;
          std::memcpy(Ptr(mine.recv, mine.recv_offsets[p] * elem),
                      Ptr(Args(p).call.send, Args(p).call.send_offsets[rank_] * elem), bytes);
        }
        break;
      case OpKind::kBroadcast:
        if (rank_ != mine.root && mine.count > 0) {
          std::memcpy(mine.recv, Args(mine.root).call.recv, mine.count * elem);
        }
        break;
      case OpKind::kBarrier:
        break;
      case OpKind::kSplit:
        if (split_result != nullptr) *split_result = JoinSplit();
        break;
    }
  }

  // Split: ranks with my color, ordered by (key, old rank), form a new group; the first
  // rank here creates every new group so that all members share the same one.
  std::unique_ptr<Communicator> JoinSplit() {
    const int w = size();
    const OpArgs& me = Args(rank_);
    std::shared_ptr<Group> mine;
    {
      Group& g = *group_;
      std::lock_guard<std::mutex> lock(g.mu);
      if (g.split_taken == 0) {
        std::map<int, int> members;
        for (int p = 0; p < w; ++p) {
          if (Args(p).color >= 0) ++members[Args(p).color];
        }
        for (const auto& [color, n] : members) {
          g.split_groups[color] = std::make_shared<Group>(n, g.timeout);
        }
      }
      if (me.color >= 0) mine = g.split_groups[me.color];
      if (++g.split_taken == w) {
        g.split_taken = 0;
        g.split_groups.clear();
      }
    }
    if (me.color < 0) return nullptr;
    int new_rank = 0;
    for (int p = 0; p < w; ++p) {
      if (p == rank_ || Args(p).color != me.color) continue;
      if (std::make_pair(Args(p).key, p) < std::make_pair(me.key, rank_)) ++new_rank;
    }
    return std::make_unique<ThreadCommunicator>(std::move(mine), new_rank);
  }

  const std::shared_ptr<Group> group_;
  const int rank_;
  // The index of this rank's next operation in the group. Only the thread holding the
  // queue's execution claim touches it (handed over through the queue's lock).
  uint32_t op_index_ = 0;
  // The current spin budget (AdaptSpin); same owner as op_index_.
  Clock::duration spin_;
  // Per-call scratch of the data phase (size W, allocated once).
  std::vector<const void*> srcs_;
  std::vector<void*> dsts_;

  // Issue order of the async operations (collectives/progress_queue.h); shared with the
  // Works, whose Wait may run the queue up to its own operation.
  const std::shared_ptr<ProgressQueue> queue_;
};

void OpState::Run() { result = runner->RunQueued(*this); }

absl::Status ThreadWork::Wait(absl::Duration timeout) {
  // A caller prepared to wait at least the operation's own deadline runs the queued
  // operations up to its own on this thread, if nobody else is running one.
  if (timeout >= timeout_) queue_->RunUpTo(op_.get());
  const Clock::time_point deadline =
      timeout == absl::InfiniteDuration()
          ? Clock::time_point::max()
          : Clock::now() + absl::ToChronoNanoseconds(std::max(timeout, absl::ZeroDuration()));
  // No spinning here: the operation is being run by the worker thread (or waits for it),
  // which needs the core more than this waiter does.
  const bool done = op_->event.Wait([&] { return op_->done.load(std::memory_order_acquire); },
                                    deadline, Clock::duration::zero());
  if (!done) {
    return absl::DeadlineExceededError(absl::StrCat(OpKindName(op_->args.call.kind),
                                                    " still in flight after waiting ",
                                                    absl::FormatDuration(timeout)));
  }
  return Fresh(op_->status);
}

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateThreadCommunicators(
    int world, ThreadBackendOptions options) {
  if (world < 1 || world > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("thread world size must be in [1, 1024], got ", world));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("thread backend timeout must be positive, got ",
                                                   absl::FormatDuration(options.timeout)));
  }
  auto group = std::make_shared<Group>(world, options.timeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(world);
  for (int r = 0; r < world; ++r) comms.push_back(std::make_unique<ThreadCommunicator>(group, r));
  return comms;
}

}  // namespace gradsum
