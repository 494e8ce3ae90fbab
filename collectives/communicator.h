#ifndef GRADSUM_COLLECTIVES_COMMUNICATOR_H_
#define GRADSUM_COLLECTIVES_COMMUNICATOR_H_

// Communicator: the one interface every backend (thread, mpi, nccl) implements.
//
// Callers write against this interface and pick a backend by configuration, as with
// c10d's ProcessGroup. All operations but Send / Recv are collective: every rank of the
// communicator must call the same operations in the same order with matching op, dtype and
// counts. Send / Recv involve two ranks (see SendAsync).
//
//   std::vector<float> grad(n);
//   GRADSUM_RETURN_IF_ERROR(comm.AllReduce(grad.data(), grad.data(), n, DType::kF32,
//                                          ReduceOp::kSum));               // in place
//   absl::StatusOr<std::unique_ptr<Work>> w =
//       comm.AllReduceAsync(buf, buf, n, DType::kBF16, ReduceOp::kSum);
//   GRADSUM_RETURN_IF_ERROR((*w)->Wait(absl::Seconds(30)));
//   // The same with an options struct per operation (as Gloo's AllreduceOptions):
//   GRADSUM_RETURN_IF_ERROR(comm.AllReduce({.send = g, .recv = g, .count = n,
//                                           .dtype = DType::kF32,
//                                           .timeout = absl::Seconds(5)}));
//
// Contract of every backend:
// - SUM is the default and the reduction the library's gradients use (SEMANTICS.md §2, §7).
//   AVG exists only for the legacy-equivalence check of SEMANTICS.md §9.
// - bf16/f16 reductions accumulate in fp32 and round once (CPU backends).
// - In place: all-reduce with send == recv; reduce-scatter with recv == send + rank() *
//   recv_count (my block of the full buffer); all-gather with send == recv + rank() *
//   send_count (NCCL's conventions). Any other overlap of send and recv is InvalidArgument;
//   all-to-all-v has no in-place form.
// - AVG needs a floating dtype (InvalidArgument otherwise); reduce-scatter takes SUM or AVG.
// - Bad arguments on one rank (null buffer with a non-zero count, root out of range,
//   counts that do not add up) are InvalidArgument on that rank, before any exchange.
// - Ranks that disagree on op, dtype or counts all fail with InvalidArgument naming the
//   mismatch. A rank that never arrives makes the others fail with DeadlineExceeded
//   after `timeout()`. After such a failure the communicator may be unusable
//   (FailedPrecondition on later calls), as with an aborted NCCL communicator.
// - Operations are executed in the order they are issued, sync or async.
// - Arguments are checked by one function shared by every backend
//   (collectives/op_descriptor.h ValidateCall); cross-rank agreement is checked by the
//   thread backend's rendezvous, and for other backends by the WithAgreementCheck
//   decorator (collectives/checked_communicator.h).
// - Decorators (agreement, timing, the tests' fault injectors) derive from
//   ForwardingCommunicator (collectives/forwarding_communicator.h), which forwards every
//   method, device_stream() included.
//
// Work lifetime (every backend):
// - A Work may be waited on, polled and destroyed from the thread that issued it, in any
//   order relative to other Works; destroying a Work does not cancel or wait for its
//   operation, which still runs in issue order.
// - The operation's buffers (and, for all-to-all-v, nothing else: the count spans are
//   copied at issue) must stay alive and untouched until a Wait on its Work returns OK or
//   an error other than the DeadlineExceeded of that Wait's own timeout, or until the
//   communicator is destroyed.
// - A Work may outlive its communicator: Wait then returns the operation's result if it
//   finished, or FailedPrecondition (the thread and mpi backends finish or fail everything
//   issued before the destructor returns). The nccl backend is the exception: its Works
//   must not outlive the communicator (they wait on its CUDA stream).

#include <cstddef>
#include <limits>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace gradsum {

class DeviceStream;  // collectives/device_stream.h

enum class ReduceOp {
  kSum = 0,
  kAvg = 1,  // SUM then divide by size(); for the legacy check of SEMANTICS.md §9 only.
  kMax = 2,
};

// "sum", "avg", "max".
const char* ReduceOpName(ReduceOp op);

// ---- Options per operation (Gloo's *Options, c10d's *Options). ----
// `timeout`: how long this call waits for the operation; ZeroDuration() (the default)
// means the communicator's timeout(). A sync call whose own timeout passes returns
// DeadlineExceeded with the operation still in flight: as with Work::Wait, its buffers
// must then stay alive until the communicator is destroyed. For async calls the timeout is
// what Wait() with no argument uses.

