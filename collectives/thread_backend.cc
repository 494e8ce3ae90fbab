// The thread backend (see thread_backend.h).
//
// Structure:
// - A `Group` is the state the W ranks of one communicator share: a rendezvous slot per
//   operation sequence number, and a failure status once the group is broken.
// - Each `ThreadCommunicator` owns a worker thread that executes its operations in issue
//   order; the sync forms of Communicator are async + Wait, so order holds for both.
// - One operation = arrive (post my arguments into the slot, wait with a deadline until all
//   W have posted) -> every rank checks the same arguments the same way (so all fail alike
//   on a mismatch) -> data phase (each rank reads its peers' buffers directly, shared
//   memory) -> end barrier (no rank returns while a peer may still touch its buffers).
//
// Synchronisation uses std::mutex / std::condition_variable, not absl::Mutex: the system
// abseil is not built with ThreadSanitizer, which then cannot see absl::Mutex's ordering
// and reports false races; pthread-based primitives are intercepted by TSan.

#include "collectives/thread_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/op_descriptor.h"
#include "collectives/reduce_kernels.h"

namespace gradsum {
namespace {

using Clock = std::chrono::steady_clock;

// A status that shares no heap state with `s`. absl::Status copies share a refcounted
// message; the system abseil is not TSan-instrumented, so TSan cannot see that refcount's
// atomics and reports a race when copies die on different threads. Statuses that cross
// threads here are therefore always fresh copies.
absl::Status Fresh(const absl::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(s.code(), std::string(s.message()));
}

using collectives_internal::OpKind;
using collectives_internal::OpKindName;

bool HasDType(OpKind k) { return k != OpKind::kBarrier && k != OpKind::kSplit; }
bool HasCount(OpKind k) {
  return k == OpKind::kAllReduce || k == OpKind::kReduceScatter || k == OpKind::kAllGather ||
         k == OpKind::kBroadcast;
}
bool HasReduceOp(OpKind k) { return k == OpKind::kAllReduce || k == OpKind::kReduceScatter; }

// What one rank passes to a collective. Copied into the shared slot on arrival, so peers
// may read it until the slot is erased, whatever happens to the caller's spans.
struct OpArgs {
  OpKind kind = OpKind::kBarrier;
  DType dtype = DType::kF32;
  ReduceOp reduce = ReduceOp::kSum;
  // all-reduce: count; reduce-scatter: recv_count; all-gather: send_count; broadcast: count.
  size_t count = 0;
  int root = 0;
  const void* send = nullptr;
  void* recv = nullptr;  // broadcast: the buffer
  std::vector<size_t> send_counts, send_offsets, recv_counts, recv_offsets;
  int color = 0;
  int key = 0;
  // Set when this rank's own arguments were invalid: the caller got the error at issue
  // time, and the peers fail with InvalidArgument instead of waiting for a timeout.
  // (A string, not a Status, so that no Status state is shared across threads.)
  std::string local_error;
};

struct Group;

// The rendezvous of the W ranks for one operation.
struct Slot {
  explicit Slot(int size) : args(size), posted(size, false) {}
  std::vector<OpArgs> args;
  std::vector<bool> posted;
  int arrived = 0;
  int finished = 0;  // ranks past the data phase
  int departed = 0;  // ranks done with the slot; the last one erases it
  // Work chunks of the data phase claimed so far (all-reduce, reduce-scatter).
  std::atomic<size_t> next_chunk{0};
  // Split only: the new groups by color, created by the first rank to need them.
  std::map<int, std::shared_ptr<Group>> split_groups;
  bool split_done = false;
};

struct Group {
  Group(int size_in, absl::Duration timeout_in) : size(size_in), timeout(timeout_in) {}
  const int size;
  const absl::Duration timeout;
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::unique_ptr<Slot>> slots;  // guarded by mu
  absl::Status failure;                            // guarded by mu; non-OK once broken
};

// One issued operation and its completion state, shared by the queue and the Work handle.
struct OpState {
  OpArgs args;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // guarded by mu
  absl::Status status;
  std::unique_ptr<Communicator> split_result;  // Split only; read after done

