#include "parallel/flat_param.h"

#include <algorithm>
#include <limits>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum {

absl::StatusOr<std::unique_ptr<FlatParam>> FlatParam::Create(std::string name,
                                                             std::vector<ParamSpec> params,
                                                             Communicator* group,
                                                             FlatParamOptions options) {
  if (group == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("flat param group \"", name, "\": null communicator"));
  }
  if (name.empty()) return absl::InvalidArgumentError("flat param group name is empty");
  if (options.compute_dtype != DType::kF32 && options.compute_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("flat param group \"", name, "\": dtype ",
                                                   DTypeName(options.compute_dtype),
                                                   " is not f32 or bf16"));
  }
  if (options.mode != ShardingMode::kSharded && options.mode != ShardingMode::kReplicated) {
    return absl::InvalidArgumentError(
        absl::StrCat("flat param group \"", name, "\": bad mode ", static_cast<int>(options.mode)));
  }
  Communicator* replicas = options.replica_group;
  if (replicas != nullptr && options.mode != ShardingMode::kSharded) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flat param group \"", name, "\": a replica group (HSDP) needs mode sharded, not ",
        ShardingModeName(options.mode)));
  }
  std::unique_ptr<FlatParam> fp(new FlatParam());
  fp->name_ = std::move(name);
  fp->group_ = group;
  fp->options_ = options;
  fp->group_size_ = group->size();
  fp->group_rank_ = group->rank();
  std::set<std::string> seen;
  int64_t offset = 0;
  for (ParamSpec& p : params) {
    if (p.name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("flat param group \"", fp->name_, "\": a parameter has an empty name"));
    }
    if (!seen.insert(p.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("flat param group \"", fp->name_,
                                                     "\": duplicate parameter \"", p.name, "\""));
    }
    absl::StatusOr<int64_t> n = NumElements(p.shape);
    if (!n.ok()) return Annotate(n.status(), absl::StrCat("parameter \"", p.name, "\""));
    if (*n > std::numeric_limits<int64_t>::max() / 2 - offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "flat param group \"", fp->name_, "\": element count overflows at \"", p.name, "\""));
    }
    fp->entries_.push_back({std::move(p.name), std::move(p.shape), offset, *n});
    offset += *n;
  }
  fp->numel_ = offset;
  ShardLayout layout = ComputeShardLayout(offset, fp->group_size_, fp->group_rank_);
  ShardLayout owned = layout;
  fp->owned_group_size_ = fp->group_size_;
  fp->owned_group_rank_ = fp->group_rank_;
  if (replicas != nullptr && replicas->size() > 1) {
    // HSDP: padded to a multiple of S * R, so the shard splits into the R owned slices.
    const int R = replicas->size();
    fp->owned_group_size_ = fp->group_size_ * R;
    fp->owned_group_rank_ = fp->group_rank_ * R + replicas->rank();
    owned = ComputeShardLayout(offset, fp->owned_group_size_, fp->owned_group_rank_);
    layout.padded_numel = owned.padded_numel;
    layout.shard_numel = owned.padded_numel / fp->group_size_;
    layout.shard_offset = fp->group_rank_ * layout.shard_numel;
    layout.local_numel = std::clamp<int64_t>(offset - layout.shard_offset, 0, layout.shard_numel);
  }
  fp->owned_offset_ = owned.shard_offset;
  fp->owned_numel_ = owned.local_numel;
  fp->padded_numel_ = layout.padded_numel;
  fp->shard_numel_ = layout.shard_numel;
  fp->shard_offset_ = layout.shard_offset;
  fp->local_numel_ = layout.local_numel;
  fp->master_.assign(fp->sharded() ? fp->shard_numel_ : fp->padded_numel_, 0.0f);
  UnitGradOptions grad;
  grad.name = fp->name_;
  grad.group = group;
  grad.replica_group = replicas;
  grad.mode = options.mode;
  grad.reduce_every_micro_batch = options.reduce_every_micro_batch;
  grad.numel = offset;
  grad.layout = layout;
  GRADSUM_ASSIGN_OR_RETURN(fp->grad_, UnitGrad::Create(options.precision, std::move(grad)));
  return fp;
}