struct AllReduceOptions {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  absl::Duration timeout = absl::ZeroDuration();
};

struct ReduceScatterOptions {
  const void* send = nullptr;  // size() * recv_count elements
  void* recv = nullptr;
  size_t recv_count = 0;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  absl::Duration timeout = absl::ZeroDuration();
};

struct AllGatherOptions {
  const void* send = nullptr;
  void* recv = nullptr;  // size() * send_count elements
  size_t send_count = 0;
  DType dtype = DType::kF32;
  absl::Duration timeout = absl::ZeroDuration();
};

struct AllToAllVOptions {
  const void* send = nullptr;
  absl::Span<const size_t> send_counts, send_offsets;
  void* recv = nullptr;
  absl::Span<const size_t> recv_counts, recv_offsets;
  DType dtype = DType::kF32;
  absl::Duration timeout = absl::ZeroDuration();
};

struct BroadcastOptions {
  void* buf = nullptr;
  size_t count = 0;
  DType dtype = DType::kF32;
  int root = 0;
  absl::Duration timeout = absl::ZeroDuration();
};

struct BarrierOptions {
  absl::Duration timeout = absl::ZeroDuration();
};

// A handle to an asynchronous collective.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation has completed or `timeout` has passed. Returns the
  // operation's status, or DeadlineExceeded if it did not complete in time (the
  // operation is then still in flight; its buffers must stay alive until a later Wait
  // returns or the communicator is destroyed).
  virtual absl::Status Wait(absl::Duration timeout = absl::InfiniteDuration()) = 0;
  // True once the operation has finished (successfully or not).
  virtual bool IsCompleted() = 0;
  // When the operation finished, as its backend stamped it at completion (the thread and
  // mpi backends do), so that a caller who learns of the completion later still knows when
  // it happened (CommTimer's busy time needs no polling thread). absl::InfiniteFuture()
  // while the operation is in flight, and always for a backend that does not stamp; a
  // caller then uses the moment it saw IsCompleted(). Thread-safe, like IsCompleted.
  // Decorators forward it.
  virtual absl::Time CompletionTime() { return absl::InfiniteFuture(); }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "thread", "mpi" or "nccl".
  virtual std::string backend() const = 0;
  // How long an operation waits for the other ranks before DeadlineExceeded.
  virtual absl::Duration timeout() const = 0;
  // The most elements this backend accepts for any count or offset of one call (an
  // all-to-all-v block's count and offset included); larger is InvalidArgument. The mpi
  // backend: INT_MAX (MPI counts are int). Decorators report their inner backend's limit,
  // so that the agreement check (checked_communicator.h) rejects such a call on every rank
  // before the exchange instead of letting one rank fail alone.
  virtual size_t max_count() const { return std::numeric_limits<size_t>::max(); }
  // The stream-ordered device capability (collectives/device_stream.h: the CUDA stream the
  // operations are enqueued on, coalescing, timing markers) of a device backend (nccl);
  // null for the host backends. Decorators forward it (or their own view of it), so code
  // that needs the stream asks the communicator it holds instead of casting to a backend.
  virtual DeviceStream* device_stream() { return nullptr; }

  // ---- Asynchronous operations (the primitives every backend implements). ----

  // recv[i] = op over ranks of send[i], i < count, on every rank.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv,
                                                               size_t count, DType dtype,
                                                               ReduceOp op) = 0;
  // send holds size() * recv_count elements; rank r receives the reduction of block r.
  // op is kSum or kAvg (kMax is InvalidArgument).
  virtual absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                                   size_t recv_count, DType dtype,
                                                                   ReduceOp op) = 0;
  // recv holds size() * send_count elements; block r is rank r's send.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                               size_t send_count, DType dtype) = 0;
  // Rank r sends send[send_offsets[p] .. + send_counts[p]) to each peer p, and receives
  // peer p's block for r into recv[recv_offsets[p] .. + recv_counts[p]). Counts and
  // offsets are in elements; each span has size() entries. send_counts[p] on rank r
  // must equal recv_counts[r] on rank p (checked). Zero counts are allowed.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) = 0;
  // Copies root's buf to every rank's buf.
  virtual absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                               int root) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() = 0;

  // ---- Point-to-point (the primitives of a pipeline's stage-to-stage traffic). ----
  // SendAsync moves `count` elements of buf to rank `peer`, whose RecvAsync from this rank
  // with the same `tag` receives them. Only the two ranks take part. Ordered: between one
  // pair, the sends and receives of one tag match in the order each side issued them, so a
  // stream of messages needs no distinct tags. Tags are in [0, kMaxTag]; peer in [0, size());
  // a rank may send to itself. Unlike the collectives, point-to-point operations do not wait
  // for the operations issued before them: a rank may post its send and its receive of an
  // exchange in either order, and neither blocks the other (a ring shift is SendAsync to
  // the next rank, RecvAsync from the previous one, then both Waits).
  // Checked: the receiver's count and dtype must equal the sender's; otherwise both fail
  // with InvalidArgument naming the peer and both counts. A peer that does not post its
  // side within timeout() (stopped, hung, gone) makes the waiting side fail with
  // DeadlineExceeded naming that peer; a communicator destroyed with a point-to-point
  // operation pending fails its peer's matching operation (and, as with the collectives,
  // such failures may leave the communicator unusable). Buffers: as for the collectives
  // (Work lifetime above). Backends without point-to-point return Unimplemented.
  static constexpr int kMaxTag = (1 << 20) - 1;
  virtual absl::StatusOr<std::unique_ptr<Work>> SendAsync(const void* buf, size_t count,
                                                          DType dtype, int peer, int tag = 0);
  virtual absl::StatusOr<std::unique_ptr<Work>> RecvAsync(void* buf, size_t count, DType dtype,
                                                          int peer, int tag = 0);

  // Ranks with the same `color` form a new communicator, ordered by (key, old rank).
  // A negative color means "not in any new communicator" (returns nullptr). Collective.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) = 0;

  // ---- Synchronous forms. ----
  // By default: issue the async form and wait up to timeout(). A backend may override them
  // with a cheaper path (the thread backend runs them on the caller's thread without
  // allocating); the result must be the same as async + Wait.

  virtual absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                 ReduceOp op = ReduceOp::kSum);
  virtual absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                     ReduceOp op = ReduceOp::kSum);
  virtual absl::Status AllGather(const void* send, void* recv, size_t send_count, DType dtype);
  virtual absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_counts,
                                 absl::Span<const size_t> send_offsets, void* recv,
                                 absl::Span<const size_t> recv_counts,
                                 absl::Span<const size_t> recv_offsets, DType dtype);
  virtual absl::Status Broadcast(void* buf, size_t count, DType dtype, int root);
  virtual absl::Status Barrier();
  // The async form and a Wait (a blocking Send whose peer receives only after sending back
  // to it deadlocks, as with MPI_Ssend: use the async forms for an exchange).
  absl::Status Send(const void* buf, size_t count, DType dtype, int peer, int tag = 0);
  absl::Status Recv(void* buf, size_t count, DType dtype, int peer, int tag = 0);

  // ---- The same operations with an options struct (thin wrappers over the above). ----

  absl::Status AllReduce(const AllReduceOptions& o);
  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const AllReduceOptions& o);
  absl::Status ReduceScatter(const ReduceScatterOptions& o);
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const ReduceScatterOptions& o);
  absl::Status AllGather(const AllGatherOptions& o);
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const AllGatherOptions& o);
  absl::Status AllToAllV(const AllToAllVOptions& o);
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(const AllToAllVOptions& o);
  absl::Status Broadcast(const BroadcastOptions& o);
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(const BroadcastOptions& o);
  absl::Status Barrier(const BarrierOptions& o);
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync(const BarrierOptions& o);

  // How long to wait on one of this communicator's operations: timeout() plus a margin,
  // so that the backend's own DeadlineExceeded (which names the ranks that did not
  // arrive) is what a caller normally sees, rather than its own wait's.
  absl::Duration OperationWaitLimit() const { return timeout() + absl::Seconds(5); }

 protected:
  // Waits on an issued operation for OperationWaitLimit().
  absl::Status WaitIssued(absl::StatusOr<std::unique_ptr<Work>> work);

 private:
  // The options forms: `timeout` zero means the plain call; otherwise async + Wait.
  template <typename Sync, typename Async>
  absl::Status WithTimeout(absl::Duration timeout, Sync&& sync, Async&& async);
  absl::StatusOr<std::unique_ptr<Work>> DefaultWait(absl::Duration timeout,
                                                    absl::StatusOr<std::unique_ptr<Work>> work);
};

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_COMMUNICATOR_H_
