#include "collectives/mpi_backend.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/checked_communicator.h"
#include "collectives/op_descriptor.h"
#include "collectives/progress_queue.h"
#include "core/half.h"
#include "core/status.h"

namespace gradsum {
namespace {

using collectives_internal::MakeCall;
using collectives_internal::OpCall;
using Kind = collectives_internal::OpKind;
constexpr auto KindName = collectives_internal::OpKindName;

// ---- Process-wide MPI state. ----

// Synchronisation here uses std::mutex / std::condition_variable rather than absl's:
// Debian's shared abseil is not built with TSan, so TSan cannot see absl::Mutex and would
// report every handoff through it as a race under --config=tsan.

// Non-null when MPI runs at MPI_THREAD_SERIALIZED: every MPI call this backend makes
// (from any progress thread or the caller's thread) then holds it.
std::mutex* g_serial_mu = nullptr;

template <typename F>
int CallMpi(F&& f) {
  if (g_serial_mu == nullptr) return f();
  std::lock_guard<std::mutex> lock(*g_serial_mu);
  return f();
}

absl::Status MpiError(int rc, absl::string_view what) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  return absl::InternalError(
      absl::StrCat(what, ": MPI error ", rc, " (", absl::string_view(text, len), ")"));
}

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

void AbortMpiJob(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
}

namespace {

const char* ThreadLevelName(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return "unknown";
}

// Initialises MPI if nobody has, and decides whether our calls must be serialised.
absl::Status EnsureMpiReady() {
  static std::mutex init_mu;
  std::lock_guard<std::mutex> lock(init_mu);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return absl::FailedPreconditionError("MPI has already been finalised");
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Init_thread");
    std::atexit(FinalizeAtExit);
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MPI was initialised at ", ThreadLevelName(provided),
        "; the mpi backend calls MPI from a progress thread and needs MPI_THREAD_MULTIPLE "
        "(or MPI_THREAD_SERIALIZED): use MPI_Init_thread"));
  }
  if (provided == MPI_THREAD_SERIALIZED && g_serial_mu == nullptr) {
    g_serial_mu = new std::mutex();  // Lives for the process, like MPI itself.
  }
  return absl::OkStatus();
}

// ---- Element types and conversions. ----

