#ifndef GRADSUM_COLLECTIVES_CHECKED_COMMUNICATOR_H_
#define GRADSUM_COLLECTIVES_CHECKED_COMMUNICATOR_H_

// The cross-rank agreement check as a decorator over any Communicator (as c10d's
// ProcessGroupWrapper): before each operation, every rank checks its own arguments with
// the one validation every backend uses (op_descriptor.h ValidateCall) and all-reduces a
// fixed-size descriptor of the call (operation, dtype, reduce op, count, root, sync or
// async, and whether the call was locally invalid; 14 int64) with MAX through the inner
// communicator. All
// ranks see the same reduced descriptor, so all reach the same verdict:
// - a rank whose own arguments are invalid gets InvalidArgument naming the value; its peers
//   get InvalidArgument naming that rank and carrying its message (one extra broadcast from
//   it, on this failure only) instead of waiting for it, and later operations still line
//   up; arguments are checked against the wrapped backend's max_count();
// - ranks that disagree all get InvalidArgument naming the field and both values, e.g.
//   "mpi all_reduce #3 (rank 1 of 2): ranks disagree on the element count: 10 vs 12
//   (this rank: 12)", and no data moves;
// - ranks that issue one operation in different forms (sync on one rank, async or with a
//   per-call timeout on another) fail the same way ("ranks disagree on sync versus
//   async"): the mpi backend runs sync calls as blocking MPI and async ones as
//   non-blocking MPI, which never match each other;
// - for all-to-all-v, also each rank's send count against its peer's receive count
//   (one all-to-all of counts and one all-gather of reports).
// Nothing is formatted unless a check fails.
//
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> raw, MakeSomeBackend());
//   std::unique_ptr<Communicator> comm = WithAgreementCheck(std::move(raw));
//
// The mpi backend's factory applies it by default (MpiBackendOptions::check_agreement).
// The thread backend needs no decorator: its rendezvous already shares every rank's
// arguments, so it compares them there at no extra cost.
//
// A stream-ordered device backend (nccl, whose operations take device buffers) is checked
// over a host communicator instead, as c10d's ProcessGroupWrapper checks NCCL over Gloo:
// WithAgreementCheckOver(nccl, host) exchanges the descriptors (and, on failure, the
// message) through `host` and moves the data through `nccl`. The nccl factory does this
// over a split of its bootstrap communicator (NcclBackendOptions::check_agreement). For
// such a backend the local check also asks the backend whether each buffer is memory it can
// use (DeviceStream::CheckBuffer: device memory), so one rank's host buffer fails every
// rank; and no exchange runs inside a coalesced group (DeviceStream::coalescing(): a fused
// launch is checked by nobody, as before).
//
// Cost: one small all-reduce per operation, run synchronously when the operation is
// issued, async forms included (the check must finish before the data may move). An
// async operation's issue therefore waits until every rank has issued it, as with
// ProcessGroupWrapper; turn the check off for speed once a program is known good.
// Sub-communicators from Split() are checked too (with a host exchange, over the same
// split of it).

#include <memory>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"

namespace gradsum {

// Wraps `inner` (which must not be null). Local arguments are checked against
// inner->max_count() (MPI: INT_MAX), so a count or offset that `inner` would reject fails
// every rank here: its own rank with the value, the peers naming that rank.
std::unique_ptr<Communicator> WithAgreementCheck(std::unique_ptr<Communicator> inner);

// The same with the descriptors exchanged through `exchange` (owned; a host communicator
// over the same processes, rank r of one being rank r of the other) while the operations
// run on `inner`. Split() splits both the same way. InvalidArgument naming both when their
// rank or size differ.
absl::StatusOr<std::unique_ptr<Communicator>> WithAgreementCheckOver(
    std::unique_ptr<Communicator> inner, std::unique_ptr<Communicator> exchange);

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_CHECKED_COMMUNICATOR_H_