FlatParam::~FlatParam() {
  // An in-flight collective still reads or writes our buffers: let it finish first (the
  // UnitGrad waits for its own).
  if (unshard_work_) unshard_work_->Wait(group_->timeout()).IgnoreError();
}

absl::StatusOr<int> FlatParam::IndexOf(absl::string_view param_name) const {
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].name == param_name) return static_cast<int>(i);
  }
  return absl::NotFoundError(
      absl::StrCat("no parameter \"", param_name, "\" in flat param group \"", name_, "\""));
}

absl::Status FlatParam::CheckIndex(int index) const {
  if (index < 0 || index >= num_params()) {
    return absl::InvalidArgumentError(absl::StrCat("parameter index ", index, " out of range [0, ",
                                                   num_params(), ") in group \"", name_, "\""));
  }
  return absl::OkStatus();
}

absl::Status FlatParam::CheckNoGradReduce(absl::string_view what) const {
  if (grad_->reduce_in_flight()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": ", what, " while a gradient reduction is in flight"));
  }
  return absl::OkStatus();
}

absl::Span<float> FlatParam::master() {
  return absl::MakeSpan(master_.data(), sharded() ? local_numel_ : numel_);
}
absl::Span<const float> FlatParam::master() const {
  return absl::MakeConstSpan(master_.data(), sharded() ? local_numel_ : numel_);
}
int64_t FlatParam::master_offset() const { return sharded() ? shard_offset_ : 0; }

absl::Span<float> FlatParam::master_grad() { return grad_->master_grad(); }
absl::Span<const float> FlatParam::master_grad() const {
  return static_cast<const UnitGrad&>(*grad_).master_grad();
}

absl::Span<const float> FlatParam::owned_master() const {
  return absl::MakeConstSpan(master_.data() + (owned_offset_ - master_offset()), owned_numel_);
}
absl::Span<const float> FlatParam::owned_grad() const {
  // Sharded: inside the accumulator (shard_numel elements); replicated: the full gradient.
  return absl::MakeConstSpan(master_grad().data() + (owned_offset_ - master_offset()),
                             owned_numel_);
}

absl::Status FlatParam::SetFullValue(int index, absl::Span<const float> full_values) {
  GRADSUM_RETURN_IF_ERROR(CheckIndex(index));
  const FlatParamEntry& e = entries_[index];
  if (static_cast<int64_t>(full_values.size()) != e.numel) {
    return absl::InvalidArgumentError(absl::StrCat("parameter \"", e.name, "\" has ", e.numel,
                                                   " elements, got ", full_values.size()));
  }
  if (unshard_state_ == UnshardState::kInFlight) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": SetFullValue while an all-gather is in flight"));
  }
  // Intersect [e.offset, e.offset + numel) with the flat range this rank stores.
  const int64_t stored_begin = master_offset();
  const int64_t stored_end = stored_begin + static_cast<int64_t>(master().size());
  const int64_t begin = std::max(e.offset, stored_begin);
  const int64_t end = std::min(e.offset + e.numel, stored_end);
  for (int64_t i = begin; i < end; ++i) master_[i - stored_begin] = full_values[i - e.offset];
  return MasterUpdated();
}

absl::Status FlatParam::MasterUpdated() {
  if (unshard_state_ == UnshardState::kInFlight) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": master changed while an all-gather is in flight"));
  }
  ++master_version_;
  return Reshard();
}