MPI_Datatype MoveType(DType t) {
  switch (t) {
    case DType::kF32:
      return MPI_FLOAT;
    case DType::kF64:
      return MPI_DOUBLE;
    case DType::kBF16:
      return MPI_UINT16_T;  // moved as bits; reduced via fp32 (below)
    case DType::kF16:
      return MPI_UINT16_T;
    case DType::kI32:
      return MPI_INT32_T;
    case DType::kI64:
      return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

bool IsHalf(DType t) { return t == DType::kBF16 || t == DType::kF16; }

// bf16/f16 -> fp32 (exact).
void Widen(const void* src, DType t, size_t n, float* dst) {
  const uint16_t* bits = static_cast<const uint16_t*>(src);
  if (t == DType::kBF16) {
    for (size_t i = 0; i < n; ++i) dst[i] = BF16::FromBits(bits[i]).ToFloat();
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = F16::FromBits(bits[i]).ToFloat();
  }
}

// fp32 -> bf16/f16, rounding once to nearest even (SEMANTICS.md §7).
void Narrow(const float* src, DType t, size_t n, void* dst) {
  uint16_t* bits = static_cast<uint16_t*>(dst);
  if (t == DType::kBF16) {
    for (size_t i = 0; i < n; ++i) bits[i] = BF16::FromFloat(src[i]).bits;
  } else {
    for (size_t i = 0; i < n; ++i) bits[i] = F16::FromFloat(src[i]).bits;
  }
}

template <typename T>
void DivideBy(void* buf, size_t n, int divisor) {
  T* p = static_cast<T*>(buf);
  const T d = static_cast<T>(divisor);
  for (size_t i = 0; i < n; ++i) p[i] = p[i] / d;
}

// AVG = SUM / size in the accumulation type: f64 for f64, fp32 otherwise (bf16/f16 were
// widened to fp32 by the caller). AVG of integers is rejected before this.
void DivideNative(void* buf, size_t n, DType t, int divisor) {
  if (t == DType::kF64) {
    DivideBy<double>(buf, n, divisor);
  } else {
    DivideBy<float>(buf, n, divisor);
  }
}

// Scratch memory of one operation. MPI may still write into it after a timeout (a late
// peer completes the request), so a timed-out operation's scratch is never freed.
struct Scratch {
  std::vector<float> f32a, f32b;
  std::vector<unsigned char> bytes;
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
};

void LeakForever(std::unique_ptr<Scratch> scratch) {
  static std::mutex mu;
  static auto* graveyard = new std::vector<std::unique_ptr<Scratch>>();
  std::lock_guard<std::mutex> lock(mu);
  graveyard->push_back(std::move(scratch));
}

// What an executing operation knows about itself.
struct OpContext {
  int64_t seq = 0;
  Kind kind = Kind::kBarrier;
  absl::Time deadline;
  Scratch* scratch = nullptr;  // the communicator's, reused by every operation
  bool breaks_comm = false;    // set when the communicator must not be used again
  bool leak_scratch = false;   // set when MPI may still write into the scratch
  bool blocking = false;       // a sync call run with blocking MPI, watched by the watchdog
};

using OpFn = std::function<absl::Status(OpContext&)>;

class MpiCommunicator;

// One issued asynchronous operation: a task of the communicator's progress queue.
struct Op final : collectives_internal::ProgressQueue::Task {
  Kind kind;
  int64_t seq = 0;  // issue order on this rank
  OpFn run;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;                                // guarded by mu
  absl::Status status;                              // written before done is set
  absl::Time finished_at = absl::InfiniteFuture();  // guarded by mu
  // Runs it (the queue runs tasks only while the communicator lives).
  MpiCommunicator* runner = nullptr;
  absl::Status result;  // Run's, for Finish

  void Run() override;  // after MpiCommunicator
  void Finish() override { Complete(std::move(result)); }

  void Complete(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    finished_at = absl::Now();
    status = std::move(s);
    done = true;
    cv.notify_all();
  }
};

class MpiWork final : public Work {
 public:
  explicit MpiWork(std::shared_ptr<Op> op) : op_(std::move(op)) {}
  absl::Status Wait(absl::Duration timeout) override {
    std::unique_lock<std::mutex> lock(op_->mu);
    const auto finished = [this] { return op_->done; };
    if (timeout == absl::InfiniteDuration()) {
      op_->cv.wait(lock, finished);
    } else if (!op_->cv.wait_for(lock, absl::ToChronoNanoseconds(timeout), finished)) {
      return absl::DeadlineExceededError(
          absl::StrCat("mpi ", KindName(op_->kind), " still in flight after waiting ",
                       absl::FormatDuration(timeout), "; its buffers must stay alive"));
    }
    // A fresh copy, not a shared reference: the progress thread may free the Op's status
    // while the caller holds this one, and abseil's refcount is invisible to TSan.
    if (op_->status.ok()) return absl::OkStatus();
    return absl::Status(op_->status.code(), op_->status.message());
  }
  bool IsCompleted() override {
    std::lock_guard<std::mutex> lock(op_->mu);
    return op_->done;
  }
  absl::Time CompletionTime() override {
    std::lock_guard<std::mutex> lock(op_->mu);
    return op_->finished_at;
  }

 private:
  std::shared_ptr<Op> op_;
};

// ---- Point-to-point state (MpiCommunicator's "Point-to-point" says how it works). ----

// One posted send or receive.
struct P2POp {
  bool send = false;
  int peer = 0, tag = 0;
  int64_t seq = 0;
  void* buf = nullptr;
  size_t count = 0;
  DType dtype = DType::kF32;
  int64_t header[2] = {0, 0};        // (count, dtype): the sender's, sent or received
  int64_t verdict[3] = {0, 0, 0};    // the receiver's: (mismatch ? 1 : 0, its count, its dtype)
  std::vector<unsigned char> drain;  // a mismatched payload is received here
  MPI_Request reqs[3] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  bool header_seen = false;  // receive: the header arrived, payload and verdict posted
  absl::Time deadline;
  std::atomic<bool> done{false};
  absl::Status status;                              // written before done
  absl::Time finished_at = absl::InfiniteFuture();  // written before done

  void Finish(absl::Status s) {
    status = std::move(s);
    finished_at = absl::Now();
    done.store(true, std::memory_order_release);
  }
};

// Operations MPI may still write into (a timed-out or abandoned one's requests stay in
// flight): never freed.
void LeakForever(std::shared_ptr<P2POp> op) {
  static std::mutex mu;
  static auto* graveyard = new std::vector<std::shared_ptr<P2POp>>();
  std::lock_guard<std::mutex> lock(mu);
  graveyard->push_back(std::move(op));
}

// The pending point-to-point operations of the whole process, for the where-is-everyone
// answer: a rank that waits on a peer in a send or receive of one communicator names that
// peer when asked on any other communicator (a CP ring's neighbour is in no collective of
// the data-parallel group that asks).
struct PendingP2P {
  absl::Time posted;
  int64_t seq = 0;
  bool send = false;
  int peer_world = 0;
};
std::mutex& PendingMu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::map<const void*, PendingP2P>& PendingOps() {  // guarded by PendingMu()
  static auto* ops = new std::map<const void*, PendingP2P>();
  return *ops;
}
void RegisterP2P(const void* key, const PendingP2P& p) {
  std::lock_guard<std::mutex> lock(PendingMu());
  PendingOps()[key] = p;
}
void UnregisterP2P(const void* key) {
  std::lock_guard<std::mutex> lock(PendingMu());
  PendingOps().erase(key);
}
// The oldest pending operation as (send ? 1 : 0, peer's world rank, seq); (-1, -1, -1) if none.
std::array<int64_t, 3> OldestPendingP2P() {
  std::lock_guard<std::mutex> lock(PendingMu());
  const PendingP2P* oldest = nullptr;
  for (const auto& [key, p] : PendingOps()) {
    if (oldest == nullptr || p.posted < oldest->posted) oldest = &p;
  }
  if (oldest == nullptr) return {-1, -1, -1};
  return {oldest->send ? 1 : 0, oldest->peer_world, oldest->seq};
}

// What a communicator's point-to-point Works share with it (a Work may outlive it).
struct P2PEngine {
  std::mutex mu;
  MpiCommunicator* owner = nullptr;             // guarded by mu; null once destroyed
  std::vector<std::shared_ptr<P2POp>> pending;  // guarded by mu
};

class MpiP2PWork final : public Work {
 public:
  MpiP2PWork(std::shared_ptr<P2PEngine> engine, std::shared_ptr<P2POp> op)
      : engine_(std::move(engine)), op_(std::move(op)) {}
  absl::Status Wait(absl::Duration timeout) override;  // after MpiCommunicator
  bool IsCompleted() override { return op_->done.load(std::memory_order_acquire); }
  absl::Time CompletionTime() override {
    return IsCompleted() ? op_->finished_at : absl::InfiniteFuture();
  }

 private:
  const std::shared_ptr<P2PEngine> engine_;
  const std::shared_ptr<P2POp> op_;
};

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (frees it on destruction unless the communicator broke).
  MpiCommunicator(MPI_Comm comm, MpiBackendOptions options)
      : comm_(comm),
        options_(options),
        blocking_sync_(options.blocking_sync_calls && g_serial_mu == nullptr),
        timeout_ns_(absl::ToInt64Nanoseconds(options.timeout)),
        watch_period_(std::clamp<int64_t>(absl::ToInt64Nanoseconds(options.timeout) / 4,
                                          int64_t{1'000'000}, int64_t{100'000'000})),
        scratch_(std::make_unique<Scratch>()) {
    CallMpi([&] { return MPI_Comm_rank(comm_, &rank_); });
    CallMpi([&] { return MPI_Comm_size(comm_, &size_); });
    CallMpi([&] { return MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN); });
    // Each rank's MPI_COMM_WORLD rank, to name peers in messages.
    world_rank_.resize(size_);
    std::iota(world_rank_.begin(), world_rank_.end(), 0);
    MPI_Group group, world;
    if (CallMpi([&] { return MPI_Comm_group(comm_, &group); }) == MPI_SUCCESS) {
      if (CallMpi([&] { return MPI_Comm_group(MPI_COMM_WORLD, &world); }) == MPI_SUCCESS) {
        std::vector<int> mine(size_);
        std::iota(mine.begin(), mine.end(), 0);
        CallMpi([&] {
          return MPI_Group_translate_ranks(group, size_, mine.data(), world, world_rank_.data());
        });
        CallMpi([&] { return MPI_Group_free(&world); });
      }
      CallMpi([&] { return MPI_Group_free(&group); });
    }
    p2p_->owner = this;
    // Idle, or a sync call runs on the caller's thread: the worker wakes every watch period
    // to answer asks, check that call's deadline and drive point-to-point operations
    // (nobody notifies for a sync call; that would cost a context switch per call).
    queue_ = collectives_internal::ProgressQueue::Start({.on_idle =
                                                             [this] {
                                                               AnswerAsks();
                                                               CheckWatchedCall();
                                                               DriveP2PIdle();
                                                             },
                                                         .idle_period = watch_period_});
  }

  ~MpiCommunicator() override {
    queue_->Stop();  // after running what was already issued
    // Point-to-point operations still pending fail (their requests stay in flight: the
    // communicator is then left to MPI_Finalize, like a broken one).
    bool abandoned = false;
    {
      std::lock_guard<std::mutex> lock(p2p_->mu);
      p2p_->owner = nullptr;
      for (std::shared_ptr<P2POp>& op : p2p_->pending) {
        abandoned = true;
        UnregisterP2P(op.get());
        op->Finish(absl::FailedPreconditionError(
            absl::StrCat(P2PLabel(*op), ": the communicator was destroyed with it pending")));
        LeakForever(std::move(op));
      }
      p2p_->pending.clear();
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    // A broken communicator may have requests in flight; freeing it could block or let
    // MPI touch freed state, so it is left to MPI_Finalize.
    if (!finalized && !broken_ && !abandoned) CallMpi([&] { return MPI_Comm_free(&comm_); });
    // Asks and answers may still be in flight towards a peer that is gone: their buffers
    // outlive the communicator (moving a deque keeps its elements where they are).
    if (!asks_.empty() || !answers_.empty()) {
      new std::pair<std::deque<int64_t>, std::deque<Answer>>(std::move(asks_), std::move(answers_));
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  absl::Duration timeout() const override { return options_.timeout; }
  // Every MPI count and displacement is an int.
  size_t max_count() const override { return static_cast<size_t>(INT_MAX); }

  // Async forms: validated on the caller's thread, run in issue order by the progress
  // thread. Sync forms: the same operation, run on the caller's thread when nothing of
  // this communicator's is queued or running (no hand-off, no allocation), else queued.

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    return Async(MakeCall(Kind::kAllReduce, send, recv, count, dtype, op));
  }
  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp op) override {
    return Sync(MakeCall(Kind::kAllReduce, send, recv, count, dtype, op));
  }

  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    return Async(MakeCall(Kind::kReduceScatter, send, recv, recv_count, dtype, op));
  }
  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                             ReduceOp op) override {
    return Sync(MakeCall(Kind::kReduceScatter, send, recv, recv_count, dtype, op));
  }

  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    return Async(MakeCall(Kind::kAllGather, send, recv, send_count, dtype));
  }
  absl::Status AllGather(const void* send, void* recv, size_t send_count, DType dtype) override {
    return Sync(MakeCall(Kind::kAllGather, send, recv, send_count, dtype));
  }

  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override {
    return Async(collectives_internal::MakeAllToAllVCall(send, send_counts, send_offsets, recv,
                                                         recv_counts, recv_offsets, dtype));
  }
  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_counts,
                         absl::Span<const size_t> send_offsets, void* recv,
                         absl::Span<const size_t> recv_counts,
                         absl::Span<const size_t> recv_offsets, DType dtype) override {
    return Sync(collectives_internal::MakeAllToAllVCall(send, send_counts, send_offsets, recv,
                                                        recv_counts, recv_offsets, dtype));
  }

  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    return Async(collectives_internal::MakeBroadcastCall(buf, count, dtype, root));
  }
  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root) override {
    return Sync(collectives_internal::MakeBroadcastCall(buf, count, dtype, root));
  }

  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
    return Async(MakeCall(Kind::kBarrier, nullptr, nullptr, 0, DType::kF32));
  }
  absl::Status Barrier() override {
    return Sync(MakeCall(Kind::kBarrier, nullptr, nullptr, 0, DType::kF32));
  }

  // ---- Point-to-point. ----
  // Each message is three MPI messages on this communicator, under tags that no collective
  // or ask uses: the sender's header (count, dtype), its payload (bytes), and the
  // receiver's verdict back. The receiver checks the header against its own count and
  // dtype before it receives the payload (into a drain buffer on a mismatch), then answers;
  // the sender's Work completes with that verdict, so both sides learn of a mismatch, and
  // a send completes once its receiver has matched it (MPI_Issend's meaning). MPI's
  // non-overtaking rule keeps each (peer, tag) stream in issue order. Operations are
  // posted on the caller's thread at issue, never queued behind the collectives, and
  // driven by whoever waits on any of this communicator's point-to-point Works (and by the
  // idle progress thread), so the two halves of an exchange may be waited for in either
  // order. One that is not matched within the timeout (counted from its issue) fails with
  // DeadlineExceeded naming the peer and where the peers are, and breaks the communicator.

  absl::StatusOr<std::unique_ptr<Work>> SendAsync(const void* buf, size_t count, DType dtype,
                                                  int peer, int tag) override {
    return PostP2P(/*send=*/true, const_cast<void*>(buf), count, dtype, peer, tag);
  }
  absl::StatusOr<std::unique_ptr<Work>> RecvAsync(void* buf, size_t count, DType dtype, int peer,
                                                  int tag) override {
    return PostP2P(/*send=*/false, buf, count, dtype, peer, tag);
  }

  // "mpi send #12 to rank 1 (rank 0 of 2)".
  std::string P2PLabel(const P2POp& op) const {
    return absl::StrFormat("mpi %s #%d (rank %d of %d)",
                           collectives_internal::PointToPointLabel(op.send, op.peer, op.tag),
                           op.seq, rank_, size_);
  }

  // Advances every pending operation; fails those past their deadline. Caller holds
  // p2p_->mu. `polls` counts the caller's polls (asks are answered every 256).
  void ProgressP2P(int polls) {
    std::vector<std::shared_ptr<P2POp>>& pending = p2p_->pending;
    // The (peer, tag) streams with a receive still waiting for its header: a later receive
    // of the same stream must not post its payload receive first (it would take the
    // earlier message's payload), even if its own header is seen first.
    std::vector<std::pair<int, int>> waiting;
    for (size_t i = 0; i < pending.size();) {
      std::shared_ptr<P2POp> op = pending[i];
      const std::pair<int, int> stream{op->peer, op->tag};
      const bool blocked = !op->send && !op->header_seen &&
                           std::find(waiting.begin(), waiting.end(), stream) != waiting.end();
      std::optional<absl::Status> result;
      if (!blocked) result = AdvanceP2P(*op);
      if (!op->send && !op->header_seen) waiting.push_back(stream);
      if (!result.has_value() && absl::Now() >= op->deadline) {
        result = absl::DeadlineExceededError(
            absl::StrCat(P2PLabel(*op), ": rank ", op->peer, " did not post the matching ",
                         op->send ? "recv" : "send", " within the timeout of ",
                         absl::FormatDuration(options_.timeout), WhereArePeers(op->seq),
                         "; the communicator is now unusable"));
        LeakForever(op);  // its requests stay in flight
      }
      if (!result.has_value()) {
        ++i;
        continue;
      }
      if (!result->ok() && result->code() != absl::StatusCode::kInvalidArgument) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!broken_) {
          broken_ = true;
          broken_reason_ = std::string(result->message());
        }
      }
      UnregisterP2P(op.get());
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
      op->Finish(*std::move(result));
    }
    if (polls % 256 == 255) AnswerAsks();
  }

 private:
  absl::StatusOr<std::unique_ptr<Work>> PostP2P(bool send, void* buf, size_t count, DType dtype,
                                                int peer, int tag) {
    const int64_t seq = next_seq_++;
    const size_t elem = IsValidDType(static_cast<int>(dtype)) ? DTypeSize(dtype) : 1;
    // The payload moves as bytes, whose count is an int.
    GRADSUM_RETURN_IF_ERROR(collectives_internal::ValidatePointToPoint(
        send, buf, count, dtype, peer, tag, size_, static_cast<size_t>(INT_MAX) / elem));
    auto op = std::make_shared<P2POp>();
    op->send = send;
    op->peer = peer;
    op->tag = tag;
    op->seq = seq;
    op->buf = buf;
    op->count = count;
    op->dtype = dtype;
    op->deadline = absl::Now() + options_.timeout;
    std::lock_guard<std::mutex> lock(p2p_->mu);
    {
      std::lock_guard<std::mutex> state(mu_);
      if (broken_) return absl::FailedPreconditionError(BrokenMessage());
    }
    int rc;
    if (send) {
      op->header[0] = static_cast<int64_t>(count);
      op->header[1] = static_cast<int64_t>(dtype);
      const int bytes = static_cast<int>(count * elem);
      rc = CallMpi([&] {
        int r = MPI_Isend(op->header, 2, MPI_INT64_T, peer, HeaderTag(tag), comm_, &op->reqs[0]);
        if (r == MPI_SUCCESS) {
          r = MPI_Isend(buf, bytes, MPI_BYTE, peer, PayloadTag(tag), comm_, &op->reqs[1]);
        }
        if (r == MPI_SUCCESS) {
          r = MPI_Irecv(op->verdict, 3, MPI_INT64_T, peer, VerdictTag(tag), comm_, &op->reqs[2]);
        }
        return r;
      });
    } else {
      rc = CallMpi([&] {
        return MPI_Irecv(op->header, 2, MPI_INT64_T, peer, HeaderTag(tag), comm_, &op->reqs[0]);
      });
    }
    if (rc != MPI_SUCCESS) {
      LeakForever(op);
      const absl::Status s = MpiError(rc, P2PLabel(*op));
      std::lock_guard<std::mutex> state(mu_);
      broken_ = true;
      broken_reason_ = std::string(s.message());
      return s;
    }
    RegisterP2P(op.get(), {absl::Now(), seq, send, world_rank_[peer]});
    p2p_->pending.push_back(op);
    return std::unique_ptr<Work>(new MpiP2PWork(p2p_, std::move(op)));
  }

  // One step of an operation's protocol; its result once it is complete.
  std::optional<absl::Status> AdvanceP2P(P2POp& op) {
    int flag = 0;
    if (!op.send && !op.header_seen) {
      const int rc = CallMpi([&] { return MPI_Test(&op.reqs[0], &flag, MPI_STATUS_IGNORE); });
      if (rc != MPI_SUCCESS) return MpiError(rc, P2PLabel(op));
      if (!flag) return std::nullopt;
      op.header_seen = true;
      const bool match = op.header[0] == static_cast<int64_t>(op.count) &&
                         op.header[1] == static_cast<int64_t>(op.dtype);
      void* into = op.buf;
      size_t bytes = op.count * DTypeSize(op.dtype);
      if (!match) {
        const DType theirs = IsValidDType(static_cast<int>(op.header[1]))
                                 ? static_cast<DType>(op.header[1])
                                 : DType::kF32;
        op.drain.resize(static_cast<size_t>(std::max<int64_t>(op.header[0], 0)) *
                        DTypeSize(theirs));
        into = op.drain.data();
        bytes = op.drain.size();
      }
      op.verdict[0] = match ? 0 : 1;
      op.verdict[1] = static_cast<int64_t>(op.count);
      op.verdict[2] = static_cast<int64_t>(op.dtype);
      const int rc2 = CallMpi([&] {
        int r = MPI_Irecv(into, static_cast<int>(bytes), MPI_BYTE, op.peer, PayloadTag(op.tag),
                          comm_, &op.reqs[1]);
        if (r == MPI_SUCCESS) {
          r = MPI_Isend(op.verdict, 3, MPI_INT64_T, op.peer, VerdictTag(op.tag), comm_,
                        &op.reqs[2]);
        }
        return r;
      });
      if (rc2 != MPI_SUCCESS) return MpiError(rc2, P2PLabel(op));
    }
    const int rc = CallMpi([&] { return MPI_Testall(3, op.reqs, &flag, MPI_STATUSES_IGNORE); });
    if (rc != MPI_SUCCESS) return MpiError(rc, P2PLabel(op));
    if (!flag) return std::nullopt;
    const auto name = [](int64_t count, int64_t dtype) {
      return absl::StrCat(count, " ",
                          IsValidDType(static_cast<int>(dtype))
                              ? DTypeName(static_cast<DType>(dtype))
                              : "invalid-dtype");
    };
    const std::string mine = name(static_cast<int64_t>(op.count), static_cast<int64_t>(op.dtype));
    if (op.send && op.verdict[0] != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          P2PLabel(op), ": size mismatch: rank ", op.peer, " expects ",
          name(op.verdict[1], op.verdict[2]), " elements, this rank (", rank_, ") sends ", mine));
    }
    if (!op.send && op.verdict[0] != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          P2PLabel(op), ": size mismatch: rank ", op.peer, " sends ",
          name(op.header[0], op.header[1]), " elements, this rank (", rank_, ") expects ", mine));
    }
    return absl::OkStatus();
  }

  static constexpr int kP2PTagBase = 1 << 22;
  static int HeaderTag(int tag) { return kP2PTagBase + 3 * tag; }
  static int PayloadTag(int tag) { return kP2PTagBase + 3 * tag + 1; }
  static int VerdictTag(int tag) { return kP2PTagBase + 3 * tag + 2; }

  // Drives the pending point-to-point operations from the idle progress thread (a rank
  // that posted a receive but waits on nothing still answers its sender).
  void DriveP2PIdle() {
    std::unique_lock<std::mutex> lock(p2p_->mu, std::try_to_lock);
    if (lock.owns_lock() && !p2p_->pending.empty()) ProgressP2P(0);
  }

 public:
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    const int64_t seq = next_seq_++;
    auto result = std::make_shared<absl::StatusOr<std::unique_ptr<Communicator>>>(nullptr);
    // Runs on the progress thread so that it is ordered after earlier async operations.
    absl::StatusOr<std::unique_ptr<Work>> work =
        Enqueue(seq, Kind::kSplit, [=](OpContext& ctx) -> absl::Status {
          // A barrier with the deadline first, so that the blocking split cannot wait on
          // an absent rank.
          MPI_Request req;
          GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] { return MPI_Ibarrier(comm_, &req); }));
          GRADSUM_RETURN_IF_ERROR(Await(ctx, &req));
          MPI_Comm child = MPI_COMM_NULL;
          const int rc = CallMpi([&] {
            return MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child);
          });
          if (rc != MPI_SUCCESS) {
            ctx.breaks_comm = true;
            return MpiError(rc, Label(ctx));
          }
          if (child != MPI_COMM_NULL) {
            *result = std::unique_ptr<Communicator>(new MpiCommunicator(child, options_));
          }
          return absl::OkStatus();
        });
    GRADSUM_RETURN_IF_ERROR(WaitIssued(std::move(work)));
    return std::move(*result);
  }

 private:
  // The one local check of every backend, with this backend's limit (max_count()).
  absl::Status Validate(const OpCall& c) const {
    return collectives_internal::ValidateCall(c, rank_, size_, max_count());
  }

  absl::StatusOr<std::unique_ptr<Work>> Async(const OpCall& c) {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(Validate(c));
    return Dispatch<absl::StatusOr<std::unique_ptr<Work>>>(
        c, [&](auto&& fn) { return Enqueue(seq, c.kind, OpFn(std::move(fn))); });
  }

  absl::Status Sync(const OpCall& c) {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(Validate(c));
    return Dispatch<absl::Status>(c, [&](auto&& fn) { return RunNow(seq, c.kind, fn); });
  }

  // Builds the data movement of a validated call and hands it to `run` (which queues it
  // or runs it now). Everything the closure needs is captured by value.
  template <typename R, typename Run>
  R Dispatch(const OpCall& c, Run&& run) {
    const DType dtype = c.dtype;
    const ReduceOp op = c.op;
    const size_t count = c.count;
    const void* send = c.send;
    void* recv = c.recv;
    const bool in_place = collectives_internal::IsInPlace(c, rank_);
    switch (c.kind) {
      case Kind::kAllReduce:
        return run([=](OpContext& ctx) { return RunAllReduce(ctx, send, recv, count, dtype, op); });
      case Kind::kReduceScatter:
        return run([=](OpContext& ctx) {
          return RunReduceScatter(ctx, send, recv, count, dtype, op, in_place);
        });
      case Kind::kAllGather:
        return run([=](OpContext& ctx) -> absl::Status {
          if (count == 0) return absl::OkStatus();
          const void* in = in_place ? MPI_IN_PLACE : send;
          const int n = static_cast<int>(count);
          const MPI_Datatype t = MoveType(dtype);
          return Collective(
              ctx, [&] { return MPI_Allgather(in, n, t, recv, n, t, comm_); },
              [&](MPI_Request* req) { return MPI_Iallgather(in, n, t, recv, n, t, comm_, req); });
        });
      case Kind::kAllToAllV: {
        auto to_ints = [](absl::Span<const size_t> s) {
          return std::vector<int>(s.begin(), s.end());
        };
        std::vector<int> sc = to_ints(c.send_counts), sd = to_ints(c.send_offsets);
        std::vector<int> rc = to_ints(c.recv_counts), rd = to_ints(c.recv_offsets);
        return run([=](OpContext& ctx) -> absl::Status {
          Scratch& s = *ctx.scratch;
          s.send_counts = sc;
          s.send_displs = sd;
          s.recv_counts = rc;
          s.recv_displs = rd;
          const MPI_Datatype t = MoveType(dtype);
          return Collective(
              ctx,
              [&] {
                return MPI_Alltoallv(send, s.send_counts.data(), s.send_displs.data(), t, recv,
                                     s.recv_counts.data(), s.recv_displs.data(), t, comm_);
              },
              [&](MPI_Request* req) {
                return MPI_Ialltoallv(send, s.send_counts.data(), s.send_displs.data(), t, recv,
                                      s.recv_counts.data(), s.recv_displs.data(), t, comm_, req);
              });
        });
      }
      case Kind::kBroadcast: {
        const int root = c.root;
        return run([=](OpContext& ctx) -> absl::Status {
          if (count == 0) return absl::OkStatus();
          const int n = static_cast<int>(count);
          const MPI_Datatype t = MoveType(dtype);
          return Collective(
              ctx, [&] { return MPI_Bcast(recv, n, t, root, comm_); },
              [&](MPI_Request* req) { return MPI_Ibcast(recv, n, t, root, comm_, req); });
        });
      }
      case Kind::kBarrier:
      case Kind::kSplit:
        break;
    }
    return run([=](OpContext& ctx) -> absl::Status {
      return Collective(
          ctx, [&] { return MPI_Barrier(comm_); },
          [&](MPI_Request* req) { return MPI_Ibarrier(comm_, req); });
    });
  }

  absl::Status RunAllReduce(OpContext& ctx, const void* send, void* recv, size_t count, DType dtype,
                            ReduceOp op) {
    // Large buffers go in chunks, one MPI all-reduce each, so that the fp32 staging of
    // bf16/f16 stays small and in cache between widening, reducing and narrowing.
    const size_t esize = DTypeSize(dtype);
    for (size_t begin = 0; begin < count; begin += kAllReduceChunk) {
      const size_t len = std::min(kAllReduceChunk, count - begin);
      const int n = static_cast<int>(len);
      const void* chunk_send = static_cast<const unsigned char*>(send) + begin * esize;
      void* chunk_recv = static_cast<unsigned char*>(recv) + begin * esize;
      if (IsHalf(dtype)) {
        std::vector<float>& acc = ctx.scratch->f32a;
        acc.resize(len);
        Widen(chunk_send, dtype, len, acc.data());
        GRADSUM_RETURN_IF_ERROR(
            AllReduceChunk(ctx, MPI_IN_PLACE, acc.data(), n, MPI_FLOAT, MpiOp(op)));
        if (op == ReduceOp::kAvg) DivideNative(acc.data(), len, DType::kF32, size_);
        Narrow(acc.data(), dtype, len, chunk_recv);
        continue;
      }
      const void* in = send == recv ? MPI_IN_PLACE : chunk_send;
      GRADSUM_RETURN_IF_ERROR(AllReduceChunk(ctx, in, chunk_recv, n, MoveType(dtype), MpiOp(op)));
      if (op == ReduceOp::kAvg) DivideNative(chunk_recv, len, dtype, size_);
    }
    return absl::OkStatus();
  }

  absl::Status AllReduceChunk(OpContext& ctx, const void* in, void* out, int n, MPI_Datatype t,
                              MPI_Op op) {
    return Collective(
        ctx, [&] { return MPI_Allreduce(in, out, n, t, op, comm_); },
        [&](MPI_Request* req) { return MPI_Iallreduce(in, out, n, t, op, comm_, req); });
  }

  absl::Status RunReduceScatter(OpContext& ctx, const void* send, void* recv, size_t recv_count,
                                DType dtype, ReduceOp op, bool in_place) {
    if (recv_count == 0) return absl::OkStatus();
    const size_t send_count = recv_count * static_cast<size_t>(size_);
    const size_t esize = DTypeSize(dtype);
    const int n = static_cast<int>(recv_count);
    if (IsHalf(dtype)) {
      std::vector<float>& in = ctx.scratch->f32a;
      std::vector<float>& out = ctx.scratch->f32b;
      in.resize(send_count);
      out.resize(recv_count);
      Widen(send, dtype, send_count, in.data());
      GRADSUM_RETURN_IF_ERROR(ReduceScatterBlock(ctx, in.data(), out.data(), n, MPI_FLOAT));
      if (op == ReduceOp::kAvg) DivideNative(out.data(), recv_count, DType::kF32, size_);
      Narrow(out.data(), dtype, recv_count, recv);
      return absl::OkStatus();
    }
    // In place, recv aliases my block of send, which MPI must not see as both input and
    // output: reduce into scratch and copy.
    void* out = recv;
    if (in_place) {
      ctx.scratch->bytes.resize(recv_count * esize);
      out = ctx.scratch->bytes.data();
    }
    GRADSUM_RETURN_IF_ERROR(ReduceScatterBlock(ctx, send, out, n, MoveType(dtype)));
    if (op == ReduceOp::kAvg) DivideNative(out, recv_count, dtype, size_);
    if (out != recv) std::memcpy(recv, out, recv_count * esize);
    return absl::OkStatus();
  }

  absl::Status ReduceScatterBlock(OpContext& ctx, const void* in, void* out, int n,
                                  MPI_Datatype t) {
    return Collective(
        ctx, [&] { return MPI_Reduce_scatter_block(in, out, n, t, MPI_SUM, comm_); },
        [&](MPI_Request* req) {
          return MPI_Ireduce_scatter_block(in, out, n, t, MPI_SUM, comm_, req);
        });
  }

  // Elements per MPI all-reduce of a large all-reduce (4 MiB of f32).
  static constexpr size_t kAllReduceChunk = size_t{1} << 20;

  // AVG is reduced as SUM and divided afterwards.
  static MPI_Op MpiOp(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }

  // ---- Where every rank is, for a timeout's message. ----
  // A rank whose operation times out asks every other rank of the communicator where it is
  // (point-to-point on this communicator, under tags no collective uses); each rank answers
  // from its progress thread (when idle, and while it polls an operation) with the
  // operation it is in or last ran. A rank that is stopped, dead or cut off does not answer.
  static constexpr int kAskTag = 0x6773;
  static constexpr int kAnswerTag = 0x6774;
  // An answer: the position (seq, kind, busy) in this communicator, then the process's
  // oldest pending point-to-point operation (send ? 1 : 0, peer's world rank, seq; -1s if
  // none).
  static constexpr int kAnswerWords = 6;
  using Answer = std::array<int64_t, kAnswerWords>;

  // Answers the asks that have arrived. Never blocks on another thread answering.
  void AnswerAsks() {
    std::unique_lock<std::mutex> lock(board_mu_, std::try_to_lock);
    if (lock.owns_lock()) AnswerAsksLocked();
  }

  // The caller holds board_mu_.
  void AnswerAsksLocked() {
    if (size_ <= 1) return;
    for (int n = 0; n < size_; ++n) {  // at most one ask per peer per call
      int flag = 0;
      MPI_Status status;
      if (CallMpi([&] { return MPI_Iprobe(MPI_ANY_SOURCE, kAskTag, comm_, &flag, &status); }) !=
              MPI_SUCCESS ||
          !flag) {
        return;
      }
      const int from = status.MPI_SOURCE;
      int64_t asked = 0;
      if (CallMpi([&] {
            return MPI_Recv(&asked, 1, MPI_INT64_T, from, kAskTag, comm_, MPI_STATUS_IGNORE);
          }) != MPI_SUCCESS) {
        return;
      }
      // Send buffers stay put (a deque never moves its elements) until the process ends;
      // asks come only after a timeout, so there are few.
      const std::array<int64_t, 3> p2p = OldestPendingP2P();
      answers_.push_back({position_seq_.load(std::memory_order_relaxed),
                          position_kind_.load(std::memory_order_relaxed),
                          in_operation_.load(std::memory_order_acquire) ? 1 : 0, p2p[0], p2p[1],
                          p2p[2]});
      MPI_Request req;
      if (CallMpi([&] {
            return MPI_Isend(answers_.back().data(), kAnswerWords, MPI_INT64_T, from, kAnswerTag,
                             comm_, &req);
          }) == MPI_SUCCESS) {
        CallMpi([&] { return MPI_Request_free(&req); });
      }
    }
  }

  // "; waited for rank 2 (...)": asks the other ranks where they are and waits up to a
  // second for their answers. Empty for a communicator of one rank.
  std::string WhereArePeers(int64_t seq) {
    if (size_ <= 1) return "";
    std::lock_guard<std::mutex> lock(board_mu_);
    asks_.push_back(seq);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      MPI_Request req;
      if (CallMpi([&] {
            return MPI_Isend(&asks_.back(), 1, MPI_INT64_T, q, kAskTag, comm_, &req);
          }) == MPI_SUCCESS) {
        CallMpi([&] { return MPI_Request_free(&req); });
      }
    }
    const absl::Duration grace =
        std::clamp(options_.timeout / 4, absl::Milliseconds(200), absl::Seconds(1));
    std::vector<std::optional<Answer>> answer(size_);
    int missing = size_ - 1;
    for (const absl::Time end = absl::Now() + grace; missing > 0 && absl::Now() < end;) {
      AnswerAsksLocked();  // a peer that timed out too asks us
      int flag = 0;
      MPI_Status status;
      if (CallMpi([&] { return MPI_Iprobe(MPI_ANY_SOURCE, kAnswerTag, comm_, &flag, &status); }) !=
          MPI_SUCCESS) {
        break;
      }
      if (!flag) {
        absl::SleepFor(absl::Milliseconds(1));
        continue;
      }
      Answer got;
      const int from = status.MPI_SOURCE;
      if (CallMpi([&] {
            return MPI_Recv(got.data(), kAnswerWords, MPI_INT64_T, from, kAnswerTag, comm_,
                            MPI_STATUS_IGNORE);
          }) != MPI_SUCCESS) {
        break;
      }
      if (from >= 0 && from < size_ && !answer[from].has_value()) {
        answer[from] = got;
        --missing;
      }
    }
    std::vector<std::string> waited, arrived;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const std::string name = PeerName(q);
      if (!answer[q].has_value()) {
        waited.push_back(absl::StrCat(name, " (no answer within ", absl::FormatDuration(grace),
                                      ": stopped, dead or unreachable)"));
        continue;
      }
      const auto [peer_seq, peer_kind, busy, p2p_send, p2p_peer, p2p_seq] = *answer[q];
      const std::string op =
          absl::StrFormat("mpi %s #%d", KindName(static_cast<Kind>(peer_kind)), peer_seq);
      // Its oldest pending send or receive (on any communicator), which names the peer it
      // waits for when that peer is not in this communicator.
      const std::string p2p = p2p_send < 0
                                  ? ""
                                  : absl::StrFormat("; its mpi %s #%d %s world rank %d is pending",
                                                    p2p_send ? "send" : "recv", p2p_seq,
                                                    p2p_send ? "to" : "from", p2p_peer);
      if (busy && peer_seq == seq) {
        arrived.push_back(name);
      } else if (busy) {
        waited.push_back(absl::StrCat(name, " (in ", op, p2p, ")"));
      } else if (peer_seq < 0) {
        waited.push_back(
            absl::StrCat(name, " (in no operation of this communicator yet", p2p, ")"));
      } else {
        waited.push_back(absl::StrCat(name, " (in no operation; its last was ", op, p2p, ")"));
      }
    }
    std::string text;
    if (!waited.empty()) absl::StrAppend(&text, "; waited for ", absl::StrJoin(waited, ", "));
    if (!arrived.empty()) {
      absl::StrAppend(&text, "; in it too: ", absl::StrJoin(arrived, ", "));
    }
    return text;
  }

  // "rank 2", with its MPI_COMM_WORLD rank where that differs.
  std::string PeerName(int q) const {
    const int w = world_rank_[q];
    return w == q ? absl::StrCat("rank ", q) : absl::StrCat("rank ", q, " (world rank ", w, ")");
  }

  std::string Label(const OpContext& ctx) const {
    return absl::StrFormat("mpi %s #%d (rank %d of %d)", KindName(ctx.kind), ctx.seq, rank_, size_);
  }

  std::string BrokenMessage() const {
    return absl::StrCat("mpi communicator is unusable after an earlier failure: ", broken_reason_);
  }

  absl::StatusOr<std::unique_ptr<Work>> Enqueue(int64_t seq, Kind kind, OpFn fn) {
    auto op = std::make_shared<Op>();
    op->kind = kind;
    op->seq = seq;
    op->run = std::move(fn);
    op->runner = this;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return absl::FailedPreconditionError(BrokenMessage());
    }
    queue_->Push(op);
    return std::unique_ptr<Work>(new MpiWork(std::move(op)));
  }

  // Runs `fn` on the caller's thread once nothing is queued or running. With blocking sync
  // calls it waits for the pending async operations to finish first (each is bounded by its
  // own deadline), so that a sync call is blocking MPI on every rank whatever the timing:
  // MPI never matches a blocking collective with a non-blocking one. Without, it queues a
  // copy behind the pending operations and waits for it.
  template <typename F>
  absl::Status RunNow(int64_t seq, Kind kind, F& fn) {
    // Fast path: no async operation is queued or running. Only this (the caller's) thread
    // issues operations, so the progress thread stays idle until this call returns, and
    // the acquire load orders everything it did (broken_, the scratch) before this call.
    if (blocking_sync_ && queue_->pending() == 0) {
      if (broken_) return absl::FailedPreconditionError(BrokenMessage());
      return Execute(seq, kind, fn, /*blocking=*/true);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return absl::FailedPreconditionError(BrokenMessage());
    }
    if (!queue_->TryClaim()) {
      if (!blocking_sync_) return WaitIssued(Enqueue(seq, kind, OpFn(fn)));
      queue_->ClaimWhenDrained();  // the caller is using the communicator: not stopping
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) {
        queue_->Release();
        return absl::FailedPreconditionError(BrokenMessage());
      }
    }
    absl::Status s = Execute(seq, kind, fn, blocking_sync_);
    queue_->Release();
    return s;
  }

  // Runs one operation; the caller holds the queue's execution claim (or is RunNow's fast
  // path, with no async operation pending).
  template <typename F>
  absl::Status Execute(int64_t seq, Kind kind, F& fn, bool blocking = false) {
    OpContext ctx;
    ctx.seq = seq;
    ctx.kind = kind;
    if (!blocking) ctx.deadline = absl::Now() + options_.timeout;  // the watchdog's otherwise
    ctx.scratch = scratch_.get();
    ctx.blocking = blocking;
    if (blocking) Arm(seq, kind);
    position_seq_.store(seq, std::memory_order_relaxed);
    position_kind_.store(static_cast<int64_t>(kind), std::memory_order_relaxed);
    in_operation_.store(true, std::memory_order_release);
    absl::Status status = fn(ctx);
    in_operation_.store(false, std::memory_order_release);
    if (blocking) watch_deadline_ns_.store(0, std::memory_order_release);
    if (ctx.leak_scratch) {
      LeakForever(std::move(scratch_));
      scratch_ = std::make_unique<Scratch>();
    }
    if (ctx.breaks_comm) {
      std::lock_guard<std::mutex> lock(mu_);
      broken_ = true;
      broken_reason_ = std::string(status.message());
    }
    return status;
  }

  // A queued operation, run by the progress queue (Op::Run).
 public:
  absl::Status RunQueued(Op& op) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return absl::FailedPreconditionError(BrokenMessage());
    }
    return Execute(op.seq, op.kind, op.run);
  }

 private:
  // One MPI collective: the blocking form on a watched sync call (ctx.blocking), else the
  // non-blocking form polled until the operation's deadline.
  template <typename Blocking, typename Start>
  absl::Status Collective(OpContext& ctx, Blocking&& blocking, Start&& start) {
    if (ctx.blocking) {
      const int rc = CallMpi(blocking);
      if (rc != MPI_SUCCESS) {
        ctx.breaks_comm = true;
        return MpiError(rc, Label(ctx));
      }
      return absl::OkStatus();
    }
    MPI_Request req;
    GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] { return start(&req); }));
    return Await(ctx, &req);
  }

  static int64_t SteadyNanos() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Arms the watchdog for a blocking sync call (three relaxed stores and a release; no
  // allocation, no lock, no notification).
  void Arm(int64_t seq, Kind kind) {
    watch_seq_.store(seq, std::memory_order_relaxed);
    watch_kind_.store(static_cast<int64_t>(kind), std::memory_order_relaxed);
    const int64_t now = SteadyNanos();
    const int64_t deadline = timeout_ns_ > INT64_MAX - now ? INT64_MAX : now + timeout_ns_;
    watch_deadline_ns_.store(deadline, std::memory_order_release);
  }

  // The watchdog (on the progress thread, which is idle while a sync call runs on the
  // caller's thread): a blocking call still armed after its deadline cannot be interrupted
  // (MPI cannot cancel a collective), so the rank reports DeadlineExceeded and ends the
  // job, as a training job does after any timed-out collective.
  void CheckWatchedCall() {
    // The clock is read before the deadline: if the deadline loaded afterwards has passed
    // at `now`, the call armed with it was still running after its deadline.
    const int64_t now = SteadyNanos();
    const int64_t deadline = watch_deadline_ns_.load(std::memory_order_acquire);
    if (deadline == 0 || now <= deadline) return;
    const int64_t seq = watch_seq_.load(std::memory_order_relaxed);
    const auto kind = static_cast<Kind>(watch_kind_.load(std::memory_order_relaxed));
    // Re-armed meanwhile (the label would belong to a newer call): check again later.
    if (watch_deadline_ns_.load(std::memory_order_acquire) != deadline) return;
    OpContext ctx;
    ctx.seq = seq;
    ctx.kind = kind;
    const std::string message = absl::StrCat(
        "gradsum mpi backend: DEADLINE_EXCEEDED: ", Label(ctx),
        ": not every rank arrived within the timeout of ", absl::FormatDuration(options_.timeout),
        WhereArePeers(seq), " in a blocking call, which cannot be abandoned; ending the MPI job");
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
    AbortMpiJob(kWatchdogExitCode);
    std::_Exit(kWatchdogExitCode);  // only if MPI was already finalised
  }

  // Starts a non-blocking MPI call; an error breaks the communicator.
  template <typename F>
  absl::Status Post(OpContext& ctx, F&& start) {
    const int rc = CallMpi(start);
    if (rc != MPI_SUCCESS) {
      ctx.breaks_comm = true;
      return MpiError(rc, Label(ctx));
    }
    return absl::OkStatus();
  }

  // Polls `req` until it completes or the operation's deadline passes. Spins (yielding
  // the core) while young, since MPI only progresses inside MPI calls; backs off to short
  // sleeps once a peer is clearly late, so a waiting rank does not burn a shared core.
  absl::Status Await(OpContext& ctx, MPI_Request* req) {
    absl::Time start;
    for (int polls = 0;; ++polls) {
      int done = 0;
      const int rc = CallMpi([&] { return MPI_Test(req, &done, MPI_STATUS_IGNORE); });
      if (rc != MPI_SUCCESS) {
        ctx.breaks_comm = true;
        ctx.leak_scratch = true;
        return MpiError(rc, Label(ctx));
      }
      if (done) return absl::OkStatus();
      if (polls < 64) continue;  // the common case: no clock reads at all
      const absl::Time now = absl::Now();
      if (polls == 64) start = now;
      if (polls % 256 == 0) AnswerAsks();
      if (now >= ctx.deadline) {
        ctx.breaks_comm = true;
        ctx.leak_scratch = true;  // the request stays in flight; MPI cannot cancel it
        return absl::DeadlineExceededError(
            absl::StrCat(Label(ctx), ": not every rank arrived within the timeout of ",
                         absl::FormatDuration(options_.timeout), WhereArePeers(ctx.seq),
                         "; the communicator is now unusable"));
      }
      if (now - start > absl::Milliseconds(500)) {
        absl::SleepFor(absl::Microseconds(200));
      } else {
        std::this_thread::yield();
      }
    }
  }

  // The exit status of a job that the watchdog ends.
  static constexpr int kWatchdogExitCode = 1;

  MPI_Comm comm_;
  const MpiBackendOptions options_;
  // Sync calls on the caller's thread use blocking MPI (options, and MPI_THREAD_MULTIPLE:
  // under MPI_THREAD_SERIALIZED a blocking call would hold the process-wide MPI lock
  // while it waits, stalling every other communicator's progress).
  const bool blocking_sync_;
  const int64_t timeout_ns_;
  // How often the idle progress thread checks a watched call: timeout / 4, in [1, 100] ms.
  const std::chrono::nanoseconds watch_period_;
  // The watched call: deadline in steady-clock ns, 0 when none. Written by the caller's
  // thread, read by the progress thread.
  std::atomic<int64_t> watch_deadline_ns_{0};
  std::atomic<int64_t> watch_seq_{0};
  std::atomic<int64_t> watch_kind_{0};
  int rank_ = 0;
  int size_ = 0;
  // Numbers every operation call (for messages). Caller's thread only.
  int64_t next_seq_ = 0;

  std::mutex mu_;
  // Written under mu_ by whoever executes; read by the destructor after the join.
  bool broken_ = false;
  std::string broken_reason_;  // guarded by mu_
  // Used only by whoever holds the queue's execution claim (or the sync fast path).
  std::unique_ptr<Scratch> scratch_;
  // Where this rank is (the operation running or last run), for other ranks' asks.
  std::atomic<int64_t> position_seq_{-1};
  std::atomic<int64_t> position_kind_{0};
  std::atomic<bool> in_operation_{false};
  std::vector<int> world_rank_;  // this communicator's rank q -> MPI_COMM_WORLD rank
  // One asker or answerer at a time; the send buffers of asks and answers (never freed: a
  // send may be pending towards a peer that is gone).
  std::mutex board_mu_;
  std::deque<int64_t> asks_;    // guarded by board_mu_
  std::deque<Answer> answers_;  // guarded by board_mu_
  // Point-to-point operations pending, shared with their Works.
  const std::shared_ptr<P2PEngine> p2p_ = std::make_shared<P2PEngine>();
  // Issue order of the async operations and the progress thread (progress_queue.h).
  std::shared_ptr<collectives_internal::ProgressQueue> queue_;
};

