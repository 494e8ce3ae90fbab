#include "parallel/host_unit_store.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/exact_sum.h"
#include "core/half.h"
#include "core/status.h"
#include "sharding/bucketed_reduce.h"

namespace gradsum::parallel {
namespace {

// Exact gradients: entries [first, first + count) of a unit, back to back, as one exact
// gradient (a single parameter, or moe/experts.h's "all Wg, then all Wu, then all Wd" run of
// one layer's experts). The entries' limb spans are taken on the rank's thread at
// creation; Add only adds into them (exact::AddFloats), so kernels may call it from pool
// threads on disjoint ranges. The rejected-contribution count goes to the unit when the
// sink goes away (before the unit's reduction starts).
class EntriesGradSink : public ExactGradSink {
 public:
  static absl::StatusOr<std::unique_ptr<EntriesGradSink>> Create(FlatParam* unit, int first,
                                                                 int count) {
    auto sink = std::unique_ptr<EntriesGradSink>(new EntriesGradSink(unit));
    for (int i = first; i < first + count; ++i) {
      GRADSUM_ASSIGN_OR_RETURN(absl::Span<int64_t> limbs, unit->exact_grad(i));
      sink->limbs_.push_back(limbs);
    }
    return sink;
  }
  ~EntriesGradSink() override { unit_->CountRejectedExactGrad(rejected_.load()); }

  absl::Status Add(int64_t offset, absl::Span<const float> c) override {
    const int64_t size = static_cast<int64_t>(c.size());
    for (absl::Span<int64_t> limbs : limbs_) {
      if (c.empty()) break;
      const int64_t numel = static_cast<int64_t>(limbs.size()) / exact::kLimbs;
      if (offset >= numel) {
        offset -= numel;
        continue;
      }
      const int64_t n = std::min<int64_t>(numel - offset, static_cast<int64_t>(c.size()));
      int64_t rejected = 0;
      GRADSUM_RETURN_IF_ERROR(exact::AddFloats(
          c.first(n), limbs.subspan(offset * exact::kLimbs, n * exact::kLimbs), &rejected));
      if (rejected > 0) rejected_.fetch_add(rejected);
      c.remove_prefix(n);
      offset = 0;
    }
    if (!c.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("exact gradient of unit ", unit_->name(),
                                                     ": a contribution of ", size,
                                                     " values runs past its entries"));
    }
    return absl::OkStatus();
  }

 private:
  explicit EntriesGradSink(FlatParam* unit) : unit_(unit) {}
  FlatParam* unit_;
  std::vector<absl::Span<int64_t>> limbs_;
  std::atomic<int64_t> rejected_{0};
};

class HostUnitStore : public UnitStore {
 public:
  HostUnitStore(std::vector<FlatParam*> units, const ParallelOptions& options)
      : units_(std::move(units)),
        bf16_(options.compute_dtype == DType::kBF16),
        widened_(units_.size()),
        widened_version_(units_.size(), 0),
        widened_valid_(units_.size(), false) {}

  absl::Status Init(const ParallelOptions& options) {
    if (options.sharding == ShardingMode::kReplicated) {
      GRADSUM_ASSIGN_OR_RETURN(BucketedUnitReducers r,
                               BucketedUnitReducers::Create(units_, options.bucket_cap_bytes,
                                                            options.first_bucket_cap_bytes));
      reducers_ = std::make_unique<BucketedUnitReducers>(std::move(r));
    }
    return absl::OkStatus();
  }

  const float* Values(int u, int index) override {
    FlatParam* g = units_[u];
    if (bf16_) return widened_[u].data() + g->entries()[index].offset;
    return g->param(index)->data<float>();
  }

  absl::StatusOr<GradTarget> Grad(int u, int first, int count) override {
    FlatParam* g = units_[u];
    int64_t numel = 0;
    for (int i = first; i < first + count; ++i) numel += g->entries()[i].numel;
    if (g->options().exact_grads) {
      GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<EntriesGradSink> sink,
                               EntriesGradSink::Create(g, first, count));
      return GradTarget::Exact(std::move(sink), numel);
    }
    GRADSUM_ASSIGN_OR_RETURN(TensorView view, g->grad(first));
    return GradTarget::Accumulate(view.data<float>(), numel);
  }

  absl::Status StartGather(int u) override { return units_[u]->StartUnshard(); }

  absl::Status WaitGather(int u) override {
    FlatParam* g = units_[u];
    if (g->unshard_in_flight()) GRADSUM_RETURN_IF_ERROR(g->WaitUnshard());
    if (!g->is_unsharded()) {
      return absl::FailedPreconditionError(
          absl::StrCat("unit ", g->name(), " was not gathered before it was read"));
    }
    if (!bf16_ || (widened_valid_[u] && widened_version_[u] == g->master_version())) {
      return absl::OkStatus();
    }
    // bf16 parameters (halved all-gather traffic); the CPU kernels read them widened to
    // fp32, which is exact.
    std::vector<float>& f32 = widened_[u];
    f32.resize(g->numel());
    for (int i = 0; i < g->num_params(); ++i) {
      GRADSUM_ASSIGN_OR_RETURN(TensorView view, g->param(i));
      const BF16* src = view.data<BF16>();
      const FlatParamEntry& e = g->entries()[i];
      for (int64_t k = 0; k < e.numel; ++k) f32[e.offset + k] = src[k].ToFloat();
    }
    widened_valid_[u] = true;
    widened_version_[u] = g->master_version();
    return absl::OkStatus();
  }

  absl::Status Release(int u) override {
    if (bf16_) {
      std::vector<float>().swap(widened_[u]);
      widened_valid_[u] = false;
    }
    return units_[u]->Reshard();
  }

  absl::Status StartReduce(int u, bool last_micro_batch) override {
    if (reducers_ == nullptr) return units_[u]->StartGradReduce(last_micro_batch);
    // Replicated: accumulate (no_sync); FlatParam only tidies its buffer (zero padding;
    // exact mode: canonical limbs each micro-batch).
    if (!last_micro_batch) return units_[u]->StartGradReduce(false);
    return reducers_->Ready(u);
  }

  absl::Status WaitReduce(int u) override {
    return reducers_ == nullptr ? units_[u]->FinishGradReduce() : absl::OkStatus();
  }

  absl::Status FinishReductions() override {
    for (FlatParam* g : units_) GRADSUM_RETURN_IF_ERROR(g->FinishGradReduce());
    return reducers_ != nullptr ? reducers_->Finish() : absl::OkStatus();
  }

  int64_t UnshardedBytes() const override {
    int64_t n = 0;
    for (const FlatParam* g : units_) n += g->unsharded_bytes();
    return n;
  }
  int64_t FullBytes() const override {
    int64_t n = 0;
    for (const FlatParam* g : units_) n += g->full_compute_bytes();
    return n;
  }

 private:
  std::vector<FlatParam*> units_;
  bool bf16_ = false;
  // fp32 copies of bf16 compute parameters, per unit.
  std::vector<std::vector<float>> widened_;
  std::vector<uint64_t> widened_version_;
  std::vector<bool> widened_valid_;
  std::unique_ptr<BucketedUnitReducers> reducers_;  // replicated mode
};

}  // namespace

absl::StatusOr<std::unique_ptr<UnitStore>> MakeHostUnitStore(std::vector<FlatParam*> units,
                                                             const ParallelOptions& options) {
  auto store = std::make_unique<HostUnitStore>(std::move(units), options);
  GRADSUM_RETURN_IF_ERROR(store->Init(options));
  return std::unique_ptr<UnitStore>(std::move(store));
}

}  // namespace gradsum::parallel
