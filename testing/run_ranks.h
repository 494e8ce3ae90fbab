#ifndef GRADSUM_TESTING_RUN_RANKS_H_
#define GRADSUM_TESTING_RUN_RANKS_H_

// Runs a function on `world` ranks of the thread backend, one thread per rank.
//
//   absl::Status s = RunRanks(4, [&](Communicator& comm) -> absl::Status {
//     return comm.AllReduce(buf[comm.rank()].data(), ..., DType::kF32, ReduceOp::kSum);
//   });
//
// Returns OK if every rank returned OK; otherwise the first failing rank's status,
// annotated with its rank number ("rank 2: ..."). The communicators are destroyed after
// every rank's function has returned. An invalid world size is InvalidArgument.

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "collectives/thread_backend.h"

namespace gradsum::testing {

absl::Status RunRanks(int world, const std::function<absl::Status(Communicator&)>& fn,
                      ThreadBackendOptions options = {});

// Like RunRanks, but returns every rank's status (index = rank), for tests that check
// how each rank failed. Only creating the communicators can fail as a whole.
absl::StatusOr<std::vector<absl::Status>> RunRanksPerRank(
    int world, const std::function<absl::Status(Communicator&)>& fn,
    ThreadBackendOptions options = {});

}  // namespace gradsum::testing

#endif  // GRADSUM_TESTING_RUN_RANKS_H_
