#ifndef GRADSUM_COLLECTIVES_THREAD_BACKEND_H_
#define GRADSUM_COLLECTIVES_THREAD_BACKEND_H_

// The `thread` backend: ranks are threads of one process sharing memory.
//
//   auto comms = CreateThreadCommunicators(4, {.timeout = absl::Seconds(10)});
//   // thread r uses (*comms)[r]; every thread must call the same collectives.
//
// Reductions sum in ascending rank order with fp32 (or wider) accumulation, so results
// are deterministic and bit-identical on every rank. Waits block (condition variables),
// never spin, so 8 ranks run fine on 2 cores.

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
