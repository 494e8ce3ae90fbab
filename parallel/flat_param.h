#ifndef GRADSUM_PARALLEL_FLAT_PARAM_H_
#define GRADSUM_PARALLEL_FLAT_PARAM_H_

// FlatParam: a group of parameters flattened into one buffer and sharded over a group of
// ranks (layout, master storage, unshard), with its gradient side (SEMANTICS.md §7) held by
// a UnitGrad of the group's GradPrecision (parallel/unit_grad.h), to which it delegates.
//
// Layout. The parameters are laid end to end (in the given order) into a flat buffer of
// numel() elements, padded with zeros to padded_numel(), a multiple of the group size S.
// Group rank q owns the slice [q * shard_numel(), q * shard_numel() + local_numel()): its
// shard without the padding (ComputeShardLayout, parallel/shard_layout.h). Dense groups are
// sharded over the world; expert groups over their EDP group (the `group` communicator is
// whichever applies; it is not owned).
//
// Modes (FlatParamOptions::mode):
// - kSharded (FSDP / ZeRO-3): each rank keeps only its fp32 master shard. Unshard()
//   all-gathers the full parameters into a compute buffer (fp32 or bf16), Reshard() frees
//   it. Each micro-batch's full gradient is reduce-scattered with SUM (in the precision's
//   wire dtype) and added into a sharded accumulator.
// - kReplicated (DDP): each rank keeps the full fp32 master. Gradients accumulate locally
//   over the micro-batches; the last one all-reduces them with SUM over the group.
// Both modes present the optimizer with master() and master_grad(); their owned slices
// hold the same values, bit for bit when G == 1 on the thread backend (ascending-rank
// sums; with G > 1 the two modes add the same terms in a different order).
//
// One step on one rank (every rank of the group makes the same calls in the same order):
//
//   auto fp = FlatParam::Create("layer0", {{"wq", {64, 64}}, {"g", {64}}}, world, {});
//   GRADSUM_RETURN_IF_ERROR((*fp)->SetFullValue(0, init_wq));   // same values on every rank
//   for (int m = 0; m < G; ++m) {
//     GRADSUM_RETURN_IF_ERROR(fp->Unshard());                     // or StartUnshard() early
//     TensorView wq = *fp->param(0);                              // compute dtype
//     ... forward, backward: ADD d loss / d wq into *fp->grad(0) (fp32) ...
//     fp->Reshard();
//     GRADSUM_RETURN_IF_ERROR(fp->ReduceGrad(/*last_micro_batch=*/m == G - 1));
//   }
//   ... GlobalGradNorm / ClipGradNorm, ShardedAdamW::Step (optim/adamw.h) ...
//   fp->ZeroGrad();
//
// Gradient precision (FlatParamOptions::precision, core/grad_precision.h): kF32 and
// kBF16Wire hold an fp32 gradient and reduce it in f32 or bf16; kExact is below.
//
// Exact precision (GradPrecision::kExact, SEMANTICS.md §11): the gradient is held as
// exact fixed-point limbs (core/exact_sum.h) instead of fp32, so every sum over
// sequences, micro-batches and ranks is associative and the reduced gradient is the same
// bits at every mesh, sharding mode and G. Backward adds each contribution through
// AddExactGrad (or exact::AddFloats into exact_grad(), then CountRejectedExactGrad);
// grad() is FailedPrecondition. The reductions carry int64 limbs with SUM (a
// reduce-scatter every micro-batch or on the last one, or the last micro-batch's
// all-reduce, as in fp32 mode) plus, on the last micro-batch, one int64 all-reduce of
// the rejected-contribution count; FinishGradReduce of the last micro-batch converts the
// owned limbs to master_grad() (correctly rounded to fp32; all NaN when any contribution
// anywhere was non-finite or out of range; +-Inf where a sum left the range 2^29).
// Limits: at most exact::kMaxAddsBetweenNormalize - 1 contributions per element per
// micro-batch on a rank, and group sizes below exact::kMaxAddsBetweenNormalize.
// Memory: the full limb buffer is 16 bytes per element (4x the fp32 gradient it replaces);
// sharded mode adds a 16-byte-per-element shard accumulator and receive buffer. Parallel
// adds (the compute pool) go through grad_target()'s sink, or use exact::AddFloats on
// disjoint ranges of exact_grad() with their own rejected counts, handed to
// CountRejectedExactGrad by the rank's thread; AddExactGrad and CountRejectedExactGrad
// themselves are for the rank's thread only.
//
// Padding never leaks: padding elements of the master and of every gradient buffer are
// zero, and master(), master_grad(), norms and checkpoints exclude them.
//
// Thread safety: one thread per FlatParam (the rank's thread), like its communicator.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/default_init_allocator.h"
#include "core/dtype.h"
#include "core/exact_sum.h"
#include "core/grad_precision.h"
#include "core/grad_sink.h"
#include "core/half.h"
#include "core/tensor.h"
#include "parallel/shard_layout.h"
#include "parallel/unit_grad.h"

