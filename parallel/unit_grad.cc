#include "parallel/unit_grad.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/exact_sum.h"
#include "core/half.h"
#include "core/status.h"

namespace gradsum {

absl::Status AwaitWork(const Communicator& group, std::unique_ptr<Work>& work, bool* in_flight) {
  const absl::Status s = work->Wait(group.OperationWaitLimit());
  *in_flight = !s.ok() && absl::IsDeadlineExceeded(s) && !work->IsCompleted();
  if (!*in_flight) work.reset();
  return s;
}

void UnitGrad::WaitInFlight(std::unique_ptr<Work>& work) const {
  if (work) work->Wait(o_.group->timeout()).IgnoreError();
}

absl::Status UnitGrad::FinishReduce() {
  if (work_is_replica_) return FinishReplica();
  const bool replica_next = across_replicas() && work_last_;
  GRADSUM_RETURN_IF_ERROR(FinishGroup());
  if (!replica_next) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(StartReplica());
  return FinishReplica();
}

absl::Status UnitGrad::StartFoldedReplicaReduce() {
  if (!across_replicas()) return absl::OkStatus();
  if (work_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(What(), ": a reduction is in flight; the replica stage runs after it"));
  }
  return StartReplica();
}

absl::Status UnitGrad::Advance() {
  if (work_ == nullptr || work_is_replica_ || !(across_replicas() && work_last_)) {
    return absl::OkStatus();
  }
  GRADSUM_RETURN_IF_ERROR(FinishGroup());
  return StartReplica();
}

absl::Status UnitGrad::AwaitReplica(absl::string_view what) {
  bool in_flight;
  const absl::Status s = AwaitWork(*o_.replica_group, work_, &in_flight);
  if (!in_flight) work_is_replica_ = false;
  if (!s.ok()) return Annotate(s, what);
  return absl::OkStatus();
}

std::string UnitGrad::What() const {
  return absl::StrCat("gradient reduction of group \"", o_.name, "\"");
}

int64_t UnitGrad::wire_words_per_element() const { return IsExact(precision_) ? exact::kLimbs : 1; }

absl::Span<float> UnitGrad::master_grad() {
  return sharded() ? absl::MakeSpan(accum_.data(), o_.layout.local_numel)
                   : absl::MakeSpan(full_.data(), o_.numel);
}
absl::Span<const float> UnitGrad::master_grad() const {
  return sharded() ? absl::MakeConstSpan(accum_.data(), o_.layout.local_numel)
                   : absl::MakeConstSpan(full_.data(), o_.numel);
}
absl::Span<const float> UnitGrad::owned_grad() const {
  return sharded()
             ? master_grad()
             : absl::MakeConstSpan(full_.data() + o_.layout.shard_offset, o_.layout.local_numel);
}

void UnitGrad::Zero() {
  std::fill(full_.begin(), full_.end(), 0.0f);
  std::fill(accum_.begin(), accum_.end(), 0.0f);
  accum_empty_ = true;
}

namespace {

// ---- f32 and bf16 on the wire: an fp32 local gradient. ----

class FloatUnitGrad final : public UnitGrad {
 public:
  FloatUnitGrad(GradPrecision precision, UnitGradOptions options)
      : UnitGrad(precision, std::move(options)), bf16_(precision == GradPrecision::kBF16Wire) {
    full_.assign(o_.layout.padded_numel, 0.0f);
    if (sharded()) accum_.assign(o_.layout.shard_numel, 0.0f);
  }
  ~FloatUnitGrad() override { WaitInFlight(work_); }

  GradTarget Target(int64_t offset, int64_t numel) override {
    return GradTarget::Accumulate(full_.data() + offset, numel);
  }
  absl::Span<float> local_f32() override { return absl::MakeSpan(full_); }

