#include "sharding/flat_param.h"

#include <algorithm>
#include <limits>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum {

const char* ShardingModeName(ShardingMode mode) {
  switch (mode) {
    case ShardingMode::kSharded: return "sharded";
    case ShardingMode::kReplicated: return "replicated";
  }
  return "invalid";
}

absl::StatusOr<std::unique_ptr<FlatParam>> FlatParam::Create(std::string name,
                                                             std::vector<ParamSpec> params,
                                                             Communicator* group,
                                                             FlatParamOptions options) {
  if (group == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("flat param group \"", name, "\": null communicator"));
  }
  if (name.empty()) return absl::InvalidArgumentError("flat param group name is empty");
  for (DType t : {options.compute_dtype, options.reduce_dtype}) {
    if (t != DType::kF32 && t != DType::kBF16) {
      return absl::InvalidArgumentError(absl::StrCat("flat param group \"", name, "\": dtype ",
                                                     DTypeName(t), " is not f32 or bf16"));
    }
  }
  if (options.mode != ShardingMode::kSharded && options.mode != ShardingMode::kReplicated) {
    return absl::InvalidArgumentError(absl::StrCat("flat param group \"", name, "\": bad mode ",
                                                   static_cast<int>(options.mode)));
  }
  if (options.exact_grads && options.reduce_dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("flat param group \"", name, "\": exact gradients travel as int64 limbs; ",
                     "reduce dtype ", DTypeName(options.reduce_dtype), " does not apply (use f32)"));
  }
  if (options.exact_grads && group->size() >= exact::kMaxAddsBetweenNormalize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flat param group \"", name, "\": exact gradients sum at most ",
        exact::kMaxAddsBetweenNormalize - 1, " ranks, the group has ", group->size()));
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
      return absl::InvalidArgumentError(
          absl::StrCat("flat param group \"", fp->name_, "\": element count overflows at \"", p.name, "\""));
    }
    fp->entries_.push_back({std::move(p.name), std::move(p.shape), offset, *n});
    offset += *n;
  }
  fp->numel_ = offset;
  const ShardLayout layout = ComputeShardLayout(offset, fp->group_size_, fp->group_rank_);
  fp->padded_numel_ = layout.padded_numel;
  fp->shard_numel_ = layout.shard_numel;
  fp->shard_offset_ = layout.shard_offset;
  fp->local_numel_ = layout.local_numel;
  fp->master_.assign(fp->sharded() ? fp->shard_numel_ : fp->padded_numel_, 0.0f);
  if (fp->sharded()) fp->grad_accum_.assign(fp->shard_numel_, 0.0f);
  if (fp->exact()) {
    // The limbs take full_grad_'s role; fp32 holds only the reduced gradient (replicated
    // mode's master_grad is full_grad_).
    fp->exact_full_.assign(fp->padded_numel_ * exact::kLimbs, 0);
    if (fp->sharded()) {
      fp->exact_accum_.assign(fp->shard_numel_ * exact::kLimbs, 0);
    } else {
      fp->full_grad_.assign(fp->padded_numel_, 0.0f);
    }
  } else {
    fp->full_grad_.assign(fp->padded_numel_, 0.0f);
  }
  return fp;
}

