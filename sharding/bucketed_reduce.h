#ifndef GRADSUM_SHARDING_BUCKETED_REDUCE_H_
#define GRADSUM_SHARDING_BUCKETED_REDUCE_H_

// BucketedGradReducer: replicated-mode gradient reduction of several FlatParam groups that
// share one communicator, through one GradBucketer (collectives/bucketer.h). Many small
// groups (per-layer norms, routers) then travel in a few coalesced SUM all-reduces that
// start while backward is still producing earlier layers' gradients (SEMANTICS.md §7:
// replicated mode all-reduces once per step, after the last micro-batch).
//
//   // groups: replicated FlatParams over the same communicator, in forward order
//   GRADSUM_ASSIGN_OR_RETURN(auto reducer, BucketedGradReducer::Create(groups));
//   for (int m = 0; m < G; ++m) {
//     ... backward adds into each group's grad(i) (fp32, accumulating over micro-batches) ...
//     if (m == G - 1) {
//       for (int k = num_groups - 1; k >= 0; --k)               // as backward finishes each
//         GRADSUM_RETURN_IF_ERROR(reducer->GroupReady(k));
//       GRADSUM_RETURN_IF_ERROR(reducer->Finish());             // master_grad() = SUM
//     }
//   }
//
// Use it instead of FlatParam::ReduceGrad(/*last_micro_batch=*/true) for these groups
// (earlier micro-batches need no call: replicated gradients accumulate locally). The
// result is bit-identical to FlatParam's own all-reduce: the same per-element SUM in the
// group's reduce dtype.
//
// Exact groups (FlatParamOptions::exact_grads; all groups or none) travel as their int64
// limbs, canonicalised on the way into the buckets, plus one int64 per group for the
// rejected-contribution count; Finish converts the sums into master_grad() exactly as
// FlatParam's own exact all-reduce does (SEMANTICS.md §11).

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/bucketer.h"
#include "sharding/flat_param.h"

namespace gradsum {

class BucketedGradReducer {
 public:
  // `groups` (not owned, non-empty) must all be in replicated mode and share one
  // communicator; their parameters are registered in the given (forward) order. The caps
  // are GradBucketerOptions' (collectives/bucketer.h).
  // InvalidArgument otherwise (naming the group), or for invalid bucketer options.
  // Collective only in the sense that every rank must build the same reducer.
  static absl::StatusOr<std::unique_ptr<BucketedGradReducer>> Create(
      std::vector<FlatParam*> groups, size_t bucket_cap_bytes = size_t{25} << 20,
      size_t first_bucket_cap_bytes = 0);

  // Hands group `index`'s accumulated gradient to its buckets (copied, or rounded to bf16
  // for a bf16 reduce dtype) and marks it ready; full buckets launch their all-reduce.
  // InvalidArgument for a bad index; FailedPrecondition if already handed this step.
  absl::Status GroupReady(int index);

  // Waits for every bucket and writes the sums into each group's master_grad().
  // FailedPrecondition naming a group not handed over this step (the step stays open).
  absl::Status Finish();

  const GradBucketer& bucketer() const { return bucketer_; }

 private:
  explicit BucketedGradReducer(Communicator* comm, GradBucketerOptions options)
      : bucketer_(comm, options) {}
  absl::Status ExactGroupReady(int index);

  bool exact_ = false;
  std::vector<FlatParam*> groups_;
  // Bucketer ids of each group's parameters (exact mode: then its rejected count's).
  std::vector<std::vector<int>> param_ids_;
  std::vector<bool> handed_;                 // GroupReady called in the current step
  GradBucketer bucketer_;
};

}  // namespace gradsum

#endif  // GRADSUM_SHARDING_BUCKETED_REDUCE_H_
