#include "collectives/mpi_backend.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "collectives/op_descriptor.h"
#include "core/half.h"
#include "core/status.h"

namespace gradsum {
namespace {

using collectives_internal::OpDescriptor;
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
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
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
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kBF16: return MPI_UINT16_T;  // moved as bits; reduced via fp32 (below)
    case DType::kF16: return MPI_UINT16_T;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
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

// ---- Local argument checks (before any exchange, so only the offending rank fails). ----

absl::Status CheckDType(DType t) {
  if (!IsValidDType(static_cast<int>(t))) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid dtype value ", static_cast<int>(t)));
  }
  return absl::OkStatus();
}

absl::Status CheckFitsInt(size_t v, absl::string_view what) {
  if (v > static_cast<size_t>(INT_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " = ", v, " exceeds the MPI backend's per-call limit of ", INT_MAX, " elements"));
  }
  return absl::OkStatus();
}

absl::Status CheckBuffer(const void* p, size_t count, absl::string_view what) {
  if (p == nullptr && count > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " buffer is null with ", count, " elements"));
  }
  return absl::OkStatus();
}

bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

// Scratch memory of one operation. MPI may still write into it after a timeout (a late
// peer completes the request), so a timed-out operation's scratch is never freed.
struct Scratch {
  std::vector<int64_t> i64a, i64b, i64c;
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
  absl::Time deadline;
  std::unique_ptr<Scratch> scratch = std::make_unique<Scratch>();
  std::string label;          // "mpi all_reduce #3 (rank 1 of 4)"
  bool breaks_comm = false;   // set when the communicator must not be used again
  bool leak_scratch = false;  // set when MPI may still write into the scratch
};

using OpFn = std::function<absl::Status(OpContext&)>;

struct Op {
  Kind kind;
  int64_t seq = 0;  // issue order on this rank, counting calls that failed locally
  OpFn run;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;     // guarded by mu
  absl::Status status;   // written before done is set

  void Finish(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu);
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
      return absl::DeadlineExceededError(absl::StrCat(
          "mpi ", KindName(op_->kind), " still in flight after waiting ",
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

 private:
  std::shared_ptr<Op> op_;
};

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (frees it on destruction unless the communicator broke).
  MpiCommunicator(MPI_Comm comm, MpiBackendOptions options) : comm_(comm), options_(options) {
    CallMpi([&] { return MPI_Comm_rank(comm_, &rank_); });
    CallMpi([&] { return MPI_Comm_size(comm_, &size_); });
    CallMpi([&] { return MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN); });
    worker_ = std::thread([this] { WorkerLoop(); });
  }