FlatParam::~FlatParam() {
  // An in-flight collective still reads or writes our buffers: let it finish first.
  if (unshard_work_) unshard_work_->Wait(group_->timeout()).IgnoreError();
  if (grad_work_) grad_work_->Wait(group_->timeout()).IgnoreError();
  if (rejected_work_) rejected_work_->Wait(group_->timeout()).IgnoreError();
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

absl::Span<float> FlatParam::master() {
  return absl::MakeSpan(master_.data(), sharded() ? local_numel_ : numel_);
}
absl::Span<const float> FlatParam::master() const {
  return absl::MakeConstSpan(master_.data(), sharded() ? local_numel_ : numel_);
}
int64_t FlatParam::master_offset() const { return sharded() ? shard_offset_ : 0; }

absl::Span<float> FlatParam::master_grad() {
  return sharded() ? absl::MakeSpan(grad_accum_.data(), local_numel_)
                   : absl::MakeSpan(full_grad_.data(), numel_);
}
absl::Span<const float> FlatParam::master_grad() const {
  return sharded() ? absl::MakeConstSpan(grad_accum_.data(), local_numel_)
                   : absl::MakeConstSpan(full_grad_.data(), numel_);
}

absl::Span<const float> FlatParam::owned_master() const {
  return sharded() ? master() : absl::MakeConstSpan(master_.data() + shard_offset_, local_numel_);
}
absl::Span<const float> FlatParam::owned_grad() const {
  return sharded() ? master_grad()
                   : absl::MakeConstSpan(full_grad_.data() + shard_offset_, local_numel_);
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
  const absl::Status s = AwaitWork(unshard_work_, &in_flight);
  if (!s.ok()) {
    if (!in_flight) unshard_state_ = UnshardState::kNone;
    return Annotate(s, absl::StrCat("unshard of group \"", name_, "\""));
  }
  unshard_state_ = UnshardState::kReady;
  return absl::OkStatus();
}

absl::Status FlatParam::AwaitWork(std::unique_ptr<Work>& work, bool* in_flight) const {
  const absl::Status s = work->Wait(group_->OperationWaitLimit());
  *in_flight = !s.ok() && absl::IsDeadlineExceeded(s) && !work->IsCompleted();
  if (!*in_flight) work.reset();
  return s;
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

absl::StatusOr<TensorView> FlatParam::grad(int index) {
  GRADSUM_RETURN_IF_ERROR(CheckIndex(index));
  if (exact()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group \"", name_, "\" holds exact gradients: add into exact_grad(", index,
        ") or AddExactGrad, not the fp32 grad()"));
  }
  if (grad_work_) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": grad() while a gradient reduction is in flight"));
  }
  const FlatParamEntry& e = entries_[index];
  return TensorView::Create(e.numel > 0 ? full_grad_.data() + e.offset : nullptr, DType::kF32,
                            e.shape);
}

absl::Span<float> FlatParam::full_grad() {
  if (exact()) return {};
  return absl::MakeSpan(full_grad_.data(), numel_);
}

absl::StatusOr<absl::Span<int64_t>> FlatParam::exact_grad(int index) {
  if (!exact()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": exact_grad() outside exact mode (exact_grads=false)"));
  }
  GRADSUM_RETURN_IF_ERROR(CheckIndex(index));
  if (grad_work_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group \"", name_, "\": exact_grad() while a gradient reduction is in flight"));
  }
  const FlatParamEntry& e = entries_[index];
  return absl::MakeSpan(exact_full_.data() + e.offset * exact::kLimbs, e.numel * exact::kLimbs);
}

absl::Status FlatParam::AddExactGrad(int index, int64_t offset, absl::Span<const float> values) {
  GRADSUM_ASSIGN_OR_RETURN(absl::Span<int64_t> limbs, exact_grad(index));
  const int64_t numel = entries_[index].numel;
  const int64_t n = static_cast<int64_t>(values.size());
  if (offset < 0 || offset > numel || n > numel - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group \"", name_, "\": AddExactGrad of ", n, " values at offset ", offset,
        " leaves parameter \"", entries_[index].name, "\" (", numel, " elements)"));
  }
  return exact::AddFloats(values, limbs.subspan(offset * exact::kLimbs, n * exact::kLimbs),
                          &exact_rejected_);
}

absl::Span<int64_t> FlatParam::exact_full_grad() {
  if (!exact()) return {};
  return absl::MakeSpan(exact_full_.data(), numel_ * exact::kLimbs);
}

absl::Status FlatParam::StartGradReduce(bool last_micro_batch) {
  if (grad_work_) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": a gradient reduction is already in flight"));
  }
  if (exact()) return StartExactGradReduce(last_micro_batch);
  // Padding must stay zero whatever backward did, so it never enters a sum.
  std::fill(full_grad_.begin() + numel_, full_grad_.end(), 0.0f);
  // Replicated mode (or sharded without reduce_every_micro_batch), not the last
  // micro-batch: DDP's no_sync, gradients accumulate here.
  if ((!sharded() || !options_.reduce_every_micro_batch) && !last_micro_batch) {
    return absl::OkStatus();
  }
  const bool bf16 = options_.reduce_dtype == DType::kBF16;
  if (bf16) {
    reduce_send_bf16_.resize(padded_numel_);
    for (int64_t i = 0; i < padded_numel_; ++i) {
      reduce_send_bf16_[i] = BF16::FromFloat(full_grad_[i]);
    }
  }
  absl::StatusOr<std::unique_ptr<Work>> work;
  if (sharded()) {
    // SEMANTICS.md §7: every micro-batch's full gradient is reduce-scattered with SUM.
    if (bf16) {
      reduce_recv_bf16_.resize(shard_numel_);
      work = group_->ReduceScatterAsync(reduce_send_bf16_.data(), reduce_recv_bf16_.data(),
                                        shard_numel_, DType::kBF16, ReduceOp::kSum);
    } else {
      reduce_recv_f32_.resize(shard_numel_);
      work = group_->ReduceScatterAsync(full_grad_.data(), reduce_recv_f32_.data(), shard_numel_,
                                        DType::kF32, ReduceOp::kSum);
    }
    grad_work_is_allreduce_ = false;
  } else {
    // SEMANTICS.md §7: replicated mode all-reduces SUM once per step.
    if (bf16) {
      work = group_->AllReduceAsync(reduce_send_bf16_.data(), reduce_send_bf16_.data(),
                                    padded_numel_, DType::kBF16, ReduceOp::kSum);
    } else {
      work = group_->AllReduceAsync(full_grad_.data(), full_grad_.data(), padded_numel_,
                                    DType::kF32, ReduceOp::kSum);
    }
    grad_work_is_allreduce_ = true;
  }
  if (!work.ok()) {
    return Annotate(work.status(), absl::StrCat("gradient reduction of group \"", name_, "\""));
  }
  grad_work_ = std::move(*work);
  return absl::OkStatus();
}

