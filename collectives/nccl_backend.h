#ifndef GRADSUM_COLLECTIVES_NCCL_BACKEND_H_
#define GRADSUM_COLLECTIVES_NCCL_BACKEND_H_

// The `nccl` backend: a Communicator over NCCL on CUDA device buffers, one GPU per rank.
// Built only under --config=cuda.
//
//   // Bootstrap through any host communicator (here MPI): rank 0 of `world` makes the
//   // ncclUniqueId and broadcasts it.
//   GRADSUM_ASSIGN_OR_RETURN(auto world, CreateMpiWorldCommunicator());
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> nccl,
//                            CreateNcclCommunicator(*world, {.device = local_rank}));
//   GRADSUM_RETURN_IF_ERROR(nccl->AllReduce(d_grad, d_grad, n, DType::kBF16));
//
//   // Or through a shared file (no MPI): rank 0 writes the id atomically, others poll.
//   auto nccl = CreateNcclCommunicatorFromFile("/shared/job42.nccl_id", rank, world_size, {});
//
//   // Coalescing: everything issued between the two calls is one ncclGroupStart/End, i.e.
//   // one fused launch; the returned Work completes when all of it has.
//   GRADSUM_RETURN_IF_ERROR(nccl->BeginCoalescing());
//   for (Bucket& b : buckets) nccl->AllReduceAsync(b.data, b.data, b.n, DType::kBF16, kSum);
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Work> all, nccl->EndCoalescing());
//
// Buffers are device (or managed) memory of this communicator's device; host memory is
// InvalidArgument. Operations are enqueued on the communicator's own CUDA stream, in issue
// order; a Work completes when its CUDA event has fired. Sync forms wait for it.
//
// Numerics: NCCL reduces bf16/f16 natively (ncclBfloat16 / ncclFloat16); unlike the CPU
// backends it does not promise fp32 accumulation with a single rounding, and its
// summation order is its own. AVG is ncclAvg (floating dtypes only, like the other
// backends); MAX is ncclMax.
//
// Agreement: unless `check_agreement` is false, every operation outside a coalesced group
// first all-reduces a small descriptor (operation, dtype, op, count, root) on the
// device and waits for it on the host, so ranks that disagree all fail with
// InvalidArgument naming the field (for all-to-all-v, also the count matrix). This costs
// one small round trip per operation; turn it off for speed once a program is known good.
//
// Failure: communicators are non-blocking (ncclConfig_t.blocking = 0). An operation not
// finished `timeout` after it was issued, or NCCL reporting an asynchronous error, aborts
// the communicator (ncclCommAbort): that Wait returns DeadlineExceeded (or Internal), and
// every later call FailedPrecondition.
//
// Thread safety: one thread at a time per communicator. A Work must not outlive its
// communicator.

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "collectives/timed_communicator.h"

namespace gradsum {

struct NcclBackendOptions {
  // CUDA ordinal of this rank's GPU; -1 means the calling thread's current device.
  int device = -1;
  // How long an operation (or the communicator's creation) may take before the
  // communicator is aborted and the call fails with DeadlineExceeded.
  absl::Duration timeout = absl::Seconds(60);
  // Exchange a descriptor before every operation (see above).
  bool check_agreement = true;
};

class NcclCommunicator : public Communicator {
 public:
  // The stream every operation is enqueued on (owned by the communicator).
  virtual cudaStream_t stream() const = 0;
  // The CUDA ordinal this communicator runs on.
  virtual int device() const = 0;

  // Starts a coalesced group: later operations are enqueued inside one
  // ncclGroupStart/ncclGroupEnd and their Works complete with the group. Agreement checks
  // are skipped inside a group (there is no host round trip inside a fused launch).
  // Split and a nested BeginCoalescing are FailedPrecondition while a group is open.
  virtual absl::Status BeginCoalescing() = 0;
  // Ends the group and launches it; the Work completes when every operation in it has.
  // FailedPrecondition without an open group.
  virtual absl::StatusOr<std::unique_ptr<Work>> EndCoalescing() = 0;

  // One buffer of a coalesced all-reduce.
  struct Buffer {
    const void* send;
    void* recv;
    size_t count;
  };
  // All-reduces every buffer (same dtype and op) in one fused group.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllReduceCoalescedAsync(
      absl::Span<const Buffer> buffers, DType dtype, ReduceOp op = ReduceOp::kSum) = 0;
};

// Creates rank bootstrap.rank() of a communicator of bootstrap.size() ranks; rank 0 of
// `bootstrap` creates the ncclUniqueId and broadcasts it over `bootstrap` (any backend:
// mpi across processes, thread within one). Collective over `bootstrap`.
// Errors: FailedPrecondition if CUDA has no usable device (with the CUDA runtime's
// reason); InvalidArgument for a bad device ordinal or a non-positive timeout;
// DeadlineExceeded if the ranks do not all join within options.timeout; Internal with
// NCCL's message otherwise.
absl::StatusOr<std::unique_ptr<NcclCommunicator>> CreateNcclCommunicator(
    Communicator& bootstrap, NcclBackendOptions options = {});

// The same without a host communicator: rank 0 writes the id to `id_path` atomically
// (a temporary file renamed into place); the other ranks poll for it until
// options.timeout. Use a fresh path per job: a stale file from an earlier job would be
// read as this job's id. Errors as above, plus InvalidArgument for rank outside
// [0, world) and Unavailable if rank 0 cannot write the file (naming the path).
absl::StatusOr<std::unique_ptr<NcclCommunicator>> CreateNcclCommunicatorFromFile(
    const std::string& id_path, int rank, int world, NcclBackendOptions options = {});

// Times every operation of `inner` (owned) into `timer`, the CommTimer of the rank's host
// communicators (collectives/timed_communicator.h), so that NCCL's collectives count in
// the step's comm_s and comm_exposed_s like the host's:
// - busy: each operation's duration on the NCCL stream, from CUDA events recorded on it
//   around the operation (its agreement exchange included). Time the stream spent waiting
//   for earlier work (a fence on the compute stream, the previous operation) is not in it.
// - exposed: the host time the caller spent in the issuing call and in Wait, capped at
//   that duration: the part of the block during which the collective itself ran (the
//   rest is the GPU finishing compute queued before the fence). The host runs ahead of
//   the GPU only between the model's syncs, so a wait on a collective while compute was
//   still queued may still count. It is attributed to the operation's CommKind; a
//   BeginCoalescing .. EndCoalescing group to kOther, AllReduceCoalescedAsync to kAllReduce.
// Counted once, when the operation is first waited for successfully, found complete by
// IsCompleted(), or dropped complete; one dropped unfinished is not counted. A coalesced
// group (BeginCoalescing .. EndCoalescing, AllReduceCoalescedAsync) counts as one
// operation; the Works of the operations inside it are not timed. Split() returns a
// timed child over the same timer, so a Mesh built over the result is timed throughout.
std::unique_ptr<NcclCommunicator> TimeNcclCommunicator(std::unique_ptr<NcclCommunicator> inner,
                                                       std::shared_ptr<CommTimer> timer);

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_NCCL_BACKEND_H_