  ~MpiCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    queue_cv_.notify_one();
    worker_.join();  // after running what was already issued
    int finalized = 0;
    MPI_Finalized(&finalized);
    // A broken communicator may have requests in flight; freeing it could block or let
    // MPI touch freed state, so it is left to MPI_Finalize.
    if (!finalized && !broken_) CallMpi([&] { return MPI_Comm_free(&comm_); });
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  absl::Duration timeout() const override { return options_.timeout; }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv,
                                                       size_t count, DType dtype,
                                                       ReduceOp op) override {
    const int64_t seq = next_seq_++;
    return PoisonIfInvalid(seq, Kind::kAllReduce,
                           IssueAllReduce(seq, send, recv, count, dtype, op));
  }

  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    const int64_t seq = next_seq_++;
    return PoisonIfInvalid(seq, Kind::kReduceScatter,
                           IssueReduceScatter(seq, send, recv, recv_count, dtype, op));
  }

  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    const int64_t seq = next_seq_++;
    return PoisonIfInvalid(seq, Kind::kAllGather,
                           IssueAllGather(seq, send, recv, send_count, dtype));
  }

  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts,
      absl::Span<const size_t> send_offsets, void* recv, absl::Span<const size_t> recv_counts,
      absl::Span<const size_t> recv_offsets, DType dtype) override {
    const int64_t seq = next_seq_++;
    return PoisonIfInvalid(seq, Kind::kAllToAllV,
                           IssueAllToAllV(seq, send, send_counts, send_offsets, recv,
                                          recv_counts, recv_offsets, dtype));
  }

  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    const int64_t seq = next_seq_++;
    return PoisonIfInvalid(seq, Kind::kBroadcast, IssueBroadcast(seq, buf, count, dtype, root));
  }

  // The descriptor all-reduce already waits for every rank, so it is the barrier.
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
    const int64_t seq = next_seq_++;
    const OpDescriptor d{Kind::kBarrier, DType::kF32, ReduceOp::kSum, 0, -1};
    return Enqueue(seq, d.kind, [=](OpContext& ctx) { return Agree(ctx, d); });
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    const int64_t seq = next_seq_++;
    auto result = std::make_shared<absl::StatusOr<std::unique_ptr<Communicator>>>(nullptr);
    const OpDescriptor d{Kind::kSplit, DType::kF32, ReduceOp::kSum, 0, -1};
    // Runs on the progress thread so that it is ordered after earlier async operations.
    absl::StatusOr<std::unique_ptr<Work>> work =
        Enqueue(seq, d.kind, [=](OpContext& ctx) -> absl::Status {
          GRADSUM_RETURN_IF_ERROR(Agree(ctx, d));
          // Every rank has arrived (the descriptor exchange completed), so the blocking
          // split cannot wait on an absent rank.
          MPI_Comm child = MPI_COMM_NULL;
          const int rc = CallMpi([&] {
            return MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child);
          });
          if (rc != MPI_SUCCESS) {
            ctx.breaks_comm = true;
            return MpiError(rc, ctx.label);
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
  absl::StatusOr<std::unique_ptr<Work>> IssueAllReduce(int64_t seq, const void* send, void* recv,
                                                       size_t count, DType dtype, ReduceOp op) {
    GRADSUM_RETURN_IF_ERROR(CheckDType(dtype));
    GRADSUM_RETURN_IF_ERROR(CheckReduceOp(op, dtype, /*allow_max=*/true));
    GRADSUM_RETURN_IF_ERROR(CheckFitsInt(count, "all-reduce count"));
    GRADSUM_RETURN_IF_ERROR(CheckBuffer(send, count, "all-reduce send"));
    GRADSUM_RETURN_IF_ERROR(CheckBuffer(recv, count, "all-reduce recv"));
    if (send != recv && Overlaps(send, count * DTypeSize(dtype), recv, count * DTypeSize(dtype))) {
      return absl::InvalidArgumentError(
          "all-reduce send and recv overlap without being equal (in place is send == recv)");
    }
    const OpDescriptor d{Kind::kAllReduce, dtype, op, static_cast<int64_t>(count), -1};
    return Enqueue(seq, d.kind, [=](OpContext& ctx) -> absl::Status {
      GRADSUM_RETURN_IF_ERROR(Agree(ctx, d));
      // Large buffers go in chunks, one MPI_Iallreduce each, so that the fp32 staging of
      // bf16/f16 stays small and in cache between widening, reducing and narrowing.
      const size_t esize = DTypeSize(dtype);
      for (size_t begin = 0; begin < count; begin += kAllReduceChunk) {
        const size_t len = std::min(kAllReduceChunk, count - begin);
        const int n = static_cast<int>(len);
        const void* chunk_send = static_cast<const unsigned char*>(send) + begin * esize;
        void* chunk_recv = static_cast<unsigned char*>(recv) + begin * esize;
        MPI_Request req;
        if (IsHalf(dtype)) {
          std::vector<float>& acc = ctx.scratch->f32a;
          acc.resize(len);
          Widen(chunk_send, dtype, len, acc.data());
          GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] {
            return MPI_Iallreduce(MPI_IN_PLACE, acc.data(), n, MPI_FLOAT, MpiOp(op), comm_, &req);
          }));
          GRADSUM_RETURN_IF_ERROR(Await(ctx, &req));
          if (op == ReduceOp::kAvg) DivideNative(acc.data(), len, DType::kF32, size_);
          Narrow(acc.data(), dtype, len, chunk_recv);
          continue;
        }
        const void* in = send == recv ? MPI_IN_PLACE : chunk_send;
        GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] {
          return MPI_Iallreduce(in, chunk_recv, n, MoveType(dtype), MpiOp(op), comm_, &req);
        }));
        GRADSUM_RETURN_IF_ERROR(Await(ctx, &req));
        if (op == ReduceOp::kAvg) DivideNative(chunk_recv, len, dtype, size_);
      }
      return absl::OkStatus();
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> IssueReduceScatter(int64_t seq, const void* send,
                                                           void* recv, size_t recv_count,
                                                           DType dtype, ReduceOp op) {
    GRADSUM_RETURN_IF_ERROR(CheckDType(dtype));
    GRADSUM_RETURN_IF_ERROR(CheckReduceOp(op, dtype, /*allow_max=*/false));
    GRADSUM_ASSIGN_OR_RETURN(
        const bool in_place,
        CheckBlockLayout(send, recv, recv_count, dtype, "reduce-scatter", "recv", "send"));
    const size_t send_count = recv_count * static_cast<size_t>(size_);
    const size_t esize = DTypeSize(dtype);
    const OpDescriptor d{Kind::kReduceScatter, dtype, op, static_cast<int64_t>(recv_count), -1};
    return Enqueue(seq, d.kind, [=](OpContext& ctx) -> absl::Status {
      GRADSUM_RETURN_IF_ERROR(Agree(ctx, d));
      if (recv_count == 0) return absl::OkStatus();
      const int n = static_cast<int>(recv_count);
      MPI_Request req;
      if (IsHalf(dtype)) {
        std::vector<float>& in = ctx.scratch->f32a;
        std::vector<float>& out = ctx.scratch->f32b;
        in.resize(send_count);
        out.resize(recv_count);
        Widen(send, dtype, send_count, in.data());
        GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] {
          return MPI_Ireduce_scatter_block(in.data(), out.data(), n, MPI_FLOAT, MPI_SUM, comm_,
                                           &req);
        }));
        GRADSUM_RETURN_IF_ERROR(Await(ctx, &req));
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
      GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] {
        return MPI_Ireduce_scatter_block(send, out, n, MoveType(dtype), MPI_SUM, comm_, &req);
      }));
      GRADSUM_RETURN_IF_ERROR(Await(ctx, &req));
      if (op == ReduceOp::kAvg) DivideNative(out, recv_count, dtype, size_);
      if (out != recv) std::memcpy(recv, out, recv_count * esize);
      return absl::OkStatus();
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> IssueAllGather(int64_t seq, const void* send, void* recv,
                                                       size_t send_count, DType dtype) {
    GRADSUM_RETURN_IF_ERROR(CheckDType(dtype));
    GRADSUM_ASSIGN_OR_RETURN(
        const bool in_place,
        CheckBlockLayout(recv, send, send_count, dtype, "all-gather", "send", "recv"));
    const OpDescriptor d{Kind::kAllGather, dtype, ReduceOp::kSum,
                       static_cast<int64_t>(send_count), -1};
    return Enqueue(seq, d.kind, [=](OpContext& ctx) -> absl::Status {
      GRADSUM_RETURN_IF_ERROR(Agree(ctx, d));
      if (send_count == 0) return absl::OkStatus();
      const void* in = in_place ? MPI_IN_PLACE : send;
      const int n = static_cast<int>(send_count);
      MPI_Request req;
      GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] {
        return MPI_Iallgather(in, n, MoveType(dtype), recv, n, MoveType(dtype), comm_, &req);
      }));
      return Await(ctx, &req);
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> IssueAllToAllV(
      int64_t seq, const void* send, absl::Span<const size_t> send_counts,
      absl::Span<const size_t> send_offsets, void* recv, absl::Span<const size_t> recv_counts,
      absl::Span<const size_t> recv_offsets, DType dtype) {
    GRADSUM_RETURN_IF_ERROR(CheckDType(dtype));
    const size_t world = static_cast<size_t>(size_);
    for (auto [span, name] : {std::pair(send_counts, "send_counts"),
                              std::pair(send_offsets, "send_offsets"),
                              std::pair(recv_counts, "recv_counts"),
                              std::pair(recv_offsets, "recv_offsets")}) {
      if (span.size() != world) {
        return absl::InvalidArgumentError(absl::StrCat(
            "all-to-all-v ", name, " has ", span.size(), " entries, expected size() = ", world));
      }
      for (size_t p = 0; p < world; ++p) {
        GRADSUM_RETURN_IF_ERROR(
            CheckFitsInt(span[p], absl::StrCat("all-to-all-v ", name, "[", p, "]")));
      }
    }
    size_t send_total = 0, recv_total = 0;
    for (size_t p = 0; p < world; ++p) {
      send_total += send_counts[p];
      recv_total += recv_counts[p];
    }
    GRADSUM_RETURN_IF_ERROR(CheckBuffer(send, send_total, "all-to-all-v send"));
    GRADSUM_RETURN_IF_ERROR(CheckBuffer(recv, recv_total, "all-to-all-v recv"));
    GRADSUM_RETURN_IF_ERROR(CheckAllToAllVBlocks(send, send_counts, send_offsets, recv,
                                                 recv_counts, recv_offsets, DTypeSize(dtype)));
    auto to_ints = [](absl::Span<const size_t> s) { return std::vector<int>(s.begin(), s.end()); };
    std::vector<int> sc = to_ints(send_counts), sd = to_ints(send_offsets);
    std::vector<int> rc = to_ints(recv_counts), rd = to_ints(recv_offsets);
    const OpDescriptor d{Kind::kAllToAllV, dtype, ReduceOp::kSum, 0, -1};
    return Enqueue(seq, d.kind, [=](OpContext& ctx) -> absl::Status {
      GRADSUM_RETURN_IF_ERROR(Agree(ctx, d));
      GRADSUM_RETURN_IF_ERROR(AgreeOnCounts(ctx, sc, rc));
      Scratch& s = *ctx.scratch;
      s.send_counts = sc;
      s.send_displs = sd;
      s.recv_counts = rc;
      s.recv_displs = rd;
      MPI_Request req;
      GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] {
        return MPI_Ialltoallv(send, s.send_counts.data(), s.send_displs.data(), MoveType(dtype),
                              recv, s.recv_counts.data(), s.recv_displs.data(), MoveType(dtype),
                              comm_, &req);
      }));
      return Await(ctx, &req);
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> IssueBroadcast(int64_t seq, void* buf, size_t count,
                                                       DType dtype, int root) {
    GRADSUM_RETURN_IF_ERROR(CheckDType(dtype));
    if (root < 0 || root >= size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("broadcast root ", root, " is outside [0, ", size_, ")"));
    }
    GRADSUM_RETURN_IF_ERROR(CheckFitsInt(count, "broadcast count"));
    GRADSUM_RETURN_IF_ERROR(CheckBuffer(buf, count, "broadcast"));
    const OpDescriptor d{Kind::kBroadcast, dtype, ReduceOp::kSum, static_cast<int64_t>(count),
                       root};
    return Enqueue(seq, d.kind, [=](OpContext& ctx) -> absl::Status {
      GRADSUM_RETURN_IF_ERROR(Agree(ctx, d));
      if (count == 0) return absl::OkStatus();
      MPI_Request req;
      GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] {
        return MPI_Ibcast(buf, static_cast<int>(count), MoveType(dtype), root, comm_, &req);
      }));
      return Await(ctx, &req);
    });
  }

  static absl::Status CheckReduceOp(ReduceOp op, DType dtype, bool allow_max) {
    if (op != ReduceOp::kSum && op != ReduceOp::kAvg && op != ReduceOp::kMax) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid reduce op value ", static_cast<int>(op)));
    }
    if (op == ReduceOp::kMax && !allow_max) {
      return absl::InvalidArgumentError("reduce-scatter supports sum and avg, not max");
    }
    if (op == ReduceOp::kAvg && !IsFloating(dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("avg needs a floating dtype, got ", DTypeName(dtype)));
    }
    return absl::OkStatus();
  }

  // Receive blocks must not overlap each other, and nothing sent may overlap anything
  // received (MPI_Ialltoallv has no in-place form with separate send data).
  static absl::Status CheckAllToAllVBlocks(const void* send, absl::Span<const size_t> send_counts,
                                           absl::Span<const size_t> send_offsets, void* recv,
                                           absl::Span<const size_t> recv_counts,
                                           absl::Span<const size_t> recv_offsets, size_t esize) {
    const size_t n = send_counts.size();
    std::vector<std::pair<size_t, size_t>> recv_ranges;
    for (size_t p = 0; p < n; ++p) {
      if (recv_counts[p] > 0) {
        recv_ranges.push_back({recv_offsets[p], recv_offsets[p] + recv_counts[p]});
      }
    }
    std::sort(recv_ranges.begin(), recv_ranges.end());
    for (size_t i = 1; i < recv_ranges.size(); ++i) {
      if (recv_ranges[i].first < recv_ranges[i - 1].second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "all-to-all-v recv blocks overlap: [", recv_ranges[i - 1].first, ", ",
            recv_ranges[i - 1].second, ") and [", recv_ranges[i].first, ", ",
            recv_ranges[i].second, ")"));
      }
    }
    const auto* s = static_cast<const unsigned char*>(send);
    const auto* r = static_cast<const unsigned char*>(recv);
    for (size_t p = 0; p < n; ++p) {
      for (size_t q = 0; q < n; ++q) {
        if (Overlaps(s + send_offsets[p] * esize, send_counts[p] * esize,
                     r + recv_offsets[q] * esize, recv_counts[q] * esize)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "all-to-all-v send block for peer ", p, " overlaps recv block from peer ", q,
              " (in place is not supported)"));
        }
      }
    }
    return absl::OkStatus();
  }

  // Reduce-scatter and all-gather: `full` holds size() blocks of `block_count` elements and
  // `block` is this rank's one. Returns whether the call is in place (block == full +
  // rank * block_count, NCCL's convention); any other overlap is InvalidArgument.
  absl::StatusOr<bool> CheckBlockLayout(const void* full, const void* block, size_t block_count,
                                        DType dtype, absl::string_view op,
                                        absl::string_view block_name,
                                        absl::string_view full_name) const {
    GRADSUM_RETURN_IF_ERROR(CheckFitsInt(block_count, absl::StrCat(op, " ", block_name, "_count")));
    const size_t full_count = block_count * static_cast<size_t>(size_);
    GRADSUM_RETURN_IF_ERROR(CheckBuffer(full, full_count, absl::StrCat(op, " ", full_name)));
    GRADSUM_RETURN_IF_ERROR(CheckBuffer(block, block_count, absl::StrCat(op, " ", block_name)));
    const size_t esize = DTypeSize(dtype);
    const bool in_place =
        block == static_cast<const unsigned char*>(full) + rank_ * block_count * esize;
    if (!in_place && Overlaps(full, full_count * esize, block, block_count * esize)) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, " buffers overlap; in place needs ", block_name, " == ", full_name, " + rank * ",
          block_name, "_count (rank ", rank_, ")"));
    }
    return in_place;
  }

  // A call that failed its local checks still takes part in the descriptor exchange, marked
  // invalid, so its peers fail the same operation with InvalidArgument naming this rank
  // instead of waiting for it, and later operations still line up. The local checks are
  // the only source of InvalidArgument before Enqueue (which fails only with
  // FailedPrecondition), so that code identifies them.
  absl::StatusOr<std::unique_ptr<Work>> PoisonIfInvalid(
      int64_t seq, Kind kind, absl::StatusOr<std::unique_ptr<Work>> issued) {
    if (issued.ok() || issued.status().code() != absl::StatusCode::kInvalidArgument) {
      return issued;
    }
    OpDescriptor d;
    d.kind = kind;
    d.invalid_rank = rank_;
    // The exchange runs in the background; its outcome is this call's local error.
    Enqueue(seq, kind, [=](OpContext& ctx) { return Agree(ctx, d); }).IgnoreError();
    return issued.status();
  }

  // Elements per MPI_Iallreduce of a large all-reduce (4 MiB of f32).
  static constexpr size_t kAllReduceChunk = size_t{1} << 20;

  // AVG is reduced as SUM and divided afterwards.
  static MPI_Op MpiOp(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }

  absl::StatusOr<std::unique_ptr<Work>> Enqueue(int64_t seq, Kind kind, OpFn fn) {
    auto op = std::make_shared<Op>();
    op->kind = kind;
    op->seq = seq;
    op->run = std::move(fn);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "mpi communicator is unusable after an earlier failure: ", broken_reason_));
      }
      queue_.push_back(op);
    }
    queue_cv_.notify_one();
    return std::unique_ptr<Work>(new MpiWork(std::move(op)));
  }

  void WorkerLoop() {
    while (true) {
      std::shared_ptr<Op> op;
      std::string broken_reason;
      {
        std::unique_lock<std::mutex> lock(mu_);
        queue_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping
        op = std::move(queue_.front());
        queue_.pop_front();
        if (broken_) broken_reason = broken_reason_;
      }
      absl::Status status;
      if (!broken_reason.empty()) {
        status = absl::FailedPreconditionError(absl::StrCat(
            "mpi communicator is unusable after an earlier failure: ", broken_reason));
      } else {
        OpContext ctx;
        ctx.seq = op->seq;
        ctx.deadline = absl::Now() + options_.timeout;
        ctx.label = absl::StrFormat("mpi %s #%d (rank %d of %d)", KindName(op->kind), ctx.seq,
                                    rank_, size_);
        status = op->run(ctx);
        if (ctx.leak_scratch) LeakForever(std::move(ctx.scratch));
        if (ctx.breaks_comm) {
          std::lock_guard<std::mutex> lock(mu_);
          broken_ = true;
          broken_reason_ = std::string(status.message());
        }
      }
      op->Finish(std::move(status));
    }
  }

  // Starts a non-blocking MPI call; an error breaks the communicator.
  template <typename F>
  absl::Status Post(OpContext& ctx, F&& start) {
    const int rc = CallMpi(start);
    if (rc != MPI_SUCCESS) {
      ctx.breaks_comm = true;
      return MpiError(rc, ctx.label);
    }
    return absl::OkStatus();
  }

  // Polls `req` until it completes or the operation's deadline passes. Spins (yielding
  // the core) while young, since MPI only progresses inside MPI calls; backs off to short
  // sleeps once a peer is clearly late, so a waiting rank does not burn a shared core.
  absl::Status Await(OpContext& ctx, MPI_Request* req) {
    const absl::Time start = absl::Now();
    for (int polls = 0;; ++polls) {
      int done = 0;
      const int rc = CallMpi([&] { return MPI_Test(req, &done, MPI_STATUS_IGNORE); });
      if (rc != MPI_SUCCESS) {
        ctx.breaks_comm = true;
        ctx.leak_scratch = true;
        return MpiError(rc, ctx.label);
      }
      if (done) return absl::OkStatus();
      const absl::Time now = absl::Now();
      if (now >= ctx.deadline) {
        ctx.breaks_comm = true;
        ctx.leak_scratch = true;  // the request stays in flight; MPI cannot cancel it
        return absl::DeadlineExceededError(absl::StrCat(
            ctx.label, ": not every rank arrived within the timeout of ",
            absl::FormatDuration(options_.timeout),
            "; the communicator is now unusable"));
      }
      if (now - start > absl::Milliseconds(500)) {
        absl::SleepFor(absl::Microseconds(200));
      } else if (polls >= 64) {
        std::this_thread::yield();
      }
    }
  }

  // Every rank all-reduces (d, -d) with MIN, learning each field's min and max; a field
  // whose min and max differ is a disagreement that every rank reports identically.
  absl::Status Agree(OpContext& ctx, const OpDescriptor& d) {
    std::vector<int64_t>& buf = ctx.scratch->i64a;
    buf.resize(collectives_internal::kDescriptorWords);
    collectives_internal::EncodeDescriptor(d, buf.data());
    MPI_Request req;
    GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] {
      return MPI_Iallreduce(MPI_IN_PLACE, buf.data(), collectives_internal::kDescriptorWords,
                            MPI_INT64_T, MPI_MIN, comm_, &req);
    }));
    GRADSUM_RETURN_IF_ERROR(Await(ctx, &req));
    return collectives_internal::CheckDescriptorAgreed(d, buf.data(), ctx.label);
  }

  // All-to-all-v: rank r's send_counts[p] must equal rank p's recv_counts[r]. Each rank
  // learns what its peers will send it (MPI_Ialltoall), then all ranks all-gather the
  // first mismatch each one saw, so every rank fails with the same message.
  absl::Status AgreeOnCounts(OpContext& ctx, const std::vector<int>& send_counts,
                             const std::vector<int>& recv_counts) {
    Scratch& s = *ctx.scratch;
    s.i64a.assign(send_counts.begin(), send_counts.end());  // what I send to each peer
    s.i64b.assign(size_, 0);                                 // what each peer sends me
    MPI_Request req;
    GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] {
      return MPI_Ialltoall(s.i64a.data(), 1, MPI_INT64_T, s.i64b.data(), 1, MPI_INT64_T, comm_,
                           &req);
    }));
    GRADSUM_RETURN_IF_ERROR(Await(ctx, &req));
    const std::vector<int64_t> expected(recv_counts.begin(), recv_counts.end());
    s.i64a.assign(3, 0);
    collectives_internal::MakeCountReport(s.i64b, expected, s.i64a.data());
    s.i64c.assign(3 * static_cast<size_t>(size_), 0);
    GRADSUM_RETURN_IF_ERROR(Post(ctx, [&] {
      return MPI_Iallgather(s.i64a.data(), 3, MPI_INT64_T, s.i64c.data(), 3, MPI_INT64_T, comm_,
                            &req);
    }));
    GRADSUM_RETURN_IF_ERROR(Await(ctx, &req));
    return collectives_internal::CheckCountReports(s.i64c, ctx.label);
  }

  MPI_Comm comm_;
  const MpiBackendOptions options_;
  int rank_ = 0;
  int size_ = 0;
  // Numbers every operation call (for messages). Caller's thread only.
  int64_t next_seq_ = 0;

  std::mutex mu_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<Op>> queue_;  // guarded by mu_
  bool stopping_ = false;                  // guarded by mu_
  // Written under mu_ by the progress thread; read by the destructor after the join.
  bool broken_ = false;
  std::string broken_reason_;  // guarded by mu_
  std::thread worker_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorldCommunicator(
    MpiBackendOptions options) {
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mpi backend timeout must be positive, got ", absl::FormatDuration(options.timeout)));
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
      return absl::DeadlineExceededError(absl::StrCat(
          "CreateMpiWorldCommunicator: not every process arrived within ",
          absl::FormatDuration(options.timeout)));
    }
    if (!done) std::this_thread::yield();
  }
  return std::unique_ptr<Communicator>(new MpiCommunicator(dup, options));
}

}  // namespace gradsum