absl::Status FlatParam::StartExactGradReduce(bool last_micro_batch) {
  // Padding stays zero; the limbs are canonical before they are summed (every
  // micro-batch, so the per-micro-batch contribution limit holds over a whole step).
  std::fill(exact_full_.begin() + numel_ * exact::kLimbs, exact_full_.end(), 0);
  GRADSUM_RETURN_IF_ERROR(exact::Normalize(absl::MakeSpan(exact_full_)));
  if ((!sharded() || !options_.reduce_every_micro_batch) && !last_micro_batch) {
    return absl::OkStatus();
  }
  const std::string what = absl::StrCat("exact gradient reduction of group \"", name_, "\"");
  absl::StatusOr<std::unique_ptr<Work>> work;
  if (sharded()) {
    exact_recv_.resize(shard_numel_ * exact::kLimbs);
    work = group_->ReduceScatterAsync(exact_full_.data(), exact_recv_.data(),
                                      shard_numel_ * exact::kLimbs, DType::kI64, ReduceOp::kSum);
  } else {
    work = group_->AllReduceAsync(exact_full_.data(), exact_full_.data(),
                                  padded_numel_ * exact::kLimbs, DType::kI64, ReduceOp::kSum);
  }
  if (!work.ok()) return Annotate(work.status(), what);
  grad_work_ = std::move(*work);
  grad_work_is_allreduce_ = !sharded();
  grad_work_last_ = last_micro_batch;
  if (last_micro_batch) {
    // Issued right behind the limbs, in the same order on every rank.
    work = group_->AllReduceAsync(&exact_rejected_, &exact_rejected_total_, 1, DType::kI64,
                                  ReduceOp::kSum);
    if (!work.ok()) return Annotate(work.status(), what);
    rejected_work_ = std::move(*work);
  }
  return absl::OkStatus();
}

absl::Status FlatParam::FinishExactGradReduce() {
  const std::string what = absl::StrCat("exact gradient reduction of group \"", name_, "\"");
  bool in_flight;
  absl::Status s = AwaitWork(grad_work_, &in_flight);
  if (in_flight) return Annotate(s, what);
  if (rejected_work_) {
    const absl::Status r = AwaitWork(rejected_work_, &in_flight);
    if (in_flight) return Annotate(r, what);
    if (s.ok()) s = r;
  }
  if (!s.ok()) return Annotate(s, what);
  if (grad_work_is_allreduce_) {
    // Replicated: the step's summed limbs, converted once into master_grad().
    return exact::ToFloats(absl::MakeConstSpan(exact_full_.data(), numel_ * exact::kLimbs),
                           exact_rejected_total_, absl::MakeSpan(full_grad_.data(), numel_));
  }
  // Sharded: add this micro-batch's summed shard into the limb accumulator (canonical +
  // a sum of group_size canonical buffers: within the normalisation budget).
  GRADSUM_RETURN_IF_ERROR(exact::AddLimbs(exact_recv_, absl::MakeSpan(exact_accum_)));
  GRADSUM_RETURN_IF_ERROR(exact::Normalize(absl::MakeSpan(exact_accum_)));
  std::fill(exact_full_.begin(), exact_full_.end(), 0);
  if (!grad_work_last_) return absl::OkStatus();
  grad_accum_empty_ = false;
  return exact::ToFloats(absl::MakeConstSpan(exact_accum_.data(), local_numel_ * exact::kLimbs),
                         exact_rejected_total_, absl::MakeSpan(grad_accum_.data(), local_numel_));
}

