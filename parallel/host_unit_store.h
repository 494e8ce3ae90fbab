#ifndef GRADSUM_PARALLEL_HOST_UNIT_STORE_H_
#define GRADSUM_PARALLEL_HOST_UNIT_STORE_H_

// The host's UnitStore (parallel/unit_schedule.h): units are FlatParams gathered and
// reduced over the host communicators (parallel/flat_param.h). The compute reads their
// compute buffers (bf16 units widened once per gather to fp32, exactly) and adds into their
// fp32 gradient buffers, or, with exact gradients, into their limbs through an
// ExactGradSink. Replicated mode reduces through BucketedUnitReducers (one GradBucketer per
// communicator: the world's units, the EDP group's) on the last micro-batch.

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/flat_param.h"
#include "parallel/parallel_options.h"
#include "parallel/unit_schedule.h"

namespace gradsum::parallel {

// `units` (not owned) must outlive the store.
absl::StatusOr<std::unique_ptr<UnitStore>> MakeHostUnitStore(std::vector<FlatParam*> units,
                                                             const ParallelOptions& options);

}  // namespace gradsum::parallel

#endif  // GRADSUM_PARALLEL_HOST_UNIT_STORE_H_
