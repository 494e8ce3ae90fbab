#include "collectives/nccl_backend.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "collectives/checked_communicator.h"
#include "collectives/device_stream.h"
#include "collectives/op_descriptor.h"
#include "core/status.h"

namespace gradsum {
namespace {

using collectives_internal::MakeCall;
using collectives_internal::OpCall;
using collectives_internal::OpKind;
using collectives_internal::OpKindName;

static_assert(std::is_same_v<cudaStream_t, CUstream_st*>,
              "DeviceStream::stream() hands out cudaStream_t as CUstream_st*");

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  return absl::InternalError(
      absl::StrCat(what, ": CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

#define GRADSUM_CUDA_RETURN(expr, what)          \
  do {                                           \
    cudaError_t gradsum_cuda_err_ = (expr);      \
    if (gradsum_cuda_err_ != cudaSuccess) {      \
      return CudaError(gradsum_cuda_err_, what); \
    }                                            \
  } while (0)

ncclDataType_t NcclType(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF64:
      return ncclFloat64;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

// Every entry point checks for a usable device first, so that a machine without a GPU
// gets FailedPrecondition with CUDA's reason rather than an NCCL failure deep inside.
absl::Status CheckDevice(int* device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl backend: no usable CUDA device: ", cudaGetErrorString(e)));
  }
  if (count == 0) {
    return absl::FailedPreconditionError("nccl backend: no usable CUDA device (count is 0)");
  }
  if (*device < 0) GRADSUM_CUDA_RETURN(cudaGetDevice(device), "cudaGetDevice");
  if (*device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl backend: device ", *device, " is outside [0, ", count, ")"));
  }
  return absl::OkStatus();
}

// Completion of one operation or of one coalesced group.
struct Completion {
  cudaEvent_t event = nullptr;  // null until the operation (or its group) is launched
  absl::Time issued;
  ~Completion() {
    if (event != nullptr) cudaEventDestroy(event);
  }
};

// A CUDA event recorded on the communicator's stream (DeviceStream::RecordMarker).
class CudaMarker final : public StreamMarker {
 public:
  ~CudaMarker() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  static absl::StatusOr<std::unique_ptr<StreamMarker>> Record(int device, cudaStream_t stream) {
    GRADSUM_CUDA_RETURN(cudaSetDevice(device), "cudaSetDevice");
    auto m = std::make_unique<CudaMarker>();
    GRADSUM_CUDA_RETURN(cudaEventCreate(&m->event_), "cudaEventCreate");
    GRADSUM_CUDA_RETURN(cudaEventRecord(m->event_, stream), "cudaEventRecord");
    return std::unique_ptr<StreamMarker>(std::move(m));
  }
  bool Reached() override { return cudaEventQuery(event_) == cudaSuccess; }
  absl::StatusOr<absl::Duration> ElapsedSince(StreamMarker& start) override {
    // Markers come from one DeviceStream, so `start` is a CudaMarker too.
    const cudaEvent_t from = static_cast<CudaMarker&>(start).event_;
    float ms = 0;
    cudaError_t e = cudaEventSynchronize(event_);
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, from, event_);
    if (e != cudaSuccess) {
      cudaGetLastError();  // an aborted operation: clear the error, report it
      return CudaError(e, "timing an nccl operation");
    }
    return absl::Microseconds(static_cast<int64_t>(ms * 1000.0f));
  }

 private:
  cudaEvent_t event_ = nullptr;
};

class NcclCommunicatorImpl;

class NcclWork final : public Work {
 public:
  NcclWork(NcclCommunicatorImpl* comm, std::shared_ptr<Completion> c)
      : comm_(comm), c_(std::move(c)) {}
  absl::Status Wait(absl::Duration timeout) override;
  bool IsCompleted() override;

 private:
  NcclCommunicatorImpl* comm_;
  std::shared_ptr<Completion> c_;
};

// The backend moves data only; agreement is the decorator's (CreateNcclCommunicator).
class NcclCommunicatorImpl final : public Communicator, public DeviceStream {
 public:
  // Takes ownership of `comm`; creates the stream and the barrier's scratch word.
  static absl::StatusOr<std::unique_ptr<NcclCommunicatorImpl>> Wrap(ncclComm_t comm, int device,
                                                                    NcclBackendOptions options) {
    std::unique_ptr<NcclCommunicatorImpl> c(new NcclCommunicatorImpl(comm, device, options));
    GRADSUM_CUDA_RETURN(cudaSetDevice(device), "cudaSetDevice");
    GRADSUM_CUDA_RETURN(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking),
                        "cudaStreamCreate");
    int rank = 0, size = 0;
    GRADSUM_RETURN_IF_ERROR(c->CheckNccl(ncclCommUserRank(comm, &rank), "ncclCommUserRank"));
    GRADSUM_RETURN_IF_ERROR(c->CheckNccl(ncclCommCount(comm, &size), "ncclCommCount"));
    c->rank_ = rank;
    c->size_ = size;
    GRADSUM_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&c->device_scratch_), sizeof(int64_t)),
                        "cudaMalloc");
    return c;
  }

  ~NcclCommunicatorImpl() override {
    cudaSetDevice(device_);
    if (!aborted_) {
      // Flush what was issued, then free. A communicator that fails to finalise in time is
      // aborted instead, so destruction never hangs on an absent peer.
      if (stream_ != nullptr) cudaStreamSynchronize(stream_);
      ncclResult_t r = ncclCommFinalize(comm_);
      const absl::Time deadline = absl::Now() + options_.timeout;
      while (r == ncclSuccess || r == ncclInProgress) {
        ncclResult_t state = ncclSuccess;
        ncclCommGetAsyncError(comm_, &state);
        if (state != ncclInProgress) break;
        if (absl::Now() >= deadline) {
          r = ncclInternalError;
          break;
        }
        std::this_thread::yield();
      }
      if (r == ncclSuccess || r == ncclInProgress) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (device_scratch_ != nullptr) cudaFree(device_scratch_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  absl::Duration timeout() const override { return options_.timeout; }
  DeviceStream* device_stream() override { return this; }

  // ---- DeviceStream. ----

  CUstream_st* stream() const override { return stream_; }
  int device() const override { return device_; }
  bool coalescing() const override { return group_ != nullptr; }
  absl::StatusOr<std::unique_ptr<StreamMarker>> RecordMarker() override {
    return CudaMarker::Record(device_, stream_);
  }

  // Memory the GPU cannot address as device memory is invalid.
  absl::Status CheckBuffer(const void* p) const override {
    cudaPointerAttributes attr;
    const cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state of this query
      return absl::InvalidArgumentError(
          absl::StrCat("is not CUDA memory: ", cudaGetErrorString(e)));
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return absl::InvalidArgumentError("is host memory; the nccl backend needs device memory");
    }
    return absl::OkStatus();
  }

  // ---- Communicator. ----

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_RETURN_IF_ERROR(Validate(MakeCall(OpKind::kAllReduce, send, recv, count, dtype, op)));
    return Issue(seq, OpKind::kAllReduce, [&] {
      return ncclAllReduce(send, recv, count, NcclType(dtype), NcclOp(op), comm_, stream_);
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_RETURN_IF_ERROR(
        Validate(MakeCall(OpKind::kReduceScatter, send, recv, recv_count, dtype, op)));
    // In place (recv == send + rank * recv_count) is NCCL's own convention.
    return Issue(seq, OpKind::kReduceScatter, [&] {
      return ncclReduceScatter(send, recv, recv_count, NcclType(dtype), NcclOp(op), comm_, stream_);
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_RETURN_IF_ERROR(Validate(MakeCall(OpKind::kAllGather, send, recv, send_count, dtype)));
    return Issue(seq, OpKind::kAllGather, [&] {
      return ncclAllGather(send, recv, send_count, NcclType(dtype), comm_, stream_);
    });
  }

  // Grouped ncclSend/ncclRecv, one pair per peer with a non-zero count.
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_RETURN_IF_ERROR(Validate(collectives_internal::MakeAllToAllVCall(
        send, send_counts, send_offsets, recv, recv_counts, recv_offsets, dtype)));
    const size_t world = static_cast<size_t>(size_);
    const size_t esize = DTypeSize(dtype);
    return Issue(seq, OpKind::kAllToAllV, [&] {
      ncclResult_t r = ncclGroupStart();
      for (size_t p = 0; p < world && r == ncclSuccess; ++p) {
        const int peer = static_cast<int>(p);
        if (send_counts[p] > 0) {
          r = ncclSend(static_cast<const char*>(send) + send_offsets[p] * esize, send_counts[p],
                       NcclType(dtype), peer, comm_, stream_);
        }
        if (r == ncclSuccess && recv_counts[p] > 0) {
          r = ncclRecv(static_cast<char*>(recv) + recv_offsets[p] * esize, recv_counts[p],
                       NcclType(dtype), peer, comm_, stream_);
        }
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_RETURN_IF_ERROR(
        Validate(collectives_internal::MakeBroadcastCall(buf, count, dtype, root)));
    return Issue(seq, OpKind::kBroadcast, [&] {
      return ncclBroadcast(buf, buf, count, NcclType(dtype), root, comm_, stream_);
    });
  }

  // Point-to-point: ncclSend / ncclRecv on the stream. NCCL matches a pair's messages in
  // issue order and has no tags, so only tag 0 is accepted; it does not compare sizes (a
  // mismatch is NCCL's undefined behaviour, unlike the host backends), and a send waits
  // on the stream for its receive: both halves of an exchange between two ranks go in one
  // coalesced group (device_stream()->BeginCoalescing() .. EndCoalescing()), as NCCL's own
  // ncclGroupStart / ncclGroupEnd rule asks.
  absl::StatusOr<std::unique_ptr<Work>> SendAsync(const void* buf, size_t count, DType dtype,
                                                  int peer, int tag) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_RETURN_IF_ERROR(ValidateP2P(/*send=*/true, buf, count, dtype, peer, tag));
    return IssueAs(P2PLabel(true, peer, seq),
                   [&] { return ncclSend(buf, count, NcclType(dtype), peer, comm_, stream_); });
  }
  absl::StatusOr<std::unique_ptr<Work>> RecvAsync(void* buf, size_t count, DType dtype, int peer,
                                                  int tag) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_RETURN_IF_ERROR(ValidateP2P(/*send=*/false, buf, count, dtype, peer, tag));
    return IssueAs(P2PLabel(false, peer, seq),
                   [&] { return ncclRecv(buf, count, NcclType(dtype), peer, comm_, stream_); });
  }

  // A one-element all-reduce on the scratch: it cannot finish before every rank joins.
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    int64_t* word = device_scratch_;
    return Issue(seq, OpKind::kBarrier,
                 [&] { return ncclAllReduce(word, word, 1, ncclInt64, ncclSum, comm_, stream_); });
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    if (group_ != nullptr) {
      return absl::FailedPreconditionError("nccl Split inside an open coalesced group");
    }
    GRADSUM_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    // Earlier operations on the stream must be done before the split's own traffic.
    GRADSUM_RETURN_IF_ERROR(WaitStream(Label(OpKind::kSplit, seq)));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    GRADSUM_RETURN_IF_ERROR(CheckNccl(
        ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config),
        "ncclCommSplit"));
    if (child == nullptr) return std::unique_ptr<Communicator>();
    GRADSUM_RETURN_IF_ERROR(WaitCommReady(child, "ncclCommSplit"));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicatorImpl> c,
                             Wrap(child, device_, options_));
    return std::unique_ptr<Communicator>(std::move(c));
  }

  absl::Status BeginCoalescing() override {
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    if (group_ != nullptr) {
      return absl::FailedPreconditionError("nccl BeginCoalescing: a group is already open");
    }
    GRADSUM_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    GRADSUM_RETURN_IF_ERROR(CheckNccl(ncclGroupStart(), "ncclGroupStart"));
    group_ = std::make_shared<Completion>();
    group_->issued = absl::Now();
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Work>> EndCoalescing() override {
    if (group_ == nullptr) {
      return absl::FailedPreconditionError("nccl EndCoalescing without BeginCoalescing");
    }
    std::shared_ptr<Completion> group = std::move(group_);
    group_ = nullptr;
    GRADSUM_RETURN_IF_ERROR(CheckNccl(ncclGroupEnd(), "ncclGroupEnd"));
    GRADSUM_RETURN_IF_ERROR(Record(*group));
    return std::unique_ptr<Work>(new NcclWork(this, std::move(group)));
  }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceCoalescedAsync(absl::Span<const Buffer> buffers,
                                                                DType dtype, ReduceOp op) override {
    GRADSUM_RETURN_IF_ERROR(BeginCoalescing());
    for (const Buffer& b : buffers) {
      absl::StatusOr<std::unique_ptr<Work>> w = AllReduceAsync(b.send, b.recv, b.count, dtype, op);
      if (!w.ok()) {
        // Close the group so the communicator stays usable; what was enqueued still runs.
        absl::StatusOr<std::unique_ptr<Work>> closed = EndCoalescing();
        if (closed.ok()) (*closed)->Wait(options_.timeout).IgnoreError();
        return w.status();
      }
    }
    return EndCoalescing();
  }

  // ---- Used by NcclWork. ----

  absl::Status WaitCompletion(Completion& c, absl::Duration timeout) {
    if (c.event == nullptr) {
      return absl::FailedPreconditionError(
          "nccl Work waited on inside its open coalesced group; call EndCoalescing first");
    }
    const absl::Time wait_deadline =
        timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
    const absl::Time comm_deadline = c.issued + options_.timeout;
    for (int polls = 0;; ++polls) {
      const cudaError_t e = cudaEventQuery(c.event);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return Fail(CudaError(e, "nccl operation"));
      if (aborted_) return absl::FailedPreconditionError(BrokenMessage());
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        return Fail(
            absl::InternalError(absl::StrCat("nccl asynchronous error: ", ncclGetErrorString(state),
                                             ": ", ncclGetLastError(comm_))));
      }
      const absl::Time now = absl::Now();
      if (now >= comm_deadline) {
        return Fail(absl::DeadlineExceededError(
            absl::StrCat("nccl operation on rank ", rank_, " of ", size_, " did not finish within ",
                         absl::FormatDuration(options_.timeout),
                         " (a rank never arrived?); the communicator was aborted")));
      }
      if (now >= wait_deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("nccl operation still in flight after waiting ",
                         absl::FormatDuration(timeout), "; its buffers must stay alive"));
      }
      if (polls > 64) std::this_thread::yield();
    }
  }

  bool IsCompleted(Completion& c) {
    return c.event != nullptr && cudaEventQuery(c.event) != cudaErrorNotReady;
  }

 private:
  NcclCommunicatorImpl(ncclComm_t comm, int device, NcclBackendOptions options)
      : comm_(comm), device_(device), options_(options) {}

  std::string P2PLabel(bool send, int peer, int64_t seq) const {
    return absl::StrFormat("nccl %s #%d (rank %d of %d)",
                           collectives_internal::PointToPointLabel(send, peer, 0), seq, rank_,
                           size_);
  }

  absl::Status ValidateP2P(bool send, const void* buf, size_t count, DType dtype, int peer,
                           int tag) const {
    GRADSUM_RETURN_IF_ERROR(
        collectives_internal::ValidatePointToPoint(send, buf, count, dtype, peer, tag, size_));
    if (tag != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(collectives_internal::PointToPointLabel(send, peer, tag), ": tag ", tag,
                       ": the nccl backend matches in issue order only and takes tag 0"));
    }
    if (count == 0) return absl::OkStatus();
    absl::Status device = CheckBuffer(buf);
    if (!device.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          collectives_internal::PointToPointLabel(send, peer, tag), " buffer ", device.message()));
    }
    return absl::OkStatus();
  }

  std::string Label(OpKind kind, int64_t seq) const {
    return absl::StrFormat("nccl %s #%d (rank %d of %d)", OpKindName(kind), seq, rank_, size_);
  }

  std::string BrokenMessage() const {
    return absl::StrCat("nccl communicator is unusable after an earlier failure: ", broken_reason_);
  }

  absl::Status CheckUsable() const {
    if (aborted_) return absl::FailedPreconditionError(BrokenMessage());
    return absl::OkStatus();
  }

  // Aborts the communicator (so no rank blocks on it any longer) and returns `s`.
  absl::Status Fail(absl::Status s) {
    if (!aborted_) {
      aborted_ = true;
      broken_reason_ = std::string(s.message());
      ncclCommAbort(comm_);
    }
    return s;
  }

  // The validation every backend shares, then this backend's own rule: every buffer with
  // elements must be device memory (CheckBuffer, which the agreement decorator also runs
  // before its exchange, so that one rank's host buffer fails every rank).
  absl::Status Validate(const OpCall& c) const {
    GRADSUM_RETURN_IF_ERROR(collectives_internal::ValidateCall(c, rank_, size_));
    return collectives_internal::CheckEachBuffer(c, size_,
                                                 [this](const void* p) { return CheckBuffer(p); });
  }

  // NCCL results in non-blocking mode: ncclInProgress means "poll until it settles".
  absl::Status CheckNccl(ncclResult_t r, absl::string_view what) {
    return CheckNcclOn(comm_, r, what);
  }

  absl::Status CheckNcclOn(ncclComm_t comm, ncclResult_t r, absl::string_view what) {
    if (r == ncclInProgress) {
      const absl::Time deadline = absl::Now() + options_.timeout;
      while (r == ncclInProgress) {
        ncclCommGetAsyncError(comm, &r);
        if (r == ncclInProgress && absl::Now() >= deadline) {
          return Fail(absl::DeadlineExceededError(absl::StrCat(
              what, " on rank ", rank_, " still in progress after ",
              absl::FormatDuration(options_.timeout), "; the communicator was aborted")));
        }
        if (r == ncclInProgress) std::this_thread::yield();
      }
    }
    if (r != ncclSuccess) {
      return Fail(absl::InternalError(
          absl::StrCat(what, ": ", ncclGetErrorString(r), ": ", ncclGetLastError(comm))));
    }
    return absl::OkStatus();
  }

  absl::Status WaitCommReady(ncclComm_t comm, absl::string_view what) {
    return CheckNcclOn(comm, ncclInProgress, what);
  }

  // Records a completion event for what was just enqueued.
  absl::Status Record(Completion& c) {
    GRADSUM_CUDA_RETURN(cudaEventCreateWithFlags(&c.event, cudaEventDisableTiming),
                        "cudaEventCreate");
    GRADSUM_CUDA_RETURN(cudaEventRecord(c.event, stream_), "cudaEventRecord");
    return absl::OkStatus();
  }

  // Waits, with the communicator's deadline, until the stream is idle.
  absl::Status WaitStream(const std::string& label) {
    Completion c;
    c.issued = absl::Now();
    GRADSUM_RETURN_IF_ERROR(Record(c));
    return Annotate(WaitCompletion(c, absl::InfiniteDuration()), label);
  }

  // Enqueues `enqueue`'s NCCL calls, returns a Work (the group's inside a coalesced group).
  template <typename F>
  absl::StatusOr<std::unique_ptr<Work>> Issue(int64_t seq, OpKind kind, F&& enqueue) {
    return IssueAs(Label(kind, seq), std::forward<F>(enqueue));
  }
  template <typename F>
  absl::StatusOr<std::unique_ptr<Work>> IssueAs(const std::string& label, F&& enqueue) {
    GRADSUM_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    GRADSUM_RETURN_IF_ERROR(CheckNccl(enqueue(), label));
    if (group_ != nullptr) return std::unique_ptr<Work>(new NcclWork(this, group_));
    auto c = std::make_shared<Completion>();
    c->issued = absl::Now();
    GRADSUM_RETURN_IF_ERROR(Record(*c));
    return std::unique_ptr<Work>(new NcclWork(this, std::move(c)));
  }

  ncclComm_t comm_;
  const int device_;
  const NcclBackendOptions options_;
  int rank_ = 0;
  int size_ = 0;
  cudaStream_t stream_ = nullptr;
  int64_t* device_scratch_ = nullptr;  // one int64, the barrier's
  int64_t next_seq_ = 0;
  std::shared_ptr<Completion> group_;  // non-null while a coalesced group is open
  bool aborted_ = false;
  std::string broken_reason_;
};