  void Complete(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    status = std::move(s);
    done = true;
    cv.notify_all();
  }
};

class ThreadCommunicator;

// One rank's queue of issued operations. Shared by the communicator, its worker thread
// and the Work handles, so that a caller blocked in Wait() can run the queued operations
// itself while the worker is idle (saving two thread hand-offs per synchronous call).
// Whoever runs an operation holds `executing`, so operations still run one at a time in
// issue order.
struct ExecState {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<OpState>> queue;  // guarded by mu
  bool executing = false;                      // guarded by mu
  bool stopping = false;                       // guarded by mu
  ThreadCommunicator* owner = nullptr;         // null once the communicator is destroyed
  absl::Duration timeout;                      // the group's timeout
};

class ThreadWork : public Work {
 public:
  ThreadWork(std::shared_ptr<OpState> op, std::shared_ptr<ExecState> exec)
      : op_(std::move(op)), exec_(std::move(exec)) {}

  absl::Status Wait(absl::Duration timeout) override;

  bool IsCompleted() override {
    std::lock_guard<std::mutex> lock(op_->mu);
    return op_->done;
  }

 private:
  std::shared_ptr<OpState> op_;
  std::shared_ptr<ExecState> exec_;
};

// [begin, end) byte ranges; true if both are non-empty and intersect.
bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a);
  const auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

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

class ThreadCommunicator : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<Group> group, int rank)
      : group_(std::move(group)), rank_(rank), exec_(std::make_shared<ExecState>()) {
    exec_->owner = this;
    exec_->timeout = group_->timeout;
    worker_ = std::thread([this] { WorkerLoop(); });
  }

  ~ThreadCommunicator() override {
    bool abandoning;
    {
      std::lock_guard<std::mutex> lock(exec_->mu);
      exec_->stopping = true;
      exec_->cv.notify_all();
      abandoning = exec_->executing || !exec_->queue.empty();
    }
    // If an operation of ours is still waiting for peers, break the group so that it (and
    // the peers, who can no longer complete with us) return instead of hanging.
    if (abandoning) {
      std::lock_guard<std::mutex> lock(group_->mu);
      if (group_->failure.ok()) {
        group_->failure = absl::FailedPreconditionError(
            absl::StrCat("rank ", rank_, "'s thread communicator was destroyed with an ",
                         "operation in flight"));
      }
      group_->cv.notify_all();
    }
    worker_.join();
    // A caller running an operation inline finishes it before we go away.
    std::unique_lock<std::mutex> lock(exec_->mu);
    exec_->cv.wait(lock, [&] { return !exec_->executing; });
    exec_->owner = nullptr;
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  std::string backend() const override { return "thread"; }
  absl::Duration timeout() const override { return group_->timeout; }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    return Issue(Args(OpKind::kAllReduce, send, recv, count, dtype, op));
  }

  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    return Issue(Args(OpKind::kReduceScatter, send, recv, recv_count, dtype, op));
  }

  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    return Issue(Args(OpKind::kAllGather, send, recv, send_count, dtype));
  }

  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts,
      absl::Span<const size_t> send_offsets, void* recv, absl::Span<const size_t> recv_counts,
      absl::Span<const size_t> recv_offsets, DType dtype) override {
    OpArgs a = Args(OpKind::kAllToAllV, send, recv, 0, dtype);
    a.send_counts.assign(send_counts.begin(), send_counts.end());
    a.send_offsets.assign(send_offsets.begin(), send_offsets.end());
    a.recv_counts.assign(recv_counts.begin(), recv_counts.end());
    a.recv_offsets.assign(recv_offsets.begin(), recv_offsets.end());
    return Issue(std::move(a));
  }

  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    OpArgs a = Args(OpKind::kBroadcast, nullptr, buf, count, dtype);
    a.root = root;
    return Issue(std::move(a));
  }

  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
    return Issue(Args(OpKind::kBarrier, nullptr, nullptr, 0, DType::kF32));
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    OpArgs a = Args(OpKind::kSplit, nullptr, nullptr, 0, DType::kF32);
    a.color = color;
    a.key = key;
    auto op = std::make_shared<OpState>();
    op->args = std::move(a);
    Enqueue(op);
    ThreadWork work(op, exec_);
    absl::Status s = work.Wait(timeout() + absl::Seconds(5));
    if (!s.ok()) return s;
    return std::move(op->split_result);
  }

 private:
  static OpArgs Args(OpKind kind, const void* send, void* recv, size_t count, DType dtype,
                     ReduceOp reduce = ReduceOp::kSum) {
    OpArgs a;
    a.kind = kind;
    a.send = send;
    a.recv = recv;
    a.count = count;
    a.dtype = dtype;
    a.reduce = reduce;
    return a;
  }

  // Checks this rank's own arguments (no exchange). The rules here are what the header
  // documents for in-place and overlapping buffers.
  absl::Status CheckLocal(const OpArgs& a) const {
    const int w = size();
    if (HasDType(a.kind) && !IsValidDType(static_cast<int>(a.dtype))) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid dtype value ", static_cast<int>(a.dtype)));
    }
    const size_t elem = HasDType(a.kind) ? DTypeSize(a.dtype) : 1;
    const size_t max_count = std::numeric_limits<size_t>::max() / 16 / static_cast<size_t>(w);
    if (HasCount(a.kind) && a.count > max_count) {
      return absl::InvalidArgumentError(absl::StrCat("count ", a.count, " is too large"));
    }
    if (HasReduceOp(a.kind)) {
      if (a.reduce != ReduceOp::kSum && a.reduce != ReduceOp::kAvg && a.reduce != ReduceOp::kMax) {
        return absl::InvalidArgumentError(
            absl::StrCat("invalid reduce op value ", static_cast<int>(a.reduce)));
      }
      if (a.kind == OpKind::kReduceScatter && a.reduce == ReduceOp::kMax) {
        return absl::InvalidArgumentError("reduce_scatter supports sum and avg, not max");
      }
      if (a.reduce == ReduceOp::kAvg && !IsFloating(a.dtype)) {
        return absl::InvalidArgumentError(
            absl::StrCat("avg needs a floating dtype, got ", DTypeName(a.dtype)));
      }
    }
    const auto need = [&](const void* p, const char* what, size_t n) -> absl::Status {
      if (p == nullptr && n > 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, " is null with ", n, " elements to move"));
      }
      return absl::OkStatus();
    };
    switch (a.kind) {
      case OpKind::kAllReduce: {
        const size_t bytes = a.count * elem;
        if (absl::Status s = need(a.send, "send", a.count); !s.ok()) return s;
        if (absl::Status s = need(a.recv, "recv", a.count); !s.ok()) return s;
        if (a.send != a.recv && Overlaps(a.send, bytes, a.recv, bytes)) {
          return absl::InvalidArgumentError(
              "all_reduce send and recv overlap without being equal (in place is send == recv)");
        }
        break;
      }
      case OpKind::kReduceScatter:
      case OpKind::kAllGather: {
        const bool rs = a.kind == OpKind::kReduceScatter;
        const size_t full = a.count * static_cast<size_t>(w);
        if (absl::Status s = need(a.send, "send", rs ? full : a.count); !s.ok()) return s;
        if (absl::Status s = need(a.recv, "recv", rs ? a.count : full); !s.ok()) return s;
        // In place is the NCCL convention: my block of the full buffer is the small one.
        const void* full_buf = rs ? a.send : a.recv;
        const void* block = rs ? a.recv : a.send;
        const bool in_place = block == Ptr(full_buf, static_cast<size_t>(rank_) * a.count * elem);
        if (!in_place && Overlaps(full_buf, full * elem, block, a.count * elem)) {
          return absl::InvalidArgumentError(absl::StrCat(
              OpKindName(a.kind), " buffers overlap; in place needs ",
              rs ? "recv == send + rank * recv_count" : "send == recv + rank * send_count",
              " (rank ", rank_, ")"));
        }
        break;
      }
      case OpKind::kAllToAllV: {
        const size_t n = static_cast<size_t>(w);
        if (a.send_counts.size() != n || a.send_offsets.size() != n || a.recv_counts.size() != n ||
            a.recv_offsets.size() != n) {
          return absl::InvalidArgumentError(absl::StrCat(
              "all_to_all_v needs ", n, " entries per span; got send_counts ",
              a.send_counts.size(), ", send_offsets ", a.send_offsets.size(), ", recv_counts ",
              a.recv_counts.size(), ", recv_offsets ", a.recv_offsets.size()));
        }
        // Ranges in elements; reject overflow, overlapping receive blocks, and any overlap
        // between what peers read (send) and what I write (recv).
        std::vector<std::pair<size_t, size_t>> recv_ranges;
        size_t send_total = 0, recv_total = 0;
        for (size_t p = 0; p < n; ++p) {
          for (const bool is_send : {true, false}) {
            const size_t off = is_send ? a.send_offsets[p] : a.recv_offsets[p];
            const size_t cnt = is_send ? a.send_counts[p] : a.recv_counts[p];
            if (cnt > max_count || off > max_count) {
              return absl::InvalidArgumentError(absl::StrCat(
                  "all_to_all_v ", is_send ? "send" : "recv", " block for peer ", p, " (offset ",
                  off, ", count ", cnt, ") is too large"));
            }
          }
          send_total += a.send_counts[p];
          recv_total += a.recv_counts[p];
          if (a.recv_counts[p] > 0) {
            recv_ranges.push_back({a.recv_offsets[p], a.recv_offsets[p] + a.recv_counts[p]});
          }
        }
        if (absl::Status s = need(a.send, "send", send_total); !s.ok()) return s;
        if (absl::Status s = need(a.recv, "recv", recv_total); !s.ok()) return s;
        std::sort(recv_ranges.begin(), recv_ranges.end());
        for (size_t i = 1; i < recv_ranges.size(); ++i) {
          if (recv_ranges[i].first < recv_ranges[i - 1].second) {
            return absl::InvalidArgumentError(absl::StrCat(
                "all_to_all_v recv blocks overlap: [", recv_ranges[i - 1].first, ", ",
                recv_ranges[i - 1].second, ") and [", recv_ranges[i].first, ", ",
                recv_ranges[i].second, ")"));
          }
        }
        for (size_t p = 0; p < n; ++p) {
          for (size_t q = 0; q < n; ++q) {
            if (Overlaps(Ptr(a.send, a.send_offsets[p] * elem), a.send_counts[p] * elem,
                         Ptr(a.recv, a.recv_offsets[q] * elem), a.recv_counts[q] * elem)) {
              return absl::InvalidArgumentError(absl::StrCat(
                  "all_to_all_v send block for peer ", p, " overlaps recv block from peer ", q,
                  " (in place is not supported)"));
            }
          }
        }
        break;
      }
      case OpKind::kBroadcast:
        if (a.root < 0 || a.root >= w) {
          return absl::InvalidArgumentError(
              absl::StrCat("broadcast root ", a.root, " is outside [0, ", w, ")"));
        }
        if (absl::Status s = need(a.recv, "buf", a.count); !s.ok()) return s;
        break;
      case OpKind::kBarrier:
      case OpKind::kSplit:
        break;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Work>> Issue(OpArgs args) {
    absl::Status local = CheckLocal(args);
    if (!local.ok()) local = absl::InvalidArgumentError(
        absl::StrCat(OpKindName(args.kind), ": ", local.message()));
    auto op = std::make_shared<OpState>();
    op->args = std::move(args);
    if (!local.ok()) op->args.local_error = std::string(local.message());
    // Even a locally invalid call takes its place in the sequence, so the peers learn of
    // it (InvalidArgument) rather than time out, and later calls still line up.
    Enqueue(op);
    if (!local.ok()) return local;
    return std::unique_ptr<Work>(new ThreadWork(std::move(op), exec_));
  }

  void Enqueue(std::shared_ptr<OpState> op) {
    std::lock_guard<std::mutex> lock(exec_->mu);
    exec_->queue.push_back(std::move(op));
    exec_->cv.notify_all();
  }

  void WorkerLoop() {
    ExecState& e = *exec_;
    for (;;) {
      std::shared_ptr<OpState> op;
      {
        std::unique_lock<std::mutex> lock(e.mu);
        e.cv.wait(lock, [&] { return !e.executing && (e.stopping || !e.queue.empty()); });
        if (e.queue.empty()) return;
        op = std::move(e.queue.front());
        e.queue.pop_front();
        e.executing = true;
      }
      RunClaimed(*op);
    }
  }

 public:
  // Runs an operation popped from the queue by the caller, who set `executing`.
  void RunClaimed(OpState& op) {
    absl::Status s = Execute(op);
    {
      std::lock_guard<std::mutex> lock(exec_->mu);
      exec_->executing = false;
      exec_->cv.notify_all();
    }
    op.Complete(std::move(s));
  }

 private:
  // Runs one operation to completion on the worker thread.
  absl::Status Execute(OpState& op) {
    const OpArgs& mine = op.args;
    Group& g = *group_;
    const int w = g.size;
    const uint64_t seq = next_seq_++;
    const std::string what = absl::StrCat(OpKindName(mine.kind), " #", seq);
    Slot* slot = nullptr;
    {
      std::unique_lock<std::mutex> lock(g.mu);
      if (!g.failure.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            what, ": the thread communicator is unusable after an earlier failure: ",
            g.failure.message()));
      }
      {
        std::lock_guard<std::mutex> self(exec_->mu);
        if (exec_->stopping) {
          return absl::FailedPreconditionError(
              absl::StrCat(what, ": the communicator was destroyed before it ran"));
        }
      }
      std::unique_ptr<Slot>& s = g.slots[seq];
      if (!s) s = std::make_unique<Slot>(w);
      slot = s.get();
      slot->args[rank_] = mine;
      slot->posted[rank_] = true;
      if (++slot->arrived == w) g.cv.notify_all();
      const auto deadline = Clock::now() + absl::ToChronoNanoseconds(g.timeout);
      const auto all_here = [&] { return slot->arrived == w || !g.failure.ok(); };
      if (g.timeout == absl::InfiniteDuration()) {
        g.cv.wait(lock, all_here);
      } else if (!g.cv.wait_until(lock, deadline, all_here)) {
        std::vector<int> missing;
        for (int p = 0; p < w; ++p) {
          if (!slot->posted[p]) missing.push_back(p);
        }
        g.failure = absl::DeadlineExceededError(absl::StrCat(
            what, ": rank ", rank_, " waited ", absl::FormatDuration(g.timeout), " for rank",
            missing.size() > 1 ? "s " : " ", absl::StrJoin(missing, ", "), " to arrive"));
        g.cv.notify_all();
        return Fresh(g.failure);
      }
      if (slot->arrived < w) {
        // Someone else broke the group while we waited; report that failure as ours.
        return Fresh(g.failure);
      }
    }
    // From here every peer has posted; slot->args is immutable until the slot is erased.
    absl::Status agreed = CheckAgreement(slot->args, what);
    if (agreed.ok()) {
      RunDataPhase(*slot, op);
      std::unique_lock<std::mutex> lock(g.mu);
      if (++slot->finished == w) g.cv.notify_all();
      // No deadline: each peer's data phase is local work that always finishes, and no
      // rank may return while a peer may still read or write its buffers.
      g.cv.wait(lock, [&] { return slot->finished == w; });
    }
    {
      std::lock_guard<std::mutex> lock(g.mu);
      if (++slot->departed == w) g.slots.erase(seq);
    }
    return agreed;
  }

  // Identical on every rank (same inputs, same order), so every rank fails alike.
  static absl::Status CheckAgreement(const std::vector<OpArgs>& args, const std::string& what) {
    const int w = static_cast<int>(args.size());
    for (int p = 0; p < w; ++p) {
      if (!args[p].local_error.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": rank ", p,
                                                       " passed invalid arguments: ",
                                                       args[p].local_error));
      }
    }
    const OpArgs& a0 = args[0];
    for (int p = 1; p < w; ++p) {
      const OpArgs& a = args[p];
      const auto mismatch = [&](absl::string_view field, const auto& mine, const auto& theirs) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": ranks disagree on ", field,
                                                       ": rank ", p, " passed ", field, " ",
                                                       mine, ", rank 0 passed ", theirs));
      };
      if (a.kind != a0.kind) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": ranks disagree on the operation: rank ", p,
                                                       " called ", OpKindName(a.kind),
                                                       ", rank 0 called ", OpKindName(a0.kind)));
      }
      if (HasDType(a.kind) && a.dtype != a0.dtype) {
        return mismatch("dtype", DTypeName(a.dtype), DTypeName(a0.dtype));
      }
      if (HasReduceOp(a.kind) && a.reduce != a0.reduce) {
        return mismatch("reduce op", ReduceOpName(a.reduce), ReduceOpName(a0.reduce));
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
          if (args[p].send_counts[q] != args[q].recv_counts[p]) {
            return absl::InvalidArgumentError(absl::StrCat(
                what, ": count matrix mismatch: rank ", p, " sends ", args[p].send_counts[q],
                " elements to rank ", q, ", but rank ", q, " expects ", args[q].recv_counts[p],
                " from rank ", p));
          }
        }
      }
    }
    return absl::OkStatus();
  }

  // The data movement of one agreed operation, run by this rank on shared buffers.
  void RunDataPhase(Slot& slot, OpState& op) {
    const std::vector<OpArgs>& args = slot.args;
    const OpArgs& mine = args[rank_];
    const int w = size();
    const size_t elem = HasDType(mine.kind) ? DTypeSize(mine.dtype) : 1;
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
        std::vector<const void*> srcs(w);
        std::vector<void*> dsts(w);
        for (size_t c; (c = slot.next_chunk.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
          const size_t lo = c * chunk, hi = std::min(n, lo + chunk);
          for (int p = 0; p < w; ++p) {
            srcs[p] = Ptr(args[p].send, lo * elem);
            // My own recv first: the kernel rounds into it once, then copies to the others.
            dsts[p] = Ptr(args[(rank_ + p) % w].recv, lo * elem);
          }
          ReduceInto(mine.dtype, mine.reduce, srcs, hi - lo, dsts);
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
        std::vector<const void*> srcs(w);
        for (size_t t; (t = slot.next_chunk.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
          const size_t block = t / per_block;
          const size_t lo = (t % per_block) * chunk, hi = std::min(n, lo + chunk);
          for (int p = 0; p < w; ++p) srcs[p] = Ptr(args[p].send, (block * n + lo) * elem);
          void* dst = Ptr(args[block].recv, lo * elem);
          ReduceInto(mine.dtype, mine.reduce, srcs, hi - lo, absl::MakeConstSpan(&dst, 1));
        }
        break;
      }
      case OpKind::kAllGather: {
        const size_t bytes = mine.count * elem;
        for (int p = 0; p < w; ++p) {
          char* dst = Ptr(mine.recv, static_cast<size_t>(p) * bytes);
          if (dst != args[p].send && bytes > 0) std::memcpy(dst, args[p].send, bytes);
        }
        break;
      }
      case OpKind::kAllToAllV:
        for (int p = 0; p < w; ++p) {
          const size_t bytes = mine.recv_counts[p] * elem;
          if (bytes == 0) continue;
          std::memcpy(Ptr(mine.recv, mine.recv_offsets[p] * elem),
                      Ptr(args[p].send, args[p].send_offsets[rank_] * elem), bytes);
        }
        break;
      case OpKind::kBroadcast:
        if (rank_ != mine.root && mine.count > 0) {
          std::memcpy(mine.recv, args[mine.root].recv, mine.count * elem);
        }
        break;
      case OpKind::kBarrier:
        break;
      case OpKind::kSplit:
        op.split_result = JoinSplit(slot);
        break;
    }
  }

  // Split: ranks with my color, ordered by (key, old rank), form a new group; the first
  // rank here creates every new group so that all members share the same one.
  std::unique_ptr<Communicator> JoinSplit(Slot& slot) {
    const std::vector<OpArgs>& args = slot.args;
    const int w = size();
    std::shared_ptr<Group> mine;
    {
      std::lock_guard<std::mutex> lock(group_->mu);
      if (!slot.split_done) {
        std::map<int, int> members;
        for (int p = 0; p < w; ++p) {
          if (args[p].color >= 0) ++members[args[p].color];
        }
        for (const auto& [color, n] : members) {
          slot.split_groups[color] = std::make_shared<Group>(n, group_->timeout);
        }
        slot.split_done = true;
      }
      if (args[rank_].color < 0) return nullptr;
      mine = slot.split_groups[args[rank_].color];
    }
    int new_rank = 0;
    for (int p = 0; p < w; ++p) {
      if (p == rank_ || args[p].color != args[rank_].color) continue;
      if (std::make_pair(args[p].key, p) < std::make_pair(args[rank_].key, rank_)) ++new_rank;
    }
    return std::make_unique<ThreadCommunicator>(std::move(mine), new_rank);
  }

  const std::shared_ptr<Group> group_;
  const int rank_;
  uint64_t next_seq_ = 0;  // worker thread only

  const std::shared_ptr<ExecState> exec_;
  std::thread worker_;  // started in the constructor body, after everything else
};