namespace gradsum {

struct FlatParamOptions {
  ShardingMode mode = ShardingMode::kSharded;
  // Dtype of the unsharded parameters that forward reads: kF32 or kBF16.
  DType compute_dtype = DType::kF32;
  // How the gradient is held and summed (core/grad_precision.h): kF32; kBF16Wire, a real
  // SUM of bf16-rounded gradients (accumulated in fp32 by the CPU backends, rounded once)
  // added into fp32 accumulators; kExact, the limbs described above.
  GradPrecision precision = GradPrecision::kF32;
  // Sharded mode: reduce-scatter every micro-batch's gradient (true), or let the full
  // gradient accumulate locally over the step and reduce-scatter it once, on the last
  // micro-batch (false: FSDP2's requires_gradient_sync off for the others; more memory,
  // fewer collectives). Replicated mode always reduces once, on the last micro-batch.
  bool reduce_every_micro_batch = true;
  // kSharded only: HSDP (SEMANTICS.md §7). The unit is sharded over `group` (the shard
  // group) and replicated over this one (the ranks with the same group rank in the other
  // shard groups; not owned, must outlive the FlatParam): the flat buffer is padded to a
  // multiple of both sizes' product, the last micro-batch's accumulated shard is
  // all-reduced with SUM across the replicas, and the rank owns (for norms and
  // checkpoints) slice group_rank * R + replica rank of the product-way split, inside its
  // shard. Null, or a group of one rank, means none.
  Communicator* replica_group = nullptr;
};

// A parameter to place in a group.
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// Where a parameter sits in the flat (unpadded) buffer.
struct FlatParamEntry {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // first flat element
  int64_t numel = 0;
};

class FlatParam {
 public:
  // `name` identifies the group in checkpoints: it must be unique among the groups of a
  // rank and, for groups holding different parameters on different ranks (expert groups
  // of different EP slots), unique across the world, e.g. "layer0.experts.ep1".
  // Parameter names must be unique within the group (and across the world for the
  // consolidated export). `group` must outlive the FlatParam.
  // InvalidArgument: null group, empty or duplicate names, negative dimensions, element
  // count overflow, compute dtype other than f32/bf16, a precision outside the enum, exact
  // precision over a group of exact::kMaxAddsBetweenNormalize ranks or more.
  static absl::StatusOr<std::unique_ptr<FlatParam>> Create(std::string name,
                                                           std::vector<ParamSpec> params,
                                                           Communicator* group,
                                                           FlatParamOptions options = {});

  FlatParam(const FlatParam&) = delete;
  FlatParam& operator=(const FlatParam&) = delete;
  ~FlatParam();

