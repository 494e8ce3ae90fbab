#ifndef GRADSUM_PARALLEL_BUCKETED_REDUCE_H_
#define GRADSUM_PARALLEL_BUCKETED_REDUCE_H_

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
// group's wire dtype. What goes into and comes out of the buckets is the group's
// UnitGrad's (ToWire / FromWire, parallel/unit_grad.h): a bucket of floats, bf16 or int64
// limbs is the same bucket.
//
// Device buckets (a GPU model, train/cuda): with a BucketedGradDevice the buckets live in
// its memory and are reduced over its communicator (NCCL, standing for the groups' host
// one). The caller puts each parameter's gradient into its bucket view, grad_view(group,
// k) (in the reduce dtype, by its own device copy), before GroupReady, which then only
// marks them; Finish copies each reduced bucket to the host once, folds it into the
// masters as above and zeroes the buckets (so a caller may also accumulate in the views).
//
// Exact groups (GradPrecision::kExact; all groups or none; host buckets only,
// Unimplemented with device buckets) travel as their int64 limbs, canonicalised on the way
// into the buckets, plus one int64 per group for the rejected-contribution count; Finish
// converts the sums into master_grad() exactly as FlatParam's own exact all-reduce does
// (SEMANTICS.md §11).
//
// BucketedUnitReducers below applies this to a model's units over several communicators
// (the world's units and the EDP group's), for both the host and the device model.

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/bucketer.h"
#include "parallel/flat_param.h"

namespace gradsum {

// Where device buckets live and what reduces them (see above). Not owned.
struct BucketedGradDevice {
  Communicator* comm = nullptr;  // same rank and size as the groups' host communicator
  BucketMemory* memory = nullptr;
};

class BucketedGradReducer {
 public:
  // `groups` (not owned, non-empty) must all be in replicated mode and share one
  // communicator; their parameters are registered in the given (forward) order. The caps
  // are GradBucketerOptions' (collectives/bucketer.h).
  // InvalidArgument otherwise (naming the group), or for invalid bucketer options.
  // Collective only in the sense that every rank must build the same reducer.
  // `device`: device buckets (see above); InvalidArgument if its communicator's rank or
  // size differ from the groups'.
  static absl::StatusOr<std::unique_ptr<BucketedGradReducer>> Create(
      std::vector<FlatParam*> groups, size_t bucket_cap_bytes = size_t{25} << 20,
      size_t first_bucket_cap_bytes = 0, const BucketedGradDevice* device = nullptr);

  // Hands group `index`'s accumulated gradient to its buckets (host buckets: copied,
  // rounded to bf16, or canonical limbs; device buckets: already there) and marks it
  // ready, its last parameter first; full buckets launch their all-reduce.
  // InvalidArgument for a bad index; FailedPrecondition if already handed this step.
  absl::Status GroupReady(int index);

  // Waits for every bucket and writes the sums into each group's master_grad().
  // FailedPrecondition naming a group not handed over this step (the step stays open).
  absl::Status Finish();

  // Drops a step that failed part-way (GradBucketer::AbandonStep): nothing is folded, the
  // buckets are zeroed and every group may be handed over again.
  absl::Status Abandon();

  // Group `index`'s parameter k's bucket view (device buckets: where its gradient goes).
  // Precondition: both in range.
  TensorView grad_view(int index, int k) const { return bucketer_.grad(param_ids_[index][k]); }

  const GradBucketer& bucketer() const { return bucketer_; }

 private:
  explicit BucketedGradReducer(Communicator* comm, GradBucketerOptions options)
      : bucketer_(comm, options) {}
  bool device_ = false;
  std::vector<FlatParam*> groups_;
  // Bucketer ids of each group's parameters, and of its rejected count (-1: none).
  std::vector<std::vector<int>> param_ids_;
  std::vector<int> rejected_ids_;
  std::vector<bool> handed_;                // GroupReady called in the current step
  std::vector<std::pair<int, int>> owner_;  // bucketer id -> (group, parameter or -1)
  GradBucketer bucketer_;
};

// Replicated-mode reduction of a model's units (parallel/unit_schedule.h's UnitStore, host
// and device): the units are split by communicator into BucketedGradReducers, each unit's
// parameters registered in forward order, and handed over as backward completes them.
class BucketedUnitReducers {
 public:
  // `units`: replicated FlatParams in forward order. `device_comms` (device buckets, one
  // entry per unit) / `memory`: as BucketedGradDevice, per unit; both null for host
  // buckets. Errors of BucketedGradReducer::Create.
  static absl::StatusOr<BucketedUnitReducers> Create(
      const std::vector<FlatParam*>& units, size_t bucket_cap_bytes, size_t first_bucket_cap_bytes,
      const std::vector<Communicator*>* device_comms = nullptr, BucketMemory* memory = nullptr);
  BucketedUnitReducers() = default;

  // Unit u's gradient is complete (last micro-batch): BucketedGradReducer::GroupReady.
  absl::Status Ready(int u);
  // Finishes every reducer that was handed a unit this step.
  absl::Status Finish();
  // Abandons every reducer's step (BucketedGradReducer::Abandon).
  absl::Status Abandon();
  // Unit u's parameter k's bucket view. Precondition: both in range.
  TensorView grad_view(int u, int k) const;

 private:
  std::vector<std::unique_ptr<BucketedGradReducer>> reducers_;
  std::vector<std::pair<int, int>> reducer_of_;  // unit -> (reducer, index in it)
  std::vector<bool> handed_;                     // reducer got units this step
};

}  // namespace gradsum

#endif  // GRADSUM_PARALLEL_BUCKETED_REDUCE_H_