  absl::Status StartReduce(bool last_micro_batch) override {
    // Padding must stay zero whatever backward did, so it never enters a sum.
    std::fill(full_.begin() + o_.numel, full_.end(), 0.0f);
    // Otherwise DDP's no_sync: gradients accumulate here.
    if (!ReducesNow(last_micro_batch)) return absl::OkStatus();
    const int64_t padded = o_.layout.padded_numel, shard = o_.layout.shard_numel;
    if (bf16_) {
      send_bf16_.resize(padded);
      for (int64_t i = 0; i < padded; ++i) send_bf16_[i] = BF16::FromFloat(full_[i]);
    }
    Communicator* group = o_.group;
    absl::StatusOr<std::unique_ptr<Work>> work;
    if (sharded()) {
      // SEMANTICS.md §7: every micro-batch's full gradient is reduce-scattered with SUM.
      if (bf16_) {
        recv_bf16_.resize(shard);
        work = group->ReduceScatterAsync(send_bf16_.data(), recv_bf16_.data(), shard, DType::kBF16,
                                         ReduceOp::kSum);
      } else {
        recv_f32_.resize(shard);
        work = group->ReduceScatterAsync(full_.data(), recv_f32_.data(), shard, DType::kF32,
                                         ReduceOp::kSum);
      }
    } else {
      // SEMANTICS.md §7: replicated mode all-reduces SUM once per step.
      if (bf16_) {
        work = group->AllReduceAsync(send_bf16_.data(), send_bf16_.data(), padded, DType::kBF16,
                                     ReduceOp::kSum);
      } else {
        work =
            group->AllReduceAsync(full_.data(), full_.data(), padded, DType::kF32, ReduceOp::kSum);
      }
    }
    if (!work.ok()) return Annotate(work.status(), What());
    work_ = std::move(*work);
    work_is_allreduce_ = !sharded();
    work_is_replica_ = false;
    work_last_ = last_micro_batch;
    return absl::OkStatus();
  }

 private:
  // HSDP's second stage (SEMANTICS.md §7): the step's accumulated fp32 shard, SUM over the
  // replicas, in place.
  absl::Status StartReplica() override {
    absl::StatusOr<std::unique_ptr<Work>> work = o_.replica_group->AllReduceAsync(
        accum_.data(), accum_.data(), o_.layout.shard_numel, DType::kF32, ReduceOp::kSum);
    if (!work.ok()) return Annotate(work.status(), absl::StrCat(What(), " across replicas"));
    work_ = std::move(*work);
    work_is_replica_ = true;
    return absl::OkStatus();
  }
  absl::Status FinishReplica() override {
    return AwaitReplica(absl::StrCat(What(), " across replicas"));
  }

  // Waits for the in-group collective and folds its result.
  absl::Status FinishGroup() override {
    bool in_flight;
    const absl::Status s = AwaitWork(*o_.group, work_, &in_flight);
    if (!s.ok()) return Annotate(s, What());
    const int64_t padded = o_.layout.padded_numel, shard = o_.layout.shard_numel;
    if (work_is_allreduce_) {
      if (bf16_) {
        for (int64_t i = 0; i < padded; ++i) full_[i] = send_bf16_[i].ToFloat();
      }
      return absl::OkStatus();
    }
    // Sharded: fold this micro-batch's summed shard into the fp32 accumulator.
    if (bf16_) {
      float* acc = accum_.data();
      const BF16* in = recv_bf16_.data();
      if (accum_empty_) {
        for (int64_t i = 0; i < shard; ++i) acc[i] = in[i].ToFloat();
      } else {
        for (int64_t i = 0; i < shard; ++i) acc[i] += in[i].ToFloat();
      }
      accum_empty_ = false;
      std::fill(full_.begin(), full_.end(), 0.0f);
    } else {
      AccumulateShard(recv_f32_.data());
    }
    return absl::OkStatus();
  }

 public:
  absl::Status FoldReduced(absl::Span<const float> reduced, bool last_micro_batch) override {
    const int64_t size = static_cast<int64_t>(reduced.size());
    if (!sharded()) {
      if (!last_micro_batch) {
        return absl::InvalidArgumentError(absl::StrCat(
            "group \"", o_.name,
            "\": replicated mode folds the step's all-reduced gradient once, on the last "
            "micro-batch (last_micro_batch=false)"));
      }
      if (size != o_.layout.padded_numel) {
        return absl::InvalidArgumentError(
            absl::StrCat("group \"", o_.name, "\": reduced gradient has ", size,
                         " elements, expected padded_numel ", o_.layout.padded_numel));
      }
      std::copy(reduced.begin(), reduced.begin() + o_.numel, full_.begin());
      std::fill(full_.begin() + o_.numel, full_.end(), 0.0f);  // padding never leaks
      return absl::OkStatus();
    }
    if (size != o_.layout.shard_numel) {
      return absl::InvalidArgumentError(absl::StrCat("group \"", o_.name, "\": reduced shard has ",
                                                     size, " elements, expected shard_numel ",
                                                     o_.layout.shard_numel));
    }
    AccumulateShard(reduced.data());
    std::fill(accum_.begin() + o_.layout.local_numel, accum_.end(), 0.0f);  // padding
    return absl::OkStatus();
  }