  const std::string& name() const { return name_; }
  Communicator* group() const { return group_; }
  const FlatParamOptions& options() const { return options_; }
  GradPrecision precision() const { return options_.precision; }
  const std::vector<FlatParamEntry>& entries() const { return entries_; }
  int num_params() const { return static_cast<int>(entries_.size()); }
  // Index of a parameter by name; NotFound naming it and the group.
  absl::StatusOr<int> IndexOf(absl::string_view param_name) const;

  int group_size() const { return group_size_; }
  int group_rank() const { return group_rank_; }
  int64_t numel() const { return numel_; }                // without padding
  int64_t padded_numel() const { return padded_numel_; }  // multiple of group_size()
  int64_t shard_numel() const { return shard_numel_; }    // padded_numel() / group_size()
  int64_t shard_offset() const { return shard_offset_; }  // group_rank() * shard_numel()
  // Valid (non-padding) elements of this rank's shard.
  int64_t local_numel() const { return local_numel_; }

  // What the rank owns (norms, checkpoints): slice owned_group_rank() of the
  // ComputeShardLayout split into owned_group_size() slices. Without a replica group that
  // is the group's split (the shard, or in replicated mode the slice the rank would
  // shard); with one (HSDP) it is the R-way split of the shard: owned_group_size() =
  // group_size() * R, owned_group_rank() = group_rank() * R + replica rank.
  int owned_group_size() const { return owned_group_size_; }
  int owned_group_rank() const { return owned_group_rank_; }
  int64_t owned_offset() const { return owned_offset_; }
  int64_t owned_numel() const { return owned_numel_; }
  // HSDP's replica group, or null.
  Communicator* replica_group() const { return options_.replica_group; }

  // ---- Master parameters (fp32), what the optimizer updates. ----

  // Flat elements [master_offset(), master_offset() + master().size()): the owned slice
  // in sharded mode, all numel() elements in replicated mode.
  absl::Span<float> master();
  absl::Span<const float> master() const;
  int64_t master_offset() const;
  // The step's reduced gradient, element for element beside master(). Complete after the
  // last micro-batch's FinishGradReduce().
  absl::Span<float> master_grad();
  absl::Span<const float> master_grad() const;

  // The owned slice [owned_offset(), + owned_numel()) of master() and master_grad(), in
  // every mode: what norms count and checkpoints store.
  absl::Span<const float> owned_master() const;
  absl::Span<const float> owned_grad() const;

  // Sets parameter `index` from its full values, which must be the same on every rank
  // (each rank keeps the part it owns). No communication. InvalidArgument on a bad index
  // or size; FailedPrecondition while an all-gather is in flight.
  absl::Status SetFullValue(int index, absl::Span<const float> full_values);

  // Called after master() changed (optimizer step, checkpoint load): drops the compute
  // buffer so the next Unshard() reads the new values. FailedPrecondition while an
  // all-gather is in flight.
  absl::Status MasterUpdated();

  // Counts the changes to the master announced through SetFullValue and MasterUpdated
  // (optimizer steps and checkpoint loads call the latter): a copy of the parameters made
  // elsewhere (the GPU path's device copy) is current while this number is unchanged.
  uint64_t master_version() const { return master_version_; }

  // ---- Forward: unshard / reshard. ----

  // Starts filling the compute buffer: an asynchronous all-gather of the master shards
  // (converted to the compute dtype) in sharded mode, a local copy in replicated mode.
  // Use it to prefetch the next group while the current one computes. No-op when already
  // unsharded or in flight.
  absl::Status StartUnshard();
  // Waits for StartUnshard's all-gather (up to the communicator's timeout).
  // FailedPrecondition if none was started; the collective's error otherwise.
  absl::Status WaitUnshard();
  // StartUnshard() + WaitUnshard().
  absl::Status Unshard();
  bool is_unsharded() const { return unshard_state_ == UnshardState::kReady; }
  // Bytes of the compute buffer held now (padded_numel() elements of the compute dtype
  // while unsharded or gathering, else 0), and what it holds when unsharded.
  int64_t unsharded_bytes() const;
  int64_t full_compute_bytes() const {
    return padded_numel_ * static_cast<int64_t>(DTypeSize(options_.compute_dtype));
  }
  bool unshard_in_flight() const { return unshard_state_ == UnshardState::kInFlight; }
  // Parameter `index` in the compute dtype, with its shape; valid until Reshard().
  // FailedPrecondition unless unsharded; InvalidArgument on a bad index.
  absl::StatusOr<TensorView> param(int index) const;
  // Frees the compute buffer. FailedPrecondition while an all-gather is in flight.
  absl::Status Reshard();

