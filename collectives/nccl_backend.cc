#include "collectives/nccl_backend.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "collectives/op_descriptor.h"
#include "core/status.h"

namespace gradsum {
namespace {

using collectives_internal::Describe;
using collectives_internal::MakeCall;
using collectives_internal::OpCall;
using collectives_internal::OpDescriptor;
using collectives_internal::OpKind;
using collectives_internal::OpKindName;

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  return absl::InternalError(
      absl::StrCat(what, ": CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

#define GRADSUM_CUDA_RETURN(expr, what)                      \
  do {                                                       \
    cudaError_t gradsum_cuda_err_ = (expr);                  \
    if (gradsum_cuda_err_ != cudaSuccess) {                  \
      return CudaError(gradsum_cuda_err_, what);             \
    }                                                        \
  } while (0)

ncclDataType_t NcclType(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
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

class NcclCommunicatorImpl final : public NcclCommunicator {
 public:
  // Takes ownership of `comm`; creates the stream and the agreement scratch.
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
    // Descriptor (kDescriptorWords), all-to-all counts out and in (2 * size), and the
    // gathered count reports (3 * size + 3 for this rank's own report).
    c->scratch_words_ = collectives_internal::kDescriptorWords + 5 * size + 3;
    const size_t bytes = c->scratch_words_ * sizeof(int64_t);
    GRADSUM_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&c->device_scratch_), bytes),
                        "cudaMalloc");
    GRADSUM_CUDA_RETURN(cudaMallocHost(reinterpret_cast<void**>(&c->host_scratch_), bytes),
                        "cudaMallocHost");
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
    if (host_scratch_ != nullptr) cudaFreeHost(host_scratch_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  absl::Duration timeout() const override { return options_.timeout; }
  cudaStream_t stream() const override { return stream_; }
  int device() const override { return device_; }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv,
                                                       size_t count, DType dtype,
                                                       ReduceOp op) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_ASSIGN_OR_RETURN(
        const OpDescriptor d,
        Validate(seq, MakeCall(OpKind::kAllReduce, send, recv, count, dtype, op)));
    return Issue(seq, d, [&] {
      return ncclAllReduce(send, recv, count, NcclType(dtype), NcclOp(op), comm_, stream_);
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_ASSIGN_OR_RETURN(
        const OpDescriptor d,
        Validate(seq, MakeCall(OpKind::kReduceScatter, send, recv, recv_count, dtype, op)));
    // In place (recv == send + rank * recv_count) is NCCL's own convention.
    return Issue(seq, d, [&] {
      return ncclReduceScatter(send, recv, recv_count, NcclType(dtype), NcclOp(op), comm_,
                               stream_);
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_ASSIGN_OR_RETURN(
        const OpDescriptor d,
        Validate(seq, MakeCall(OpKind::kAllGather, send, recv, send_count, dtype)));
    return Issue(seq, d, [&] {
      return ncclAllGather(send, recv, send_count, NcclType(dtype), comm_, stream_);
    });
  }

  // Grouped ncclSend/ncclRecv, one pair per peer with a non-zero count.
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts,
      absl::Span<const size_t> send_offsets, void* recv, absl::Span<const size_t> recv_counts,
      absl::Span<const size_t> recv_offsets, DType dtype) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    GRADSUM_ASSIGN_OR_RETURN(const OpDescriptor d,
                             Validate(seq, collectives_internal::MakeAllToAllVCall(
                                               send, send_counts, send_offsets, recv,
                                               recv_counts, recv_offsets, dtype)));
    const size_t world = static_cast<size_t>(size_);
    if (options_.check_agreement && group_ == nullptr) {
      GRADSUM_RETURN_IF_ERROR(AgreeOnCounts(seq, send_counts, recv_counts));
    }
    const size_t esize = DTypeSize(dtype);
    return Issue(seq, d, [&] {
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
    GRADSUM_ASSIGN_OR_RETURN(
        const OpDescriptor d,
        Validate(seq, collectives_internal::MakeBroadcastCall(buf, count, dtype, root)));
    return Issue(seq, d, [&] {
      return ncclBroadcast(buf, buf, count, NcclType(dtype), root, comm_, stream_);
    });
  }

  // A one-element all-reduce on the scratch: it cannot finish before every rank joins.
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    const OpDescriptor d = Describe(MakeCall(OpKind::kBarrier, nullptr, nullptr, 0, DType::kF32));
    int64_t* word = device_scratch_;
    return Issue(seq, d, [&] {
      return ncclAllReduce(word, word, 1, ncclInt64, ncclSum, comm_, stream_);
    });
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    const int64_t seq = next_seq_++;
    GRADSUM_RETURN_IF_ERROR(CheckUsable());
    if (group_ != nullptr) {
      return absl::FailedPreconditionError("nccl Split inside an open coalesced group");
    }
    GRADSUM_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    const OpDescriptor d = Describe(MakeCall(OpKind::kSplit, nullptr, nullptr, 0, DType::kF32));
    if (options_.check_agreement) GRADSUM_RETURN_IF_ERROR(Agree(seq, d));
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
                                                                DType dtype,
                                                                ReduceOp op) override {
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
        return Fail(absl::InternalError(absl::StrCat(
            "nccl asynchronous error: ", ncclGetErrorString(state), ": ",
            ncclGetLastError(comm_))));
      }
      const absl::Time now = absl::Now();
      if (now >= comm_deadline) {
        return Fail(absl::DeadlineExceededError(absl::StrCat(
            "nccl operation on rank ", rank_, " of ", size_, " did not finish within ",
            absl::FormatDuration(options_.timeout),
            " (a rank never arrived?); the communicator was aborted")));
      }
      if (now >= wait_deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "nccl operation still in flight after waiting ", absl::FormatDuration(timeout),
            "; its buffers must stay alive"));
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

  std::string Label(OpKind kind, int64_t seq) const {
    return absl::StrFormat("nccl %s #%d (rank %d of %d)", OpKindName(kind), seq, rank_, size_);
  }

  std::string BrokenMessage() const {
    return absl::StrCat("nccl communicator is unusable after an earlier failure: ",
                        broken_reason_);
  }

  absl::Status CheckUsable() const {
    if (aborted_) return absl::FailedPreconditionError(BrokenMessage());
    return absl::OkStatus();
  }

  // A call whose own arguments are invalid (`local` not OK) still joins the agreement
  // exchange, marked invalid, so that its peers fail the same operation with
  // InvalidArgument naming this rank instead of timing out. Returns `local`.
  absl::Status Poisoned(int64_t seq, const OpCall& c, absl::Status local) {
    if (local.ok() || !options_.check_agreement || group_ != nullptr || aborted_) return local;
    OpDescriptor d = Describe(c);
    d.invalid_rank = rank_;
    if (cudaSetDevice(device_) == cudaSuccess) Agree(seq, d).IgnoreError();
    return local;
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
  // elements must be device memory. An invalid call still joins the agreement exchange.
  // Returns the call's descriptor (op_descriptor's Describe, as every backend).
  absl::StatusOr<OpDescriptor> Validate(int64_t seq, const OpCall& c) {
    absl::Status s = collectives_internal::ValidateCall(c, rank_, size_);
    if (s.ok()) s = CheckDeviceBuffers(c);
    GRADSUM_RETURN_IF_ERROR(Poisoned(seq, c, std::move(s)));
    return Describe(c);
  }

  absl::Status CheckDeviceBuffers(const OpCall& c) const {
    const size_t w = static_cast<size_t>(size_);
    const char* name = OpKindName(c.kind);
    switch (c.kind) {
      case OpKind::kAllReduce:
        GRADSUM_RETURN_IF_ERROR(CheckDeviceBuffer(c.send, c.count, name, "send"));
        return CheckDeviceBuffer(c.recv, c.count, name, "recv");
      case OpKind::kReduceScatter:
        GRADSUM_RETURN_IF_ERROR(CheckDeviceBuffer(c.send, c.count * w, name, "send"));
        return CheckDeviceBuffer(c.recv, c.count, name, "recv");
      case OpKind::kAllGather:
        GRADSUM_RETURN_IF_ERROR(CheckDeviceBuffer(c.send, c.count, name, "send"));
        return CheckDeviceBuffer(c.recv, c.count * w, name, "recv");
      case OpKind::kAllToAllV: {
        size_t send_end = 0, recv_end = 0;
        for (size_t p = 0; p < w; ++p) {
          send_end = std::max(send_end, c.send_offsets[p] + c.send_counts[p]);
          recv_end = std::max(recv_end, c.recv_offsets[p] + c.recv_counts[p]);
        }
        GRADSUM_RETURN_IF_ERROR(CheckDeviceBuffer(c.send, send_end, name, "send"));
        return CheckDeviceBuffer(c.recv, recv_end, name, "recv");
      }
      case OpKind::kBroadcast:
        return CheckDeviceBuffer(c.recv, c.count, name, "");
      case OpKind::kBarrier:
      case OpKind::kSplit:
        break;
    }
    return absl::OkStatus();
  }

  // Null with elements, or memory the GPU cannot address as device memory, is invalid.
  // The message names `op` and `side` ("send", "recv" or ""), formatted only on failure.
  static absl::Status CheckDeviceBuffer(const void* p, size_t count, const char* op,
                                        const char* side) {
    if (count == 0) return absl::OkStatus();
    auto what = [&] { return *side == '\0' ? std::string(op) : absl::StrCat(op, " ", side); };
    if (p == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), " buffer is null with ", count, " elements"));
    }
    cudaPointerAttributes attr;
    const cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state of this query
      return absl::InvalidArgumentError(
          absl::StrCat(what(), " buffer is not CUDA memory: ", cudaGetErrorString(e)));
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), " buffer is host memory; the nccl backend needs device memory"));
    }
    return absl::OkStatus();
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
      return Fail(absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(r), ": ",
                                                   ncclGetLastError(comm))));
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

  // Checks agreement (outside groups), enqueues `enqueue`'s NCCL calls, returns a Work.
  template <typename F>
  absl::StatusOr<std::unique_ptr<Work>> Issue(int64_t seq, const OpDescriptor& d, F&& enqueue) {
    GRADSUM_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    if (options_.check_agreement && group_ == nullptr) GRADSUM_RETURN_IF_ERROR(Agree(seq, d));
    GRADSUM_RETURN_IF_ERROR(CheckNccl(enqueue(), Label(d.kind, seq)));
    if (group_ != nullptr) return std::unique_ptr<Work>(new NcclWork(this, group_));
    auto c = std::make_shared<Completion>();
    c->issued = absl::Now();
    GRADSUM_RETURN_IF_ERROR(Record(*c));
    return std::unique_ptr<Work>(new NcclWork(this, std::move(c)));
  }

  // Runs NCCL calls on small host data: copy `words` int64 from host_scratch_ at
  // `host_in` to the device, enqueue, copy `out_words` back to `host_out`, and wait.
  template <typename F>
  absl::Status RoundTrip(const std::string& label, size_t in_offset, size_t in_words,
                         size_t out_offset, size_t out_words, F&& enqueue) {
    const size_t w = sizeof(int64_t);
    GRADSUM_CUDA_RETURN(cudaMemcpyAsync(device_scratch_ + in_offset, host_scratch_ + in_offset,
                                        in_words * w, cudaMemcpyHostToDevice, stream_),
                        "cudaMemcpyAsync");
    GRADSUM_RETURN_IF_ERROR(CheckNccl(enqueue(), label));
    GRADSUM_CUDA_RETURN(cudaMemcpyAsync(host_scratch_ + out_offset, device_scratch_ + out_offset,
                                        out_words * w, cudaMemcpyDeviceToHost, stream_),
                        "cudaMemcpyAsync");
    return WaitStream(label);
  }

  absl::Status Agree(int64_t seq, const OpDescriptor& d) {
    const std::string label = Label(d.kind, seq);
    const size_t n = collectives_internal::kDescriptorWords;
    collectives_internal::EncodeDescriptor(d, host_scratch_);
    GRADSUM_RETURN_IF_ERROR(RoundTrip(label, 0, n, 0, n, [&] {
      return ncclAllReduce(device_scratch_, device_scratch_, n, ncclInt64, ncclMax, comm_,
                           stream_);
    }));
    return collectives_internal::CheckDescriptorAgreed(d, host_scratch_, label);
  }

  // Rank r's send_counts[p] must equal rank p's recv_counts[r] (see op_descriptor.h).
  absl::Status AgreeOnCounts(int64_t seq, absl::Span<const size_t> send_counts,
                             absl::Span<const size_t> recv_counts) {
    const std::string label = Label(OpKind::kAllToAllV, seq);
    const size_t world = static_cast<size_t>(size_);
    const size_t out_at = collectives_internal::kDescriptorWords;  // what I send to each peer
    const size_t in_at = out_at + world;                           // what each peer sends me
    const size_t report_at = in_at + world;                        // my report (3 words)
    const size_t all_at = report_at + 3;                           // everyone's reports
    for (size_t p = 0; p < world; ++p) host_scratch_[out_at + p] = send_counts[p];
    GRADSUM_RETURN_IF_ERROR(RoundTrip(label, out_at, world, in_at, world, [&] {
      ncclResult_t r = ncclGroupStart();
      for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
        r = ncclSend(device_scratch_ + out_at + p, 1, ncclInt64, p, comm_, stream_);
        if (r == ncclSuccess) {
          r = ncclRecv(device_scratch_ + in_at + p, 1, ncclInt64, p, comm_, stream_);
        }
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    }));
    std::vector<int64_t> expected(recv_counts.begin(), recv_counts.end());
    collectives_internal::MakeCountReport(
        absl::MakeConstSpan(host_scratch_ + in_at, world), expected, host_scratch_ + report_at);
    GRADSUM_RETURN_IF_ERROR(RoundTrip(label, report_at, 3, all_at, 3 * world, [&] {
      return ncclAllGather(device_scratch_ + report_at, device_scratch_ + all_at, 3, ncclInt64,
                           comm_, stream_);
    }));
    return collectives_internal::CheckCountReports(
        absl::MakeConstSpan(host_scratch_ + all_at, 3 * world), label);
  }

  ncclComm_t comm_;
  const int device_;
  const NcclBackendOptions options_;
  int rank_ = 0;
  int size_ = 0;
  cudaStream_t stream_ = nullptr;
  int64_t* device_scratch_ = nullptr;  // agreement scratch, scratch_words_ int64
  int64_t* host_scratch_ = nullptr;    // pinned mirror
  size_t scratch_words_ = 0;
  int64_t next_seq_ = 0;
  std::shared_ptr<Completion> group_;  // non-null while a coalesced group is open
  bool aborted_ = false;
  std::string broken_reason_;
};