absl::Status NcclWork::Wait(absl::Duration timeout) { return comm_->WaitCompletion(*c_, timeout); }
bool NcclWork::IsCompleted() { return comm_->IsCompleted(*c_); }

absl::StatusOr<std::unique_ptr<Communicator>> InitRank(const ncclUniqueId& id, int rank, int world,
                                                       int device,
                                                       const NcclBackendOptions& options) {
  GRADSUM_CUDA_RETURN(cudaSetDevice(device), "cudaSetDevice");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  const absl::Time deadline = absl::Now() + options.timeout;
  while (r == ncclInProgress) {
    ncclCommGetAsyncError(comm, &r);
    if (r == ncclInProgress && absl::Now() >= deadline) {
      ncclCommAbort(comm);
      return absl::DeadlineExceededError(absl::StrCat(
          "ncclCommInitRankConfig: rank ", rank, " of ", world, " still waiting after ",
          absl::FormatDuration(options.timeout), " (did every rank join?)"));
    }
    if (r == ncclInProgress) std::this_thread::yield();
  }
  if (r != ncclSuccess) {
    const std::string detail = comm != nullptr ? ncclGetLastError(comm) : "";
    if (comm != nullptr) ncclCommAbort(comm);
    return absl::InternalError(
        absl::StrCat("ncclCommInitRankConfig: ", ncclGetErrorString(r), ": ", detail));
  }
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicatorImpl> c,
                           NcclCommunicatorImpl::Wrap(comm, device, options));
  return std::unique_ptr<Communicator>(std::move(c));
}