absl::Status FlatParam::StartUnshard() {
  if (unshard_state_ != UnshardState::kNone) return absl::OkStatus();
  const bool bf16 = options_.compute_dtype == DType::kBF16;
  if (bf16) {
    compute_bf16_.resize(padded_numel_);
  } else {
    compute_f32_.resize(padded_numel_);
  }
  if (!sharded()) {
    // Replicated: the full master is here; the compute buffer is a (converted) copy.
    if (bf16) {
      for (int64_t i = 0; i < padded_numel_; ++i) compute_bf16_[i] = BF16::FromFloat(master_[i]);
    } else {
      std::copy(master_.begin(), master_.end(), compute_f32_.begin());
    }
    unshard_state_ = UnshardState::kReady;
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Work>> work;
  if (bf16) {
    // Gather bf16 (half the bytes); the shard is rounded once, as a bf16 compute copy is.
    gather_send_bf16_.resize(shard_numel_);
    for (int64_t i = 0; i < shard_numel_; ++i) gather_send_bf16_[i] = BF16::FromFloat(master_[i]);
    work = group_->AllGatherAsync(gather_send_bf16_.data(), compute_bf16_.data(), shard_numel_,
                                  DType::kBF16);
  } else {
    work = group_->AllGatherAsync(master_.data(), compute_f32_.data(), shard_numel_, DType::kF32);
  }
  if (!work.ok()) return Annotate(work.status(), absl::StrCat("unshard of group \"", name_, "\""));
  unshard_work_ = std::move(*work);
  unshard_state_ = UnshardState::kInFlight;
  return absl::OkStatus();
}

int64_t FlatParam::unsharded_bytes() const {
  return unshard_state_ == UnshardState::kNone ? 0 : full_compute_bytes();
}

absl::Status FlatParam::WaitUnshard() {
  if (unshard_state_ == UnshardState::kReady) return absl::OkStatus();
  if (unshard_state_ == UnshardState::kNone) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": WaitUnshard without StartUnshard"));
  }
  bool in_flight;
  const absl::Status s = AwaitWork(*group_, unshard_work_, &in_flight);
  if (!s.ok()) {
    if (!in_flight) unshard_state_ = UnshardState::kNone;
    return Annotate(s, absl::StrCat("unshard of group \"", name_, "\""));
  }
  unshard_state_ = UnshardState::kReady;
  return absl::OkStatus();
}

absl::Status FlatParam::Unshard() {
  GRADSUM_RETURN_IF_ERROR(StartUnshard());
  return WaitUnshard();
}

absl::StatusOr<TensorView> FlatParam::param(int index) const {
  GRADSUM_RETURN_IF_ERROR(CheckIndex(index));
  if (unshard_state_ != UnshardState::kReady) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\" is not unsharded; call Unshard() before param()"));
  }
  const FlatParamEntry& e = entries_[index];
  void* base = options_.compute_dtype == DType::kBF16
                   ? static_cast<void*>(const_cast<BF16*>(compute_bf16_.data()) + e.offset)
                   : static_cast<void*>(const_cast<float*>(compute_f32_.data()) + e.offset);
  return TensorView::Create(e.numel > 0 ? base : nullptr, options_.compute_dtype, e.shape);
}

absl::Status FlatParam::Reshard() {
  if (unshard_state_ == UnshardState::kInFlight) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": Reshard while an all-gather is in flight"));
  }
  // Really release the memory: this is what sharding saves.
  decltype(compute_f32_)().swap(compute_f32_);
  std::vector<BF16>().swap(compute_bf16_);
  std::vector<BF16>().swap(gather_send_bf16_);
  unshard_state_ = UnshardState::kNone;
  return absl::OkStatus();
}

absl::StatusOr<GradTarget> FlatParam::grad_target(int first, int count) {
  GRADSUM_RETURN_IF_ERROR(CheckIndex(first));
  if (count < 1 || count > num_params() - first) {
    return absl::InvalidArgumentError(absl::StrCat("parameters [", first, ", ", first + count,
                                                   ") out of range [0, ", num_params(),
                                                   ") in group \"", name_, "\""));
  }
  GRADSUM_RETURN_IF_ERROR(CheckNoGradReduce("grad_target()"));
  const FlatParamEntry& last = entries_[first + count - 1];
  const int64_t offset = entries_[first].offset;
  return grad_->Target(offset, last.offset + last.numel - offset);
}