  // ---- Backward: gradients. ----

  // Where backward puts the gradient of parameters [first, first + count) (consecutive in
  // the flat buffer): ADDED into the fp32 gradient, or, in exact precision, into an
  // ExactGradSink over their limbs (see UnitGrad::Target). The target lives for one kernel
  // call, before the reduction starts. InvalidArgument on a bad range; FailedPrecondition
  // while a reduction is in flight.
  absl::StatusOr<GradTarget> grad_target(int first, int count = 1);
  // fp32 view of parameter `index`'s gradient in the full (padded_numel) gradient buffer.
  // Backward ADDS into it. Sharded mode: it holds one micro-batch and is zeroed by
  // FinishGradReduce(); replicated mode: it accumulates the step's micro-batches.
  // InvalidArgument on a bad index; FailedPrecondition in exact precision or while a
  // reduction is in flight.
  absl::StatusOr<TensorView> grad(int index);

  // ---- Exact precision (GradPrecision::kExact). ----

  // Element-major limbs (exact::kLimbs int64 per element) of parameter `index`'s full
  // gradient: e.numel * kLimbs words. Backward adds contributions with exact::AddFloats
  // and reports their rejected count with CountRejectedExactGrad. Like grad(), it holds
  // one micro-batch in sharded mode and the step in replicated mode.
  // FailedPrecondition outside exact mode or while a reduction is in flight;
  // InvalidArgument on a bad index.
  absl::StatusOr<absl::Span<int64_t>> exact_grad(int index);
  // Adds `values` into parameter `index`'s exact gradient at elements [offset, offset +
  // values.size()), counting rejected (non-finite, out-of-range) values. Errors as
  // exact_grad(), and InvalidArgument when the range leaves the parameter.
  absl::Status AddExactGrad(int index, int64_t offset, absl::Span<const float> values);
  // Counts contributions that exact::AddFloats rejected (they turn the group's reduced
  // gradient into NaN on every rank). n >= 0.
  void CountRejectedExactGrad(int64_t n) { grad_->CountRejected(n); }

  // Starts this micro-batch's reduction. Sharded: reduce-scatter (SUM, wire dtype) of
  // the full gradient, every micro-batch (or only when `last_micro_batch` if
  // !reduce_every_micro_batch). Replicated: all-reduce (SUM, wire dtype) when
  // `last_micro_batch`, nothing otherwise. FailedPrecondition if one is already in
  // flight; the collective's error otherwise.
  absl::Status StartGradReduce(bool last_micro_batch);
  // Waits for it and folds the result into master_grad(). OK if nothing was started.
  // HSDP: both stages (the in-group reduce-scatter, then the cross-replica all-reduce).
  absl::Status FinishGradReduce();
  // HSDP: moves the last micro-batch's reduction to its second stage when its first is in
  // flight (waits for the in-group reduce-scatter, starts the cross-replica all-reduce), so
  // that the all-reduce overlaps what the caller does next. OK and nothing otherwise.
  absl::Status AdvanceGradReduce();
  // StartGradReduce() + FinishGradReduce().
  absl::Status ReduceGrad(bool last_micro_batch);
  bool grad_reduce_in_flight() const { return grad_->reduce_in_flight(); }