absl::Status NcclWork::Wait(absl::Duration timeout) { return comm_->WaitCompletion(*c_, timeout); }
bool NcclWork::IsCompleted() { return comm_->IsCompleted(*c_); }

absl::StatusOr<std::unique_ptr<NcclCommunicator>> InitRank(const ncclUniqueId& id, int rank,
                                                            int world, int device,
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
  return std::unique_ptr<NcclCommunicator>(std::move(c));
}

absl::Status CheckOptions(const NcclBackendOptions& options) {
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl backend timeout must be positive, got ", absl::FormatDuration(options.timeout)));
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

// ---- The timing decorator (TimeNcclCommunicator). ----

// CUDA events recorded on the NCCL stream before and after one operation.
struct OpEvents {
  cudaEvent_t start = nullptr, end = nullptr;
  ~OpEvents() {
    if (start != nullptr) cudaEventDestroy(start);
    if (end != nullptr) cudaEventDestroy(end);
  }
};

class TimedNcclWork final : public Work {
 public:
  TimedNcclWork(std::unique_ptr<Work> inner, std::unique_ptr<OpEvents> events,
                absl::Duration blocked, std::shared_ptr<CommTimer> timer,
                CommKind kind)
      : inner_(std::move(inner)),
        events_(std::move(events)),
        blocked_(blocked),
        timer_(std::move(timer)),
        kind_(kind) {}
  ~TimedNcclWork() override {
    if (!counted_ && cudaEventQuery(events_->end) == cudaSuccess) Count();
  }
  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time start = absl::Now();
    absl::Status s = inner_->Wait(timeout);
    blocked_ += absl::Now() - start;
    if (s.ok() && !counted_) Count();
    return s;
  }
  bool IsCompleted() override {
    const bool done = inner_->IsCompleted();
    if (done && !counted_ && cudaEventQuery(events_->end) == cudaSuccess) Count();
    return done;
  }

 private:
  // Busy: the events' interval; exposed: the host's blocked time, capped at it.
  void Count() {
    counted_ = true;
    float ms = 0;
    if (cudaEventSynchronize(events_->end) != cudaSuccess ||
        cudaEventElapsedTime(&ms, events_->start, events_->end) != cudaSuccess) {
      cudaGetLastError();  // an aborted operation: count the host's view of it
      timer_->AddBusy(blocked_);
      timer_->Add(blocked_, kind_);
      return;
    }
    const absl::Duration busy = absl::Microseconds(static_cast<int64_t>(ms * 1000.0f));
    timer_->AddBusy(busy);
    timer_->Add(std::min(blocked_, busy), kind_);
  }

  std::unique_ptr<Work> inner_;
  std::unique_ptr<OpEvents> events_;
  absl::Duration blocked_;
  std::shared_ptr<CommTimer> timer_;
  const CommKind kind_;
  bool counted_ = false;
};

