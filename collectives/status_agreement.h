#ifndef GRADSUM_COLLECTIVES_STATUS_AGREEMENT_H_
#define GRADSUM_COLLECTIVES_STATUS_AGREEMENT_H_

// Agreement on the outcome of rank-local work, so that a failure found by one rank outside
// a collective (a file it cannot read or write, a check only it makes) reaches every rank
// at once instead of leaving the others waiting in their next collective until the timeout.
//
//   absl::Status local = WriteMyFiles();
//   GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, local, "checkpoint save"));
//
// Every rank calls it at the same point. If every rank is OK the result is OK. Otherwise
// every rank returns the same status: the code of the lowest failing rank and a message
// naming every failing rank with its own message ("checkpoint save failed on rank 1 of 2:
// DATA_LOSS: ..."), so whichever rank reports the error shows the real cause. The result is
// marked (IsAgreedFailure) so that a caller can tell an error every rank knows about (the
// job can end normally, rank 0 reporting) from a local one (a collective that timed out: the
// job must be aborted). An agreed failure passed in again is returned as is, without
// communicating (every rank has it, so every rank skips the exchange).
//
// If the agreement's own collective fails (a peer is gone or stopped), the local status is
// returned when it is an error, else the communication error, unmarked.

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "collectives/communicator.h"

namespace gradsum {

absl::Status AgreeOnStatus(Communicator& world, const absl::Status& local, absl::string_view what);

// True for a status returned by AgreeOnStatus for a failure (every rank has it).
bool IsAgreedFailure(const absl::Status& s);

// Marks `s` (not OK) as known to every rank. For callers whose error is identical on every
// rank by construction (decided from a value all ranks received in a collective).
absl::Status MarkAgreed(absl::Status s);

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_STATUS_AGREEMENT_H_
