#ifndef GRADSUM_COLLECTIVES_NCCL_BACKEND_H_
#define GRADSUM_COLLECTIVES_NCCL_BACKEND_H_

// The `nccl` backend: a Communicator over NCCL on CUDA device buffers, one GPU per rank.
// Built only under --config=cuda.
//
//   // Bootstrap through any host communicator (here MPI): rank 0 of `world` makes the
//   // ncclUniqueId and broadcasts it.
//   GRADSUM_ASSIGN_OR_RETURN(auto world, CreateMpiWorldCommunicator());
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> nccl,
//                            CreateNcclCommunicator(*world, {.device = local_rank}));
//   GRADSUM_RETURN_IF_ERROR(nccl->AllReduce(d_grad, d_grad, n, DType::kBF16));
//   cudaStream_t s = nccl->device_stream()->stream();  // the stream it enqueues on
//
//   // Or through a shared file (no MPI): rank 0 writes the id atomically, others poll.
//   auto nccl = CreateNcclCommunicatorFromFile("/shared/job42.nccl_id", rank, world_size,
//                                              {.check_agreement = false});
//
// The stream, coalescing (ncclGroupStart/End: one fused launch for many calls) and the
// timing markers (CUDA events) are the communicator's DeviceStream capability
// (collectives/device_stream.h), reached through device_stream() on it and on every
// decorator over it: the timing decorator (collectives/timed_communicator.h) times NCCL
// operations on the stream through it.
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
// Agreement: the backend itself moves data only. Unless `check_agreement` is false,
// CreateNcclCommunicator wraps it in the agreement decorator run over a split of the
// bootstrap (host) communicator, WithAgreementCheckOver (collectives/checked_communicator.h),
// as c10d checks NCCL over Gloo: every operation outside a coalesced group first
// all-reduces a small descriptor (operation, dtype, op, count, root) on the host, so ranks
// that disagree all fail with InvalidArgument naming the field (for all-to-all-v, also the
// count matrix), and a rank whose own arguments are invalid (a host buffer included) makes
// its peers fail that operation naming it. The exchange never touches the GPU: it neither
// waits for the stream nor delays it. Turn it off for speed once a program is known good.
// A communicator from a file has no host communicator to check over, so that factory
// needs check_agreement = false.
//
// Failure: communicators are non-blocking (ncclConfig_t.blocking = 0). An operation not
// finished `timeout` after it was issued, or NCCL reporting an asynchronous error, aborts
// the communicator (ncclCommAbort): that Wait returns DeadlineExceeded (or Internal), and
// every later call FailedPrecondition.
//
// Thread safety: one thread at a time per communicator. A Work must not outlive its
// communicator.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"

namespace gradsum {

struct NcclBackendOptions {
  // CUDA ordinal of this rank's GPU; -1 means the calling thread's current device.
  int device = -1;
  // How long an operation (or the communicator's creation) may take before the
  // communicator is aborted and the call fails with DeadlineExceeded.
  absl::Duration timeout = absl::Seconds(60);
  // Check cross-rank agreement before every operation, over the bootstrap communicator
  // (see above). CreateNcclCommunicatorFromFile needs it false.
  bool check_agreement = true;
};

// Creates rank bootstrap.rank() of a communicator of bootstrap.size() ranks; rank 0 of
// `bootstrap` creates the ncclUniqueId and broadcasts it over `bootstrap` (any backend:
// mpi across processes, thread within one). Collective over `bootstrap`. With
// check_agreement, the result is the agreement decorator over the NCCL communicator, with
// its exchange over bootstrap.Split(0, rank) (a private host communicator: its traffic
// never mixes with the caller's on `bootstrap`); its device_stream() is the backend's.
// Errors: FailedPrecondition if CUDA has no usable device (with the CUDA runtime's
// reason); InvalidArgument for a bad device ordinal or a non-positive timeout;
// DeadlineExceeded if the ranks do not all join within options.timeout; Internal with
// NCCL's message otherwise; those of bootstrap.Split.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    Communicator& bootstrap, NcclBackendOptions options = {});

// The same without a host communicator: rank 0 writes the id to `id_path` atomically
// (a temporary file renamed into place); the other ranks poll for it until
// options.timeout. Use a fresh path per job: a stale file from an earlier job would be
// read as this job's id. With no host communicator there is nothing to check agreement
// over: options.check_agreement must be false (InvalidArgument otherwise; wrap the result
// with WithAgreementCheckOver if a host communicator exists). Errors as above, plus
// InvalidArgument for rank outside [0, world) and Unavailable if rank 0 cannot write the
// file (naming the path).
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicatorFromFile(
    const std::string& id_path, int rank, int world, NcclBackendOptions options = {});

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_NCCL_BACKEND_H_