absl::StatusOr<TensorView> FlatParam::grad(int index) {
  GRADSUM_RETURN_IF_ERROR(CheckIndex(index));
  if (exact()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\" holds exact gradients: add into exact_grad(", index,
                     ") or AddExactGrad, not the fp32 grad()"));
  }
  GRADSUM_RETURN_IF_ERROR(CheckNoGradReduce("grad()"));
  const FlatParamEntry& e = entries_[index];
  return TensorView::Create(e.numel > 0 ? grad_->local_f32().data() + e.offset : nullptr,
                            DType::kF32, e.shape);
}

absl::StatusOr<absl::Span<int64_t>> FlatParam::exact_grad(int index) {
  if (!exact()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": exact_grad() outside exact precision (precision=",
                     GradPrecisionName(options_.precision), ")"));
  }
  GRADSUM_RETURN_IF_ERROR(CheckIndex(index));
  GRADSUM_RETURN_IF_ERROR(CheckNoGradReduce("exact_grad()"));
  const FlatParamEntry& e = entries_[index];
  return grad_->local_limbs().subspan(e.offset * exact::kLimbs, e.numel * exact::kLimbs);
}

absl::Status FlatParam::AddExactGrad(int index, int64_t offset, absl::Span<const float> values) {
  GRADSUM_ASSIGN_OR_RETURN(absl::Span<int64_t> limbs, exact_grad(index));
  const int64_t numel = entries_[index].numel;
  const int64_t n = static_cast<int64_t>(values.size());
  if (offset < 0 || offset > numel || n > numel - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("group \"", name_, "\": AddExactGrad of ", n, " values at offset ", offset,
                     " leaves parameter \"", entries_[index].name, "\" (", numel, " elements)"));
  }
  int64_t rejected = 0;
  GRADSUM_RETURN_IF_ERROR(exact::AddFloats(
      values, limbs.subspan(offset * exact::kLimbs, n * exact::kLimbs), &rejected));
  grad_->CountRejected(rejected);
  return absl::OkStatus();
}

absl::Status FlatParam::StartGradReduce(bool last_micro_batch) {
  if (grad_->reduce_in_flight()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": a gradient reduction is already in flight"));
  }
  return grad_->StartReduce(last_micro_batch);
}

absl::Status FlatParam::FinishGradReduce() {
  if (!grad_->reduce_in_flight()) return absl::OkStatus();
  return grad_->FinishReduce();
}

absl::Status FlatParam::AdvanceGradReduce() {
  if (!grad_->reduce_in_flight()) return absl::OkStatus();
  return grad_->Advance();
}

absl::Status FlatParam::FoldReducedGrad(absl::Span<const float> reduced, bool last_micro_batch) {
  GRADSUM_RETURN_IF_ERROR(CheckNoGradReduce("FoldReducedGrad"));
  GRADSUM_RETURN_IF_ERROR(grad_->FoldReduced(reduced, last_micro_batch));
  if (!last_micro_batch) return absl::OkStatus();
  return grad_->StartFoldedReplicaReduce();
}

absl::Status FlatParam::ReduceGrad(bool last_micro_batch) {
  GRADSUM_RETURN_IF_ERROR(StartGradReduce(last_micro_batch));
  return FinishGradReduce();
}

absl::Status FlatParam::ZeroGrad() {
  GRADSUM_RETURN_IF_ERROR(CheckNoGradReduce("ZeroGrad"));
  grad_->Zero();
  return absl::OkStatus();
}

double FlatParam::OwnedGradSquaredNorm() const {
  double sum = 0.0;
  for (float g : owned_grad()) sum += static_cast<double>(g) * static_cast<double>(g);
  return sum;
}

void FlatParam::AddOwnedGradSquares(exact::ExactScalar& sum) const { sum.AddSquares(owned_grad()); }

}  // namespace gradsum