class TimedNcclCommunicator final : public NcclCommunicator {
 public:
  TimedNcclCommunicator(std::unique_ptr<NcclCommunicator> inner,
                        std::shared_ptr<CommTimer> timer)
      : inner_(std::move(inner)), timer_(std::move(timer)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  absl::Duration timeout() const override { return inner_->timeout(); }
  cudaStream_t stream() const override { return inner_->stream(); }
  int device() const override { return inner_->device(); }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv,
                                                       size_t count, DType dtype,
                                                       ReduceOp op) override {
    return Timed(CommKind::kAllReduce,
                 [&] { return inner_->AllReduceAsync(send, recv, count, dtype, op); });
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    return Timed(CommKind::kReduceScatter, [&] {
      return inner_->ReduceScatterAsync(send, recv, recv_count, dtype, op);
    });
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    return Timed(CommKind::kAllGather,
                 [&] { return inner_->AllGatherAsync(send, recv, send_count, dtype); });
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts,
      absl::Span<const size_t> send_offsets, void* recv, absl::Span<const size_t> recv_counts,
      absl::Span<const size_t> recv_offsets, DType dtype) override {
    return Timed(CommKind::kAllToAll, [&] {
      return inner_->AllToAllVAsync(send, send_counts, send_offsets, recv, recv_counts,
                                    recv_offsets, dtype);
    });
  }
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    return Timed(CommKind::kOther,
                 [&] { return inner_->BroadcastAsync(buf, count, dtype, root); });
  }
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
    return Timed(CommKind::kOther, [&] { return inner_->BarrierAsync(); });
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<Communicator>> sub = inner_->Split(color, key);
    timer_->Add(absl::Now() - start, CommKind::kOther);
    if (!sub.ok() || *sub == nullptr) return sub;
    std::unique_ptr<NcclCommunicator> child(dynamic_cast<NcclCommunicator*>(sub->get()));
    if (child == nullptr) {
      return absl::InternalError("nccl Split did not give an nccl communicator");
    }
    sub->release();
    return std::unique_ptr<Communicator>(new TimedNcclCommunicator(std::move(child), timer_));
  }

  absl::Status BeginCoalescing() override {
    GRADSUM_RETURN_IF_ERROR(inner_->BeginCoalescing());
    absl::StatusOr<std::unique_ptr<OpEvents>> events = StartEvents();
    if (!events.ok()) {
      absl::StatusOr<std::unique_ptr<Work>> closed = inner_->EndCoalescing();
      if (closed.ok()) (*closed)->Wait(timeout()).IgnoreError();
      return events.status();
    }
    group_ = std::move(*events);
    group_start_ = absl::Now();
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Work>> EndCoalescing() override {
    std::unique_ptr<OpEvents> events = std::move(group_);
    if (events == nullptr) return inner_->EndCoalescing();  // inner's FailedPrecondition
    return Finish(CommKind::kOther, group_start_, std::move(events),
                  inner_->EndCoalescing());
  }
  absl::StatusOr<std::unique_ptr<Work>> AllReduceCoalescedAsync(absl::Span<const Buffer> buffers,
                                                                DType dtype,
                                                                ReduceOp op) override {
    return Timed(CommKind::kAllReduce,
                 [&] { return inner_->AllReduceCoalescedAsync(buffers, dtype, op); });
  }

 private:
  absl::StatusOr<std::unique_ptr<OpEvents>> StartEvents() {
    GRADSUM_CUDA_RETURN(cudaSetDevice(device()), "cudaSetDevice");
    auto events = std::make_unique<OpEvents>();
    GRADSUM_CUDA_RETURN(cudaEventCreate(&events->start), "cudaEventCreate");
    GRADSUM_CUDA_RETURN(cudaEventCreate(&events->end), "cudaEventCreate");
    GRADSUM_CUDA_RETURN(cudaEventRecord(events->start, stream()), "cudaEventRecord");
    return events;
  }

  // Records the end event after `work` (of `kind`) was issued and wraps it.
  absl::StatusOr<std::unique_ptr<Work>> Finish(CommKind kind, absl::Time start,
                                               std::unique_ptr<OpEvents> events,
                                               absl::StatusOr<std::unique_ptr<Work>> work) {
    const absl::Duration issuing = absl::Now() - start;
    if (!work.ok()) {
      timer_->Add(issuing, kind);
      timer_->AddBusy(issuing);
      return work.status();
    }
    cudaError_t e = cudaSetDevice(device());
    if (e == cudaSuccess) e = cudaEventRecord(events->end, stream());
    if (e != cudaSuccess) {
      // Untimed rather than lost: the operation is in flight and its Work still works.
      timer_->Add(issuing, kind);
      timer_->AddBusy(issuing);
      return std::move(*work);
    }
    return std::unique_ptr<Work>(
        new TimedNcclWork(std::move(*work), std::move(events), issuing, timer_, kind));
  }

  template <typename F>
  absl::StatusOr<std::unique_ptr<Work>> Timed(CommKind kind, F&& issue) {
    if (group_ != nullptr) return issue();  // timed as the whole group
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<OpEvents>> events = StartEvents();
    if (!events.ok()) return events.status();
    return Finish(kind, start, std::move(*events), issue());
  }

  std::unique_ptr<NcclCommunicator> inner_;
  std::shared_ptr<CommTimer> timer_;
  std::unique_ptr<OpEvents> group_;  // non-null while a coalesced group is open
  absl::Time group_start_;
};

}  // namespace