absl::Status FlatParam::FinishGradReduce() {
  if (!grad_work_) return absl::OkStatus();
  if (exact()) return FinishExactGradReduce();
  bool in_flight;
  const absl::Status s = AwaitWork(grad_work_, &in_flight);
  if (!s.ok()) return Annotate(s, absl::StrCat("gradient reduction of group \"", name_, "\""));
  const bool bf16 = options_.reduce_dtype == DType::kBF16;
  if (grad_work_is_allreduce_) {
    if (bf16) {
      for (int64_t i = 0; i < padded_numel_; ++i) full_grad_[i] = reduce_send_bf16_[i].ToFloat();
    }
    return absl::OkStatus();
  }
  // Sharded: fold this micro-batch's summed shard into the fp32 accumulator.
  if (bf16) {
    float* acc = grad_accum_.data();
    const BF16* in = reduce_recv_bf16_.data();
    if (grad_accum_empty_) {
      for (int64_t i = 0; i < shard_numel_; ++i) acc[i] = in[i].ToFloat();
    } else {
      for (int64_t i = 0; i < shard_numel_; ++i) acc[i] += in[i].ToFloat();
    }
    grad_accum_empty_ = false;
    std::fill(full_grad_.begin(), full_grad_.end(), 0.0f);
  } else {
    AccumulateShard(reduce_recv_f32_.data());
  }
  return absl::OkStatus();
}

void FlatParam::AccumulateShard(const float* in) {
  float* acc = grad_accum_.data();
  if (grad_accum_empty_) {
    std::copy(in, in + shard_numel_, acc);
  } else {
    for (int64_t i = 0; i < shard_numel_; ++i) acc[i] += in[i];
  }
  grad_accum_empty_ = false;
  std::fill(full_grad_.begin(), full_grad_.end(), 0.0f);
}

absl::Status FlatParam::FoldReducedGrad(absl::Span<const float> reduced, bool last_micro_batch) {
  if (exact()) {
    return absl::UnimplementedError(absl::StrCat(
        "group \"", name_, "\": exact gradients are reduced as int64 limbs by FlatParam or "
        "BucketedGradReducer; an fp32 gradient reduced elsewhere (the GPU path) cannot be "
        "folded in"));
  }
  if (grad_work_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group \"", name_, "\": FoldReducedGrad while a gradient reduction is in flight"));
  }
  if (!sharded()) {
    if (!last_micro_batch) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group \"", name_,
          "\": replicated mode folds the step's all-reduced gradient once, on the last "
          "micro-batch (last_micro_batch=false)"));
    }
    if (static_cast<int64_t>(reduced.size()) != padded_numel_) {
      return absl::InvalidArgumentError(
          absl::StrCat("group \"", name_, "\": reduced gradient has ", reduced.size(),
                       " elements, expected padded_numel ", padded_numel_));
    }
    std::copy(reduced.begin(), reduced.begin() + numel_, full_grad_.begin());
    std::fill(full_grad_.begin() + numel_, full_grad_.end(), 0.0f);  // padding never leaks
    return absl::OkStatus();
  }
  if (static_cast<int64_t>(reduced.size()) != shard_numel_) {
    return absl::InvalidArgumentError(
        absl::StrCat("group \"", name_, "\": reduced shard has ", reduced.size(),
                     " elements, expected shard_numel ", shard_numel_));
  }
  AccumulateShard(reduced.data());
  std::fill(grad_accum_.begin() + local_numel_, grad_accum_.end(), 0.0f);  // padding
  return absl::OkStatus();
}

absl::Status FlatParam::ReduceGrad(bool last_micro_batch) {
  GRADSUM_RETURN_IF_ERROR(StartGradReduce(last_micro_batch));
  return FinishGradReduce();
}

absl::Status FlatParam::ZeroGrad() {
  if (grad_work_) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", name_, "\": ZeroGrad while a gradient reduction is in flight"));
  }
  std::fill(full_grad_.begin(), full_grad_.end(), 0.0f);
  std::fill(grad_accum_.begin(), grad_accum_.end(), 0.0f);
  grad_accum_empty_ = true;
  std::fill(exact_full_.begin(), exact_full_.end(), 0);
  std::fill(exact_accum_.begin(), exact_accum_.end(), 0);
  exact_rejected_ = 0;
  exact_rejected_total_ = 0;
  return absl::OkStatus();
}

double FlatParam::OwnedGradSquaredNorm() const {
  double sum = 0.0;
  for (float g : owned_grad()) sum += static_cast<double>(g) * static_cast<double>(g);
  return sum;
}

void FlatParam::AddOwnedGradSquares(exact::ExactScalar& sum) const {
  sum.AddSquares(owned_grad());
}

}  // namespace gradsum