  // Folds a gradient reduced outside this FlatParam (on a GPU, by NCCL: parallel/cuda) into
  // master_grad(), as FinishGradReduce folds its own collective's fp32 result. Sharded:
  // `reduced` is this rank's SUM-reduce-scattered shard of one micro-batch (shard_numel()
  // elements), added into the fp32 accumulator; call it every micro-batch instead of
  // ReduceGrad; with a replica group (HSDP, SEMANTICS.md §7) `reduced` is the shard group's
  // reduce-scatter, and the last micro-batch's call then starts the accumulated shard's SUM
  // across the replicas over the host replica group: in flight afterwards, so what the
  // caller does next overlaps it, and complete after FinishGradReduce (the second stage of
  // the FlatParam's own collectives, here started from outside). Replicated: `reduced` is the
  // step's SUM-all-reduced full gradient (padded_numel() elements), given once with
  // last_micro_batch. The local full gradient buffer is not read. InvalidArgument for a wrong size
  // or (replicated) a call that is not the last micro-batch's; FailedPrecondition while a reduction
  // is in flight; Unimplemented in exact precision.
  absl::Status FoldReducedGrad(absl::Span<const float> reduced, bool last_micro_batch);

  // Zeroes master_grad() and the full gradient buffer: call after the optimizer step.
  // FailedPrecondition while a reduction is in flight.
  absl::Status ZeroGrad();

  // Sum of squares of owned_grad(), in fp64 (SEMANTICS.md §7: summed over the world it
  // counts every element exactly once).
  double OwnedGradSquaredNorm() const;
  // The same sum, exact (core/exact_sum.h), added into `sum`: what the exact precision's
  // global norm uses, so the norm does not depend on how the elements are split.
  void AddOwnedGradSquares(exact::ExactScalar& sum) const;

  // The gradient side itself, for a reduction outside this FlatParam (BucketedGradReducer:
  // UnitGrad::ToWire / FromWire). The FlatParam keeps the protocol: hand it over only
  // while no reduction of its own is in flight.
  UnitGrad& unit_grad() { return *grad_; }
  const UnitGrad& unit_grad() const { return *grad_; }

 private:
  enum class UnshardState { kNone, kInFlight, kReady };

  FlatParam() = default;
  bool sharded() const { return options_.mode == ShardingMode::kSharded; }
  bool exact() const { return IsExact(options_.precision); }
  absl::Status CheckIndex(int index) const;
  // FailedPrecondition naming `what` while a gradient reduction is in flight.
  absl::Status CheckNoGradReduce(absl::string_view what) const;

  std::string name_;
  Communicator* group_ = nullptr;
  FlatParamOptions options_;
  std::vector<FlatParamEntry> entries_;
  int group_size_ = 1;
  int group_rank_ = 0;
  int64_t numel_ = 0;
  int64_t padded_numel_ = 0;
  int64_t shard_numel_ = 0;
  int64_t shard_offset_ = 0;
  int64_t local_numel_ = 0;
  int owned_group_size_ = 1;
  int owned_group_rank_ = 0;
  int64_t owned_offset_ = 0;
  int64_t owned_numel_ = 0;

  // Sharded: shard_numel() elements (padding zero). Replicated: padded_numel() elements.
  std::vector<float> master_;
  uint64_t master_version_ = 0;

  // Compute buffer (padded_numel elements of the compute dtype) and the unshard transfer.
  // Not zeroed when it grows: the all-gather (or the replicated copy) writes every element.
  std::vector<float, DefaultInitAllocator<float>> compute_f32_;
  std::vector<BF16> compute_bf16_;
  std::vector<BF16> gather_send_bf16_;
  UnshardState unshard_state_ = UnshardState::kNone;
  std::unique_ptr<Work> unshard_work_;

  // The gradient side: local gradient, reduction, master_grad() (parallel/unit_grad.h).
  std::unique_ptr<UnitGrad> grad_;
};

}  // namespace gradsum

#endif  // GRADSUM_PARALLEL_FLAT_PARAM_H_
