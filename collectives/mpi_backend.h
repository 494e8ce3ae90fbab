#ifndef GRADSUM_COLLECTIVES_MPI_BACKEND_H_
#define GRADSUM_COLLECTIVES_MPI_BACKEND_H_

// The `mpi` backend: a Communicator over Open MPI, one rank per process (`mpirun -np N`).
//
//   absl::StatusOr<std::unique_ptr<Communicator>> world =
//       CreateMpiWorldCommunicator({.timeout = absl::Seconds(30)});
//   if (!world.ok()) return world.status();
//   GRADSUM_RETURN_IF_ERROR((*world)->AllReduce(g, g, n, DType::kBF16, ReduceOp::kSum));
//   GRADSUM_ASSIGN_OR_RETURN(auto edp_group, (*world)->Split(/*color=*/p, /*key=*/f));
//
// How it works. Each communicator owns a private duplicate of its MPI communicator (so its
// traffic never matches the caller's own MPI calls) and one progress thread that runs the
// issued async operations strictly in issue order (collectives/progress_queue.h, shared with
// the thread backend). Async operations use non-blocking MPI
// (MPI_Iallreduce, ...) polled with MPI_Test until done or until `timeout` after the
// operation started. A synchronous call runs on the caller's thread (no hand-off, no
// allocation) with blocking MPI (MPI_Allreduce, ...), Open MPI's fastest path for small
// messages, once the async operations issued before it have finished. MPI never matches a
// blocking collective with a non-blocking one, so ranks must agree on sync versus async for
// each operation: the agreement check reports a mix as InvalidArgument ("ranks disagree on
// sync versus async"); without the check a mix hangs until the watchdog ends the job. The
// options forms with a per-call timeout (communicator.h) are async + Wait, hence async.
//
// Point-to-point (SendAsync / RecvAsync): header, payload and the receiver's verdict as MPI
// messages on the communicator's duplicate, posted at issue on the caller's thread (not
// queued behind the collectives) and driven by whoever waits on one; sizes are checked on
// both sides, and a half not matched within `timeout` fails with DeadlineExceeded naming the
// peer and where every peer is (mpi_backend.cc, "Point-to-point").
//
// Timeouts. A rank that never arrives makes the others fail after `timeout`:
// - an async operation fails with DeadlineExceeded, and the
//   communicator is then broken (FailedPrecondition on every later call);
// - a blocking sync call cannot be abandoned (MPI cannot cancel a collective), so a
//   watchdog (the idle progress thread, checking an atomically armed deadline every
//   timeout / 4, at most 100 ms) prints "gradsum mpi backend: DEADLINE_EXCEEDED: mpi
//   all_reduce #N (rank R of W): not every rank arrived within the timeout of T ..." to
//   stderr and ends the whole job (AbortMpiJob, exit status 1), as a training job does
//   after any timed-out collective. Programs that want DeadlineExceeded
//   back from sync calls instead set blocking_sync_calls = false (costs 5-15 us per
//   small call; docs/benchmarks/mpi.md).
//
// Arguments are checked on the calling rank with the validation every backend shares
// (InvalidArgument naming the value). Cross-rank agreement is the WithAgreementCheck
// decorator (collectives/checked_communicator.h), applied by default: every operation
// first all-reduces a small descriptor, so ranks that disagree on operation, dtype, op,
// count or root all fail with InvalidArgument naming the field and no data moves, and a
// rank whose own arguments are invalid makes its peers fail that operation with
// InvalidArgument naming it instead of waiting. With check_agreement = false the backend
// moves data only: a disagreement is then undefined (MPI may fail, hang until the timeout
// or truncate), and an invalid call on one rank leaves its peers waiting for the timeout.
//
// Numerics (SEMANTICS.md §7): f32/f64/i32/i64 reduce natively in MPI. bf16/f16 are widened
// to an fp32 buffer, reduced in fp32 by MPI, and rounded once (nearest even) on the way
// back, so a bf16 SUM is a real sum rounded once, never per step. AVG is the SUM divided by
// size() in the accumulation type, for floating dtypes only (integer AVG is
// InvalidArgument, as on the thread backend). Open MPI gives every rank the same result,
// but its summation order is its own: with more than two ranks, floating sums need not be
// bit-identical to the thread backend's ascending-rank order.
//
// In place (the thread backend's and NCCL's conventions): all-reduce with send == recv;
// reduce-scatter with recv == send + rank() * recv_count; all-gather with
// send == recv + rank() * send_count. Any other overlap of send and recv, overlapping
// all-to-all-v receive blocks, or an all-to-all-v send block overlapping a receive block
// is InvalidArgument.
//
// Limits: every MPI count (elements per call, per peer, and offsets) must fit in an int
// (max_count() = INT_MAX); larger is InvalidArgument naming the value. The agreement check
// validates against the same limit, so when one rank's count or offset is too large, every
// rank fails that operation promptly (its peers naming that rank); with check_agreement =
// false only that rank fails and its peers wait for the watchdog.
//
// MPI lifetime. The first factory call initialises MPI with MPI_Init_thread(
// MPI_THREAD_MULTIPLE) if nothing has yet. Who finalises:
// - If the caller initialised MPI itself, the caller finalises it (after destroying every
//   communicator). It must have asked for MPI_THREAD_MULTIPLE, or MPI_THREAD_SERIALIZED,
//   in which case this backend serialises its own MPI calls with a process-wide lock and
//   the caller must not call MPI concurrently with a live communicator. Lower levels are
//   FailedPrecondition, because the progress thread calls MPI.
// - If this backend initialised MPI, it finalises it at process exit (std::atexit).
//   Destroy every communicator before returning from main.
//
// Thread safety: one communicator may be used by one thread at a time, like the other
// backends; different communicators may be used from different threads.

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"

