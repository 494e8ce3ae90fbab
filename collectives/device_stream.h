#ifndef GRADSUM_COLLECTIVES_DEVICE_STREAM_H_
#define GRADSUM_COLLECTIVES_DEVICE_STREAM_H_

// DeviceStream: the optional capability of a stream-ordered device backend (nccl), reached
// through Communicator::device_stream() on the backend and on every decorator over it, so
// that code which needs the stream asks the communicator it holds, decorated or not:
//
//   DeviceStream* ds = comm.device_stream();  // null on the host backends (thread, mpi)
//   if (ds == nullptr) return absl::FailedPreconditionError("needs a device backend");
//   cudaStream_t s = ds->stream();  // enqueue work ordered before / after comm's operations
//
//   // Coalescing: every operation issued on `comm` between the two calls is one fused
//   // launch (ncclGroupStart/End); the returned Work completes when all of it has.
//   GRADSUM_RETURN_IF_ERROR(ds->BeginCoalescing());
//   for (Bucket& b : buckets) comm.AllReduceAsync(b.data, b.data, b.n, DType::kBF16, kSum);
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Work> all, ds->EndCoalescing());
//
// Decorators forward the capability; the ones that must see it act on it:
// - the timing decorator (timed_communicator.h) returns its own, so that a coalesced group
//   is timed as one operation, and times each operation with markers on the stream;
// - the agreement decorator (checked_communicator.h) skips its exchange while a group is
//   open (coalescing()) and adds CheckBuffer to its local validation.
// Issue the operations of a group, and Begin/EndCoalescing, on the same (outermost)
// communicator, so that every decorator sees them.
//
// This header needs no CUDA: the stream is CUDA's own opaque type, declared below, so
// collectives/ builds without CUDA and the nccl backend implements the interface.

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/dtype.h"

// CUDA's stream object: cudaStream_t is `CUstream_st*` (driver_types.h).
struct CUstream_st;

namespace gradsum {

// A point recorded on a device stream (a CUDA event), for timing what the stream ran
// between two of them.
class StreamMarker {
 public:
  virtual ~StreamMarker() = default;
  // Whether the stream has passed this marker. Never blocks; false while it has not, and
  // after an error on the stream (an aborted communicator).
  virtual bool Reached() = 0;
  // Waits until the stream has passed this marker, then returns the device time from
  // `start`, an earlier marker of the same DeviceStream, to this one. Internal with the
  // device's reason when either marker failed (e.g. its communicator was aborted).
  virtual absl::StatusOr<absl::Duration> ElapsedSince(StreamMarker& start) = 0;
};

class DeviceStream {
 public:
  virtual ~DeviceStream() = default;

  // The stream every operation of the communicator is enqueued on, in issue order (owned by
  // the backend; a cudaStream_t, no cast needed).
  virtual CUstream_st* stream() const = 0;
  // The CUDA ordinal the communicator runs on.
  virtual int device() const = 0;

  // InvalidArgument unless `p` is memory this backend's operations can read and write
  // (nccl: device or managed memory of a CUDA context), e.g. "is host memory; the nccl
  // backend needs device memory". Callers pass non-null pointers to buffers with elements;
  // the message is completed by collectives_internal::CheckEachBuffer with the operation
  // and side.
  virtual absl::Status CheckBuffer(const void* p) const = 0;

  // Starts a coalesced group: later operations are enqueued inside one
  // ncclGroupStart/ncclGroupEnd and their Works complete with the group (waiting on one
  // before EndCoalescing is FailedPrecondition). Split and a nested BeginCoalescing are
  // FailedPrecondition while a group is open.
  virtual absl::Status BeginCoalescing() = 0;
  // Ends the group and launches it; the Work completes when every operation in it has.
  // FailedPrecondition without an open group.
  virtual absl::StatusOr<std::unique_ptr<Work>> EndCoalescing() = 0;
  // True between a successful BeginCoalescing and the matching EndCoalescing.
  virtual bool coalescing() const = 0;

  // One buffer of a coalesced all-reduce.
  struct Buffer {
    const void* send;
    void* recv;
    size_t count;
  };
  // All-reduces every buffer (same dtype and op) in one fused group; the Work completes
  // with all of them.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllReduceCoalescedAsync(
      absl::Span<const Buffer> buffers, DType dtype, ReduceOp op = ReduceOp::kSum) = 0;

  // Records a marker on the stream after everything enqueued so far (the timing decorator
  // records one before and one after each operation). Internal with the device's reason
  // on failure.
  virtual absl::StatusOr<std::unique_ptr<StreamMarker>> RecordMarker() = 0;
};

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_DEVICE_STREAM_H_