absl::Status ThreadWork::Wait(absl::Duration timeout) {
  // A caller prepared to wait at least the operation's own deadline runs the queued
  // operations up to its own on this thread, if nobody else is running one.
  if (timeout >= exec_->timeout) {
    for (;;) {
      std::shared_ptr<OpState> front;
      ThreadCommunicator* owner;
      {
        std::lock_guard<std::mutex> lock(exec_->mu);
        if (exec_->executing || exec_->stopping || exec_->owner == nullptr ||
            std::find(exec_->queue.begin(), exec_->queue.end(), op_) == exec_->queue.end()) {
          break;
        }
        front = std::move(exec_->queue.front());
        exec_->queue.pop_front();
        exec_->executing = true;
        owner = exec_->owner;
      }
      owner->RunClaimed(*front);
      if (front == op_) break;
    }
  }
  std::unique_lock<std::mutex> lock(op_->mu);
  if (timeout == absl::InfiniteDuration()) {
    op_->cv.wait(lock, [&] { return op_->done; });
  } else {
    const auto deadline = Clock::now() + absl::ToChronoNanoseconds(timeout);
    if (!op_->cv.wait_until(lock, deadline, [&] { return op_->done; })) {
      return absl::DeadlineExceededError(absl::StrCat(OpKindName(op_->args.kind),
                                                      " still in flight after waiting ",
                                                      absl::FormatDuration(timeout)));
    }
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
    return absl::InvalidArgumentError(absl::StrCat(
        "thread backend timeout must be positive, got ", absl::FormatDuration(options.timeout)));
  }
  auto group = std::make_shared<Group>(world, options.timeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(world);
  for (int r = 0; r < world; ++r) comms.push_back(std::make_unique<ThreadCommunicator>(group, r));
  return comms;
}

}  // namespace gradsum