  absl::Status ToWire(int64_t offset, int64_t numel, void* wire) override {
    const float* src = full_.data() + offset;
    if (bf16_) {
      BF16* dst = static_cast<BF16*>(wire);
      for (int64_t i = 0; i < numel; ++i) dst[i] = BF16::FromFloat(src[i]);
    } else {
      std::copy(src, src + numel, static_cast<float*>(wire));
    }
    return absl::OkStatus();
  }

  absl::Status FromWire(int64_t offset, int64_t numel, const void* wire,
                        int64_t /*global_rejected*/) override {
    float* dst = master_grad().data() + offset;
    if (bf16_) {
      const BF16* in = static_cast<const BF16*>(wire);
      for (int64_t j = 0; j < numel; ++j) dst[j] = in[j].ToFloat();
    } else {
      const float* in = static_cast<const float*>(wire);
      std::copy(in, in + numel, dst);
    }
    return absl::OkStatus();
  }

 private:
  // Adds one micro-batch's reduced shard (shard_numel fp32) into the accumulator and
  // clears the local gradient for the next micro-batch.
  void AccumulateShard(const float* in) {
    float* acc = accum_.data();
    const int64_t shard = o_.layout.shard_numel;
    if (accum_empty_) {
      std::copy(in, in + shard, acc);
    } else {
      for (int64_t i = 0; i < shard; ++i) acc[i] += in[i];
    }
    accum_empty_ = false;
    std::fill(full_.begin(), full_.end(), 0.0f);
  }

  const bool bf16_;  // kBF16Wire: the collectives carry bf16
  std::vector<float> recv_f32_;
  std::vector<BF16> send_bf16_;  // also the replicated all-reduce's in-place buffer
  std::vector<BF16> recv_bf16_;
};

// ---- Exact: int64 limbs. ----

class ExactUnitGrad;

// Adds contributions exactly into a range of an ExactUnitGrad's limbs, taken on the rank's
// thread when the target is made; Add only adds into them (exact::AddFloats), so pool
// threads may call it on disjoint ranges. The rejected count goes to the unit when the sink
// goes away (before the unit's reduction starts).
class LimbRangeSink final : public ExactGradSink {
 public:
  LimbRangeSink(UnitGrad* unit, std::string unit_name, absl::Span<int64_t> limbs)
      : unit_(unit), unit_name_(std::move(unit_name)), limbs_(limbs) {}
  ~LimbRangeSink() override { unit_->CountRejected(rejected_.load()); }

  absl::Status Add(int64_t offset, absl::Span<const float> c) override {
    const int64_t numel = static_cast<int64_t>(limbs_.size()) / exact::kLimbs;
    const int64_t n = static_cast<int64_t>(c.size());
    if (offset < 0 || offset > numel || n > numel - offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("exact gradient of unit ", unit_name_, ": a contribution of ", n,
                       " values at offset ", offset, " runs past its ", numel, " elements"));
    }
    int64_t rejected = 0;
    GRADSUM_RETURN_IF_ERROR(
        exact::AddFloats(c, limbs_.subspan(offset * exact::kLimbs, n * exact::kLimbs), &rejected));
    if (rejected > 0) rejected_.fetch_add(rejected);
    return absl::OkStatus();
  }

 private:
  UnitGrad* unit_;
  std::string unit_name_;
  absl::Span<int64_t> limbs_;
  std::atomic<int64_t> rejected_{0};
};

class ExactUnitGrad final : public UnitGrad {
 public:
  explicit ExactUnitGrad(UnitGradOptions options)
      : UnitGrad(GradPrecision::kExact, std::move(options)) {
    // The limbs take the fp32 local gradient's role; fp32 holds only the reduced gradient
    // (replicated: the full one; sharded: the accumulator).
    limbs_.assign(o_.layout.padded_numel * exact::kLimbs, 0);
    if (sharded()) {
      accum_limbs_.assign(o_.layout.shard_numel * exact::kLimbs, 0);
      accum_.assign(o_.layout.shard_numel, 0.0f);
    } else {
      full_.assign(o_.layout.padded_numel, 0.0f);
    }
  }
  ~ExactUnitGrad() override {
    WaitInFlight(work_);
    WaitInFlight(rejected_work_);
  }

  GradTarget Target(int64_t offset, int64_t numel) override {
    auto sink = std::make_unique<LimbRangeSink>(
        this, o_.name,
        absl::MakeSpan(limbs_.data() + offset * exact::kLimbs, numel * exact::kLimbs));
    return GradTarget::Exact(std::move(sink), numel);
  }
  absl::Span<int64_t> local_limbs() override { return absl::MakeSpan(limbs_); }
  void CountRejected(int64_t n) override { rejected_ += n; }
  int64_t rejected() const override { return rejected_; }