void Op::Run() { result = runner->RunQueued(*this); }

absl::Status MpiP2PWork::Wait(absl::Duration timeout) {
  const absl::Time wait_end = timeout == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + std::max(timeout, absl::ZeroDuration());
  const auto done = [&] { return op_->done.load(std::memory_order_acquire); };
  for (int polls = 0;; ++polls) {
    if (!done()) {
      std::lock_guard<std::mutex> lock(engine_->mu);
      // A destroyed communicator finished every operation it left pending.
      if (engine_->owner != nullptr && !done()) engine_->owner->ProgressP2P(polls);
    }
    if (done()) return op_->status;
    const absl::Time now = absl::Now();
    if (now >= wait_end) {
      return absl::DeadlineExceededError(absl::StrCat("mpi ", op_->send ? "send" : "recv", " #",
                                                      op_->seq, " still in flight after waiting ",
                                                      absl::FormatDuration(timeout)));
    }
    // Spin (yielding) while young, since MPI progresses only inside MPI calls; then back
    // off to short sleeps so a waiting rank does not burn a shared core.
    if (polls < 4096) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(100));
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorldCommunicator(
    MpiBackendOptions options) {
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("mpi backend timeout must be positive, got ",
                                                   absl::FormatDuration(options.timeout)));
  }
  GRADSUM_RETURN_IF_ERROR(EnsureMpiReady());
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req;
  int rc = CallMpi([&] { return MPI_Comm_idup(MPI_COMM_WORLD, &dup, &req); });
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_idup(MPI_COMM_WORLD)");
  const absl::Time deadline = absl::Now() + options.timeout;
  for (int done = 0; !done;) {
    rc = CallMpi([&] { return MPI_Test(&req, &done, MPI_STATUS_IGNORE); });
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_idup(MPI_COMM_WORLD)");
    if (!done && absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("CreateMpiWorldCommunicator: not every process arrived within ",
                       absl::FormatDuration(options.timeout)));
    }
    if (!done) std::this_thread::yield();
  }
  std::unique_ptr<Communicator> comm(new MpiCommunicator(dup, options));
  if (options.check_agreement) return WithAgreementCheck(std::move(comm));
  return comm;
}

}  // namespace gradsum
