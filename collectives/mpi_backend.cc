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

struct Op {
  Kind kind;
  int64_t seq = 0;  // issue order on this rank
  OpFn run;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;                                // guarded by mu
  absl::Status status;                              // written before done is set
  absl::Time finished_at = absl::InfiniteFuture();  // guarded by mu

  void Finish(absl::Status s) {
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
    worker_ = std::thread([this] { WorkerLoop(); });
  }

  ~MpiCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    worker_.join();  // after running what was already issued
    int finalized = 0;
    MPI_Finalized(&finalized);
    // A broken communicator may have requests in flight; freeing it could block or let
    // MPI touch freed state, so it is left to MPI_Finalize.
    if (!finalized && !broken_) CallMpi([&] { return MPI_Comm_free(&comm_); });
    // Asks and answers may still be in flight towards a peer that is gone: their buffers
    // outlive the communicator (moving a deque keeps its elements where they are).
    if (!asks_.empty() || !answers_.empty()) {
      new std::pair<std::deque<int64_t>, std::deque<std::array<int64_t, 3>>>(std::move(asks_),
                                                                             std::move(answers_));
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
      answers_.push_back({position_seq_.load(std::memory_order_relaxed),
                          position_kind_.load(std::memory_order_relaxed),
                          in_operation_.load(std::memory_order_acquire) ? 1 : 0});
      MPI_Request req;
      if (CallMpi([&] {
            return MPI_Isend(answers_.back().data(), 3, MPI_INT64_T, from, kAnswerTag, comm_, &req);
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
    std::vector<std::optional<std::array<int64_t, 3>>> answer(size_);
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
      std::array<int64_t, 3> got;
      const int from = status.MPI_SOURCE;
      if (CallMpi([&] {
            return MPI_Recv(got.data(), 3, MPI_INT64_T, from, kAnswerTag, comm_, MPI_STATUS_IGNORE);
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
      const auto [peer_seq, peer_kind, busy] = *answer[q];
      const std::string op =
          absl::StrFormat("mpi %s #%d", KindName(static_cast<Kind>(peer_kind)), peer_seq);
      if (busy && peer_seq == seq) {
        arrived.push_back(name);
      } else if (busy) {
        waited.push_back(absl::StrCat(name, " (in ", op, ")"));
      } else if (peer_seq < 0) {
        waited.push_back(absl::StrCat(name, " (in no operation of this communicator yet)"));
      } else {
        waited.push_back(absl::StrCat(name, " (in no operation; its last was ", op, ")"));
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
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return absl::FailedPreconditionError(BrokenMessage());
      queue_.push_back(op);
      pending_.fetch_add(1, std::memory_order_relaxed);
    }
    queue_cv_.notify_all();
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
    if (blocking_sync_ && pending_.load(std::memory_order_acquire) == 0) {
      if (broken_) return absl::FailedPreconditionError(BrokenMessage());
      return Execute(seq, kind, fn, /*blocking=*/true);
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (broken_) return absl::FailedPreconditionError(BrokenMessage());
      if (executing_ || !queue_.empty()) {
        if (!blocking_sync_) {
          lock.unlock();
          return WaitIssued(Enqueue(seq, kind, OpFn(fn)));
        }
        sync_waiting_ = true;
        drained_cv_.wait(lock, [this] { return !executing_ && queue_.empty(); });
        sync_waiting_ = false;
        if (broken_) return absl::FailedPreconditionError(BrokenMessage());
      }
      executing_ = true;
    }
    absl::Status s = Execute(seq, kind, fn, blocking_sync_);
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      executing_ = false;
      wake = !queue_.empty();
    }
    // Only the progress thread waits on queue_cv_, and only for work: waking it after
    // every sync call would cost a context switch per call.
    if (wake) queue_cv_.notify_all();
    return s;
  }

  // Runs one operation; the caller holds `executing_` (or is RunNow's fast path, with no async
  // operation pending).
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

  void WorkerLoop() {
    while (true) {
      std::shared_ptr<Op> op;
      bool broken;
      {
        std::unique_lock<std::mutex> lock(mu_);
        // Idle, or a sync call runs on the caller's thread: wake every watch period to
        // check that call's deadline (nobody notifies for a sync call; that would cost a
        // context switch per call).
        while (!(stopping_ || (!queue_.empty() && !executing_))) {
          if (queue_cv_.wait_for(lock, watch_period_) == std::cv_status::timeout) {
            lock.unlock();
            AnswerAsks();
            CheckWatchedCall();
            lock.lock();
          }
        }
        if (queue_.empty()) return;  // stopping
        op = std::move(queue_.front());
        queue_.pop_front();
        broken = broken_;
        executing_ = true;
      }
      absl::Status status = broken ? absl::FailedPreconditionError(BrokenMessage())
                                   : Execute(op->seq, op->kind, op->run);
      bool drained;
      {
        std::lock_guard<std::mutex> lock(mu_);
        executing_ = false;
        pending_.fetch_sub(1, std::memory_order_release);
        drained = sync_waiting_ && queue_.empty();
      }
      if (drained) drained_cv_.notify_all();
      op->Finish(std::move(status));
    }
  }

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
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<Op>> queue_;  // guarded by mu_
  bool stopping_ = false;                  // guarded by mu_
  bool executing_ = false;                 // guarded by mu_; an operation is running
  // Async operations queued or running: incremented by the caller's thread when it queues
  // one, decremented (release) by the progress thread when one is done.
  std::atomic<int64_t> pending_{0};
  // A blocking sync call waits on drained_cv_ for the queue to empty (guarded by mu_).
  bool sync_waiting_ = false;
  std::condition_variable drained_cv_;
  // Written under mu_ by whoever executes; read by the destructor after the join.
  bool broken_ = false;
  std::string broken_reason_;  // guarded by mu_
  // Used only by whoever holds executing_.
  std::unique_ptr<Scratch> scratch_;
  // Where this rank is (the operation running or last run), for other ranks' asks.
  std::atomic<int64_t> position_seq_{-1};
  std::atomic<int64_t> position_kind_{0};
  std::atomic<bool> in_operation_{false};
  std::vector<int> world_rank_;  // this communicator's rank q -> MPI_COMM_WORLD rank
  // One asker or answerer at a time; the send buffers of asks and answers (never freed: a
  // send may be pending towards a peer that is gone).
  std::mutex board_mu_;
  std::deque<int64_t> asks_;                    // guarded by board_mu_
  std::deque<std::array<int64_t, 3>> answers_;  // guarded by board_mu_
  std::thread worker_;
};

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
