#ifndef GRADSUM_TESTING_RUN_RANKS_H_
#define GRADSUM_TESTING_RUN_RANKS_H_

// Runs a function on `world` ranks of the thread backend, one thread per rank.
//
//   absl::Status s = RunRanks(4, [&](Communicator& comm) -> absl::Status {
//     return comm.AllReduce(buf[comm.rank()].data(), ..., DType::kF32, ReduceOp::kSum);
//   });
//
// Returns OK if every rank returned OK; otherwise the first failing rank's status,
// annotated with its rank number.

#include <functional>

#include "absl/status/status.h"
#include "collectives/communicator.h"
#include "collectives/thread_backend.h"

namespace gradsum::testing {

absl::Status RunRanks(int world, const std::function<absl::Status(Communicator&)>& fn,
                      ThreadBackendOptions options = {});

}  // namespace gradsum::testing

#endif  // GRADSUM_TESTING_RUN_RANKS_H_
