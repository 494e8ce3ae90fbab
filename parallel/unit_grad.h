#ifndef GRADSUM_PARALLEL_UNIT_GRAD_H_
#define GRADSUM_PARALLEL_UNIT_GRAD_H_

// UnitGrad: the gradient side of one parameter unit (a FlatParam, parallel/flat_param.h):
// the local full gradient that backward adds into, its SUM reduction over the unit's
// group (SEMANTICS.md §7), and the reduced fp32 gradient the optimizer reads. One
// implementation per GradPrecision (core/grad_precision.h), chosen once when the unit is
// made:
// - f32 and bf16 on the wire: an fp32 local gradient, reduced in f32, or rounded to bf16
//   for the collective and widened back into fp32 accumulators;
// - exact: int64 limbs (core/exact_sum.h, SEMANTICS.md §11), canonicalised every
//   micro-batch, reduced as i64 with the rejected-contribution count beside them, and
//   rounded once to fp32 on the step's last micro-batch.
// FlatParam keeps the protocol (which call is allowed when, and errors naming the group);
// UnitGrad does the work behind it and states the protocol as preconditions.
// BucketedGradReducer (parallel/bucketed_reduce.h) moves replicated units' gradients
// through shared buckets with ToWire / FromWire.
//
//   GRADSUM_ASSIGN_OR_RETURN(auto grad, UnitGrad::Create(GradPrecision::kExact, options));
//   GradTarget t = grad->Target(/*offset=*/0, numel);   // backward adds through it
//   ... t goes away (an exact sink reports its rejected count) ...
//   GRADSUM_RETURN_IF_ERROR(grad->StartReduce(/*last_micro_batch=*/true));
//   GRADSUM_RETURN_IF_ERROR(grad->FinishReduce());       // master_grad() = SUM
//
// Flat elements [0, numel) are the parameters, [numel, padded_numel) padding: zero before
// every sum, never in master_grad(). Sharded: master_grad() is the rank's reduced shard
// [shard_offset, + local_numel); replicated: all numel elements.
//
// Thread safety: one thread (the rank's), except the exact sinks (Target).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/grad_precision.h"
#include "core/grad_sink.h"
#include "parallel/shard_layout.h"

namespace gradsum {

// Where a unit's gradient lives and how it is reduced: everything but the precision.
struct UnitGradOptions {
  std::string name;               // the unit's, for messages
  Communicator* group = nullptr;  // the group its gradient is summed over; not owned
  // Sharded only: HSDP's replica group (SEMANTICS.md §7), the ranks holding the same shard
  // in the other shard groups; the accumulated shard is all-reduced with SUM over it on the
  // last micro-batch. Null (or a group of one) means none. Not owned.
  Communicator* replica_group = nullptr;
  ShardingMode mode = ShardingMode::kSharded;
  // Sharded: reduce-scatter every micro-batch (true) or the accumulated gradient on the
  // last one only (false). Replicated units reduce on the last micro-batch.
  bool reduce_every_micro_batch = true;
  int64_t numel = 0;   // parameter elements, without padding
  ShardLayout layout;  // ComputeShardLayout(numel, group size, group rank)
};

class UnitGrad {
 public:
  // InvalidArgument for a precision outside the enum, or an exact gradient over a group
  // of exact::kMaxAddsBetweenNormalize ranks or more.
  static absl::StatusOr<std::unique_ptr<UnitGrad>> Create(GradPrecision precision,
                                                          UnitGradOptions options);
  UnitGrad(const UnitGrad&) = delete;
  UnitGrad& operator=(const UnitGrad&) = delete;
  virtual ~UnitGrad() = default;

  GradPrecision precision() const { return precision_; }

  // ---- Backward: the local gradient (padded_numel elements). ----

  // Where contributions to flat elements [offset, offset + numel) go: ADDED into the fp32
  // local gradient, or (exact) into an ExactGradSink over its limbs, which pool threads may
  // call on disjoint ranges and which hands its rejected count to CountRejected when it
  // goes away. Preconditions: the range lies in [0, numel); no reduction in flight; the
  // target goes away before the next StartReduce.
  virtual GradTarget Target(int64_t offset, int64_t numel) = 0;
  // The local gradient as stored: fp32 (f32 / bf16 wire) or limbs (exact, kLimbs int64
  // per element); the other is empty. Sharded: one micro-batch (zeroed by FinishReduce);
  // replicated: the step. Padding included.
  virtual absl::Span<float> local_f32() { return {}; }
  virtual absl::Span<int64_t> local_limbs() { return {}; }
  // Exact: counts contributions that exact::AddFloats rejected on this rank this step
  // (non-finite or out of range: they make the reduced gradient NaN on every rank), and
  // the count so far. Float precisions have nothing to reject: ignored, 0.
  virtual void CountRejected(int64_t n) { (void)n; }
  virtual int64_t rejected() const { return 0; }

  // ---- Its own reduction (FlatParam::StartGradReduce and friends). ----