  absl::Status StartReduce(bool last_micro_batch) override {
    // Padding stays zero; the limbs are canonical before they are summed (every
    // micro-batch, so the per-micro-batch contribution limit holds over a whole step).
    std::fill(limbs_.begin() + o_.numel * exact::kLimbs, limbs_.end(), 0);
    GRADSUM_RETURN_IF_ERROR(exact::Normalize(absl::MakeSpan(limbs_)));
    if (!ReducesNow(last_micro_batch)) return absl::OkStatus();
    const std::string what = absl::StrCat("exact ", What());
    Communicator* group = o_.group;
    absl::StatusOr<std::unique_ptr<Work>> work;
    if (sharded()) {
      recv_limbs_.resize(o_.layout.shard_numel * exact::kLimbs);
      work = group->ReduceScatterAsync(limbs_.data(), recv_limbs_.data(),
                                       o_.layout.shard_numel * exact::kLimbs, DType::kI64,
                                       ReduceOp::kSum);
    } else {
      work = group->AllReduceAsync(limbs_.data(), limbs_.data(),
                                   o_.layout.padded_numel * exact::kLimbs, DType::kI64,
                                   ReduceOp::kSum);
    }
    if (!work.ok()) return Annotate(work.status(), what);
    work_ = std::move(*work);
    work_is_allreduce_ = !sharded();
    work_is_replica_ = false;
    work_last_ = last_micro_batch;
    if (last_micro_batch) {
      // Issued right behind the limbs, in the same order on every rank.
      work = group->AllReduceAsync(&rejected_, &rejected_total_, 1, DType::kI64, ReduceOp::kSum);
      if (!work.ok()) return Annotate(work.status(), what);
      rejected_work_ = std::move(*work);
    }
    return absl::OkStatus();
  }

 private:
  // HSDP's second stage (SEMANTICS.md §7): the step's accumulated shard limbs and the
  // group's rejected count, one int64 SUM across the replicas (R canonical buffers: within
  // the normalisation budget, checked at creation).
  absl::Status StartReplica() override {
    const int64_t words = o_.layout.shard_numel * exact::kLimbs;
    replica_limbs_.resize(words + 1);
    std::copy(accum_limbs_.begin(), accum_limbs_.end(), replica_limbs_.begin());
    replica_limbs_[words] = rejected_total_;
    absl::StatusOr<std::unique_ptr<Work>> work = o_.replica_group->AllReduceAsync(
        replica_limbs_.data(), replica_limbs_.data(), words + 1, DType::kI64, ReduceOp::kSum);
    if (!work.ok()) {
      return Annotate(work.status(), absl::StrCat("exact ", What(), " across replicas"));
    }
    work_ = std::move(*work);
    work_is_replica_ = true;
    return absl::OkStatus();
  }
  absl::Status FinishReplica() override {
    GRADSUM_RETURN_IF_ERROR(AwaitReplica(absl::StrCat("exact ", What(), " across replicas")));
    const int64_t words = o_.layout.shard_numel * exact::kLimbs;
    std::copy_n(replica_limbs_.begin(), words, accum_limbs_.begin());
    rejected_total_ = replica_limbs_[words];
    GRADSUM_RETURN_IF_ERROR(exact::Normalize(absl::MakeSpan(accum_limbs_)));
    const int64_t local = o_.layout.local_numel;
    accum_empty_ = false;
    return exact::ToFloats(absl::MakeConstSpan(accum_limbs_.data(), local * exact::kLimbs),
                           rejected_total_, absl::MakeSpan(accum_.data(), local));
  }