absl::Status CheckOptions(const NcclBackendOptions& options) {
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("nccl backend timeout must be positive, got ",
                                                   absl::FormatDuration(options.timeout)));
  }
  return absl::OkStatus();
}

absl::Status MakeUniqueId(ncclUniqueId* id) {
  const ncclResult_t r = ncclGetUniqueId(id);
  if (r != ncclSuccess) {
    return absl::InternalError(absl::StrCat("ncclGetUniqueId: ", ncclGetErrorString(r)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap,
                                                                     NcclBackendOptions options) {
  GRADSUM_RETURN_IF_ERROR(CheckOptions(options));
  int device = options.device;
  // Every rank still joins the broadcast below, so that one rank's missing GPU does not
  // leave the others waiting: it sends or receives the id and then reports its error.
  absl::Status device_ok = CheckDevice(&device);
  struct {
    int32_t valid = 0;  // 0 when rank 0 could not make an id
    ncclUniqueId id{};
  } message;
  static_assert(sizeof(message) % sizeof(int32_t) == 0, "sent as whole int32 words");
  absl::Status id_ok = absl::OkStatus();
  if (bootstrap.rank() == 0) {
    id_ok = device_ok.ok() ? MakeUniqueId(&message.id) : device_ok;
    message.valid = id_ok.ok() ? 1 : 0;
  }
  GRADSUM_RETURN_IF_ERROR(Annotate(
      bootstrap.Broadcast(&message, sizeof(message) / sizeof(int32_t), DType::kI32, /*root=*/0),
      "broadcasting the ncclUniqueId"));
  // The agreement check's host exchange: a private copy of the bootstrap, split by every
  // rank that joined the broadcast (so before any rank returns its error).
  std::unique_ptr<Communicator> exchange;
  if (options.check_agreement) {
    absl::StatusOr<std::unique_ptr<Communicator>> split = bootstrap.Split(0, bootstrap.rank());
    GRADSUM_RETURN_IF_ERROR(
        Annotate(split.status(), "splitting the bootstrap communicator for the agreement check"));
    exchange = std::move(*split);
  }
  GRADSUM_RETURN_IF_ERROR(id_ok);
  GRADSUM_RETURN_IF_ERROR(device_ok);
  if (message.valid != 1) {
    return absl::FailedPreconditionError(
        "nccl backend: rank 0 of the bootstrap communicator could not create the NCCL id");
  }
  const ncclUniqueId& id = message.id;
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> nccl,
                           InitRank(id, bootstrap.rank(), bootstrap.size(), device, options));
  if (exchange == nullptr) return nccl;
  return WithAgreementCheckOver(std::move(nccl), std::move(exchange));
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicatorFromFile(
    const std::string& id_path, int rank, int world, NcclBackendOptions options) {
  GRADSUM_RETURN_IF_ERROR(CheckOptions(options));
  if (options.check_agreement) {
    return absl::InvalidArgumentError(
        "nccl file bootstrap: no host communicator to check agreement over; set "
        "check_agreement = false (or wrap the result with WithAgreementCheckOver and a host "
        "communicator)");
  }
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl file bootstrap: rank ", rank, " is outside [0, ", world, ")"));
  }
  int device = options.device;
  GRADSUM_RETURN_IF_ERROR(CheckDevice(&device));
  ncclUniqueId id{};
  if (rank == 0) {
    GRADSUM_RETURN_IF_ERROR(MakeUniqueId(&id));
    // Write a private temporary file, then rename: readers see all of it or nothing.
    const std::string tmp = absl::StrCat(id_path, ".tmp.", getpid());
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(id.internal, sizeof(id.internal));
      if (!out.good()) {
        return absl::UnavailableError(absl::StrCat("cannot write the NCCL id to ", tmp));
      }
    }
    if (std::rename(tmp.c_str(), id_path.c_str()) != 0) {
      std::remove(tmp.c_str());
      return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", id_path));
    }
  } else {
    const absl::Time deadline = absl::Now() + options.timeout;
    for (;;) {
      std::ifstream in(id_path, std::ios::binary);
      if (in.read(id.internal, sizeof(id.internal)) && in.gcount() == sizeof(id.internal)) break;
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("rank ", rank, ": no NCCL id appeared at ",
                                                        id_path, " within ",
                                                        absl::FormatDuration(options.timeout)));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  return InitRank(id, rank, world, device, options);
}

}  // namespace gradsum
