#ifndef GRADSUM_LOSSES_PARALLEL_H_
#define GRADSUM_LOSSES_PARALLEL_H_

// ParallelFor for the loss kernels: core/thread_pool.h's, on the process's one persistent
// pool (no threads are started per call). Runs `fn(task)` for task in [0, num_tasks) on up
// to `num_threads` threads (the caller's included), handing out tasks dynamically; results
// must not depend on which thread ran a task (the kernels write per-row outputs and reduce
// them in row order).
//
//   ParallelFor(2, num_blocks, [&](int64_t b) { ProcessBlock(b); });

#include "core/thread_pool.h"

namespace gradsum::losses {

using ::gradsum::ParallelFor;

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_PARALLEL_H_