  // Waits for the in-group collectives and folds their result (without a replica stage,
  // the last micro-batch's shard becomes master_grad() here).
  absl::Status FinishGroup() override {
    const std::string what = absl::StrCat("exact ", What());
    bool in_flight;
    absl::Status s = AwaitWork(*o_.group, work_, &in_flight);
    if (in_flight) return Annotate(s, what);
    if (rejected_work_) {
      const absl::Status r = AwaitWork(*o_.group, rejected_work_, &in_flight);
      if (in_flight) return Annotate(r, what);
      if (s.ok()) s = r;
    }
    if (!s.ok()) return Annotate(s, what);
    const int64_t numel = o_.numel, local = o_.layout.local_numel;
    if (work_is_allreduce_) {
      // Replicated: the step's summed limbs, converted once into master_grad().
      return exact::ToFloats(absl::MakeConstSpan(limbs_.data(), numel * exact::kLimbs),
                             rejected_total_, absl::MakeSpan(full_.data(), numel));
    }
    // Sharded: add this micro-batch's summed shard into the limb accumulator (canonical +
    // a sum of group_size canonical buffers: within the normalisation budget).
    GRADSUM_RETURN_IF_ERROR(exact::AddLimbs(recv_limbs_, absl::MakeSpan(accum_limbs_)));
    GRADSUM_RETURN_IF_ERROR(exact::Normalize(absl::MakeSpan(accum_limbs_)));
    std::fill(limbs_.begin(), limbs_.end(), 0);
    if (!work_last_ || across_replicas()) return absl::OkStatus();
    accum_empty_ = false;
    return exact::ToFloats(absl::MakeConstSpan(accum_limbs_.data(), local * exact::kLimbs),
                           rejected_total_, absl::MakeSpan(accum_.data(), local));
  }

 public:
  absl::Status FoldReduced(absl::Span<const float>, bool) override {
    return absl::UnimplementedError(absl::StrCat(
        "group \"", o_.name,
        "\": exact gradients are reduced as int64 limbs by FlatParam or "
        "BucketedGradReducer; an fp32 gradient reduced elsewhere (the GPU path) cannot be "
        "folded in"));
  }

  void Zero() override {
    UnitGrad::Zero();
    std::fill(limbs_.begin(), limbs_.end(), 0);
    std::fill(accum_limbs_.begin(), accum_limbs_.end(), 0);
    rejected_ = 0;
    rejected_total_ = 0;
  }

  absl::Status ToWire(int64_t offset, int64_t numel, void* wire) override {
    absl::Span<int64_t> dst(static_cast<int64_t*>(wire), numel * exact::kLimbs);
    std::copy_n(limbs_.data() + offset * exact::kLimbs, dst.size(), dst.data());
    return exact::Normalize(dst);  // canonical before the SUM
  }

  absl::Status FromWire(int64_t offset, int64_t numel, const void* wire,
                        int64_t global_rejected) override {
    return exact::ToFloats(
        absl::MakeConstSpan(static_cast<const int64_t*>(wire), numel * exact::kLimbs),
        global_rejected, master_grad().subspan(offset, numel));
  }

 private:
  // Local limbs (padded_numel * kLimbs); sharded: the limb accumulator and the
  // reduce-scatter's output (shard_numel * kLimbs each).
  std::vector<int64_t> limbs_;
  std::vector<int64_t> accum_limbs_;
  std::vector<int64_t> recv_limbs_;
  // The local rejected count, and the step's global one (an all-reduce on the last
  // micro-batch, in flight beside work_).
  int64_t rejected_ = 0;
  int64_t rejected_total_ = 0;
  std::unique_ptr<Work> rejected_work_;
  // HSDP: the accumulated shard limbs and the rejected count on their way across replicas.
  std::vector<int64_t> replica_limbs_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<UnitGrad>> UnitGrad::Create(GradPrecision precision,
                                                           UnitGradOptions options) {
  if (options.group == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient of group \"", options.name, "\": null communicator"));
  }
  switch (precision) {
    case GradPrecision::kF32:
    case GradPrecision::kBF16Wire:
      return std::unique_ptr<UnitGrad>(new FloatUnitGrad(precision, std::move(options)));
    case GradPrecision::kExact:
      if (options.replica_group != nullptr &&
          options.replica_group->size() >= exact::kMaxAddsBetweenNormalize) {
        return absl::InvalidArgumentError(
            absl::StrCat("flat param group \"", options.name, "\": exact gradients sum at most ",
                         exact::kMaxAddsBetweenNormalize - 1, " replicas, the replica group has ",
                         options.replica_group->size()));
      }
      if (options.group->size() >= exact::kMaxAddsBetweenNormalize) {
        return absl::InvalidArgumentError(absl::StrCat(
            "flat param group \"", options.name, "\": exact gradients sum at most ",
            exact::kMaxAddsBetweenNormalize - 1, " ranks, the group has ", options.group->size()));
      }
      return std::unique_ptr<UnitGrad>(new ExactUnitGrad(std::move(options)));
  }
  return absl::InvalidArgumentError(absl::StrCat("flat param group \"", options.name,
                                                 "\": bad gradient precision ",
                                                 static_cast<int>(precision)));
}

}  // namespace gradsum
