#ifndef GRADSUM_COLLECTIVES_THREAD_BACKEND_H_
#define GRADSUM_COLLECTIVES_THREAD_BACKEND_H_

// The `thread` backend: ranks are threads of one process sharing memory.
//
//   auto comms = CreateThreadCommunicators(4, {.timeout = absl::Seconds(10)});
//   // thread r uses (*comms)[r]; every thread must call the same collectives.
//
// Reductions sum in ascending rank order with fp32 accumulation for bf16/f16/f32 and fp64
// for f64, rounding once (SEMANTICS.md §7), so results are deterministic and bit-identical
// on every rank, whoever computes them.
//
// How it works: an operation is a rendezvous of all ranks on shared memory: every rank
// posts a pointer to its arguments and bumps an atomic arrival counter, every rank checks
// that all agree, then all-reduce and reduce-scatter cut the buffer into chunks; whoever
// claims a chunk reduces it over every rank's send buffer and writes the result into every
// rank's recv buffer (reduce-scatter then all-gather in one pass, no gather to a root, no
// staging copy). Nobody returns until every rank is done with every buffer. Waiting spins
// for up to 50 us when the machine has at least as many cores as ranks, never otherwise,
// then sleeps on a futex, so 8 ranks run fine on 2 cores; each rank halves its spin budget
// after a wait longer than that cap (a descheduled peer), doubles it when spinning sufficed
// and adds 1 us after a short wait that slept, so a loaded machine stops spinning and an
// idle one starts again.
// Synchronous calls run on the caller's thread without allocating. Asynchronous calls
// are queued and run in issue order by a per-communicator worker thread, or by the
// caller's own thread when it waits on an operation nobody has started; a synchronous
// call issued while async ones are pending runs after them. An async call of at most
// 64 KiB issued when every peer is already waiting in that operation (and nothing of the
// rank's is queued) runs during the issue call; its handle is returned completed.
//
// Point-to-point (SendAsync / RecvAsync): posted at issue on the (source, destination, tag)
// channel of the group, not queued behind the collectives; whoever posts the second half of
// a pair compares counts and dtypes and copies the data (one memcpy, sender's buffer to
// receiver's). A mismatch fails both with InvalidArgument naming the peer and both sizes; a
// call invalid on one side (a null buffer with elements) fails its peer's half at once; a
// half never matched within `timeout` of its issue fails the waiting side with
// DeadlineExceeded naming the peer and breaks the group; a communicator destroyed with a
// half posted breaks the group, failing the peer's half at once.
//
// Failures:
// - Invalid arguments on one rank: InvalidArgument from that rank's call; its peers fail
//   the same operation with InvalidArgument naming the rank (no timeout), and later
//   operations still line up.
// - Ranks that disagree on operation, dtype, reduce op, count, root or the all-to-all-v
//   count matrix: every rank gets InvalidArgument naming the first mismatch, e.g.
//   "rank 2 passed count 10, rank 0 passed 12". The communicator stays usable.
// - A rank that does not arrive within `timeout`: the waiting ranks get DeadlineExceeded
//   naming the missing ranks; the group is then broken and every later call on any of its
//   communicators is FailedPrecondition. Destroying a communicator with an operation still
//   in flight also breaks its group (its peers fail instead of waiting).
// Destroying communicators never hangs; Work handles stay valid after their communicator
// is destroyed. Sub-communicators from Split() are independent of their parent and may
// outlive it.

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"

namespace gradsum {

struct ThreadBackendOptions {
  // How long a rank waits for the others at any collective before DeadlineExceeded.
  absl::Duration timeout = absl::Seconds(60);
};

// Creates `world` communicators (1 <= world <= 1024) that form one group. Communicator
// r must be used by exactly one thread at a time. world < 1 is InvalidArgument.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateThreadCommunicators(
    int world, ThreadBackendOptions options = {});

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_THREAD_BACKEND_H_