std::unique_ptr<NcclCommunicator> TimeNcclCommunicator(std::unique_ptr<NcclCommunicator> inner,
                                                       std::shared_ptr<CommTimer> timer) {
  return std::make_unique<TimedNcclCommunicator>(std::move(inner), std::move(timer));
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> CreateNcclCommunicator(
    Communicator& bootstrap, NcclBackendOptions options) {
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
  GRADSUM_RETURN_IF_ERROR(id_ok);
  GRADSUM_RETURN_IF_ERROR(device_ok);
  if (message.valid != 1) {
    return absl::FailedPreconditionError(
        "nccl backend: rank 0 of the bootstrap communicator could not create the NCCL id");
  }
  const ncclUniqueId& id = message.id;
  return InitRank(id, bootstrap.rank(), bootstrap.size(), device, options);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> CreateNcclCommunicatorFromFile(
    const std::string& id_path, int rank, int world, NcclBackendOptions options) {
  GRADSUM_RETURN_IF_ERROR(CheckOptions(options));
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
        return absl::DeadlineExceededError(absl::StrCat(
            "rank ", rank, ": no NCCL id appeared at ", id_path, " within ",
            absl::FormatDuration(options.timeout)));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  return InitRank(id, rank, world, device, options);
}

}  // namespace gradsum