  // Zeroes the padding (exact: canonicalises the limbs) and starts this micro-batch's SUM:
  // sharded, a reduce-scatter every micro-batch (or only the last one's without
  // reduce_every_micro_batch); replicated, an all-reduce on the last micro-batch. On the
  // others nothing is sent. Precondition: none in flight. The collective's error.
  virtual absl::Status StartReduce(bool last_micro_batch) = 0;
  // Waits for it (Communicator::OperationWaitLimit) and folds the result into
  // master_grad(). Precondition: one in flight. A wait that times out keeps it in flight.
  // With a replica group (HSDP), the last micro-batch's reduction has two stages: the
  // in-group reduce-scatter, then the all-reduce of the accumulated shard across the
  // replicas; FinishReduce completes both.
  absl::Status FinishReduce();
  // HSDP, for a gradient reduced outside (FoldReduced): starts the accumulated shard's SUM
  // across the replicas (in flight afterwards; FinishReduce completes it). Call it after the
  // last micro-batch's FoldReduced; without a replica group nothing. Precondition: none in
  // flight. The collective's error.
  absl::Status StartFoldedReplicaReduce();
  // HSDP: if the last micro-batch's in-group reduce-scatter is in flight, waits for it,
  // folds it and starts the cross-replica all-reduce (still in flight afterwards, so the
  // next stage's compute overlaps it). Otherwise nothing. The collective's error.
  absl::Status Advance();
  bool reduce_in_flight() const { return work_ != nullptr; }
  // Folds an fp32 gradient SUM-reduced elsewhere (FlatParam::FoldReducedGrad has the
  // contract). Precondition: none in flight. InvalidArgument for a wrong size or a
  // replicated call before the last micro-batch; Unimplemented for exact (the limbs never
  // leave through an fp32 path).
  virtual absl::Status FoldReduced(absl::Span<const float> reduced, bool last_micro_batch) = 0;
  // Zeroes the local and reduced gradients and the counts. Precondition: none in flight.
  virtual void Zero();

  // ---- A reduction outside (replicated units in shared buckets). ----

  // Each element travels as this many words of GradWireDType(precision()): 1, or
  // exact::kLimbs.
  int64_t wire_words_per_element() const;
  // Exact: the unit's rejected count (rejected()) travels too, as one more i64 word summed
  // beside the limbs, and is given back to FromWire.
  bool carries_rejected_count() const { return IsExact(precision_); }
  // Writes local elements [offset, offset + numel) to `wire` (numel *
  // wire_words_per_element() words of the wire dtype): copied, rounded to bf16, or
  // canonical limbs.
  virtual absl::Status ToWire(int64_t offset, int64_t numel, void* wire) = 0;
  // Reads their SUM back into master_grad()[offset, + numel): copied, widened from bf16,
  // or rounded once from the limbs (all NaN when global_rejected > 0).
  virtual absl::Status FromWire(int64_t offset, int64_t numel, const void* wire,
                                int64_t global_rejected) = 0;

  // ---- The reduced gradient (fp32), what the optimizer reads. ----

  // Sharded: the owned shard's local_numel elements; replicated: all numel elements.
  // Complete after the last micro-batch's FinishReduce (or FoldReduced, FromWire).
  absl::Span<float> master_grad();
  absl::Span<const float> master_grad() const;
  // Its owned slice [shard_offset, + local_numel) in both modes.
  absl::Span<const float> owned_grad() const;

 protected:
  UnitGrad(GradPrecision precision, UnitGradOptions options)
      : precision_(precision), o_(std::move(options)) {}
  bool sharded() const { return o_.mode == ShardingMode::kSharded; }
  // HSDP: the last micro-batch's shard is also summed across replicas.
  bool across_replicas() const {
    return sharded() && o_.replica_group != nullptr && o_.replica_group->size() > 1;
  }
  // Reduces on this micro-batch (else the gradient keeps accumulating locally).
  bool ReducesNow(bool last_micro_batch) const {
    return last_micro_batch || (sharded() && o_.reduce_every_micro_batch);
  }
  std::string What() const;  // "gradient reduction of group \"name\""
  // Waits for a reduction in flight (ignoring its status): the implementations' destructors
  // call it before their buffers go, since the collective may still read or write them.
  void WaitInFlight(std::unique_ptr<Work>& work) const;

  // The stages FinishReduce and Advance sequence (one order for every precision; the
  // implementations give what their buffers need). FinishGroup: waits for the in-group
  // collective(s) in work_ and folds the result. StartReplica (HSDP): starts the
  // accumulated shard's SUM across the replicas into work_ (work_is_replica_).
  // FinishReplica: waits for it (AwaitReplica) and makes the result master_grad().
  virtual absl::Status FinishGroup() = 0;
  virtual absl::Status StartReplica() = 0;
  virtual absl::Status FinishReplica() = 0;
  // FinishReplica's wait: the cross-replica work_, annotated with `what`; a wait that times
  // out keeps it in flight.
  absl::Status AwaitReplica(absl::string_view what);

  const GradPrecision precision_;
  const UnitGradOptions o_;
  // fp32 full gradient, padded_numel: f32 / bf16 wire, the local gradient (replicated:
  // then the reduced one); exact, replicated only, the reduced one.
  std::vector<float> full_;
  // Sharded: the reduced shard, shard_numel fp32 (padding zero).
  std::vector<float> accum_;
  bool accum_empty_ = true;  // the first fold copies instead of adding (keeps -0)
  std::unique_ptr<Work> work_;
  bool work_is_allreduce_ = false;
  // HSDP: work_ is the cross-replica all-reduce of the accumulated shard (over
  // o_.replica_group), not the in-group reduce-scatter.
  bool work_is_replica_ = false;
  bool work_last_ = false;  // the reduction in flight is the last micro-batch's
};

// Waits for `work` on `group` (Communicator::OperationWaitLimit). If it is still in flight
// then: DeadlineExceeded, *in_flight = true, and `work` is kept (its buffers stay in use;
// a later wait can finish it). Otherwise *in_flight = false, `work` is released and its
// status returned.
absl::Status AwaitWork(const Communicator& group, std::unique_ptr<Work>& work, bool* in_flight);

}  // namespace gradsum

#endif  // GRADSUM_PARALLEL_UNIT_GRAD_H_