namespace gradsum {

struct MpiBackendOptions {
  // How long an operation waits for the other ranks (after it starts executing, i.e. after
  // the operations issued before it have finished) before DeadlineExceeded. Split
  // communicators inherit it.
  absl::Duration timeout = absl::Seconds(60);
  // Wrap the communicator in WithAgreementCheck (see above). Split communicators inherit it.
  bool check_agreement = true;
  // Synchronous calls that run on the caller's thread use blocking MPI under the watchdog
  // (see "Timeouts" above): raw-MPI latency, but a timeout ends the job. false: they use
  // non-blocking MPI polled with MPI_Test (Open MPI's non-blocking collectives cost ~5-15 us
  // more per call at small sizes), queued behind pending async operations, and a timeout
  // returns DeadlineExceeded. Every rank must use the same setting. Blocking needs
  // MPI_THREAD_MULTIPLE; under MPI_THREAD_SERIALIZED sync calls are non-blocking anyway.
  bool blocking_sync_calls = true;
};

// Returns a communicator over all processes of the job (a duplicate of MPI_COMM_WORLD).
// Collective: every process must call it. Initialises MPI if needed (see above).
// Errors: FailedPrecondition if MPI was finalised or initialised below
// MPI_THREAD_SERIALIZED; InvalidArgument if options.timeout is not positive;
// DeadlineExceeded if the other processes do not call it within options.timeout;
// Internal with MPI's message if MPI fails.
absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorldCommunicator(
    MpiBackendOptions options = {});

// Ends the whole MPI job at once: MPI_Abort(MPI_COMM_WORLD, code), which makes the launcher
// kill every process of the job (stopped ones included). For a fatal error that the other
// ranks may not know about (a collective timed out, a peer is stopped or dead): returning
// from main instead would wait in MPI_Finalize for that peer forever. Returns without doing
// anything if MPI is not initialised or already finalised (report the error, then call it).
void AbortMpiJob(int code);

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_MPI_BACKEND_H_
