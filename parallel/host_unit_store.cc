#include "parallel/host_unit_store.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/half.h"
#include "core/status.h"
#include "parallel/bucketed_reduce.h"

namespace gradsum::parallel {
namespace {

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

  // The unit's precision decides the target (fp32, or an exact sink: UnitGrad::Target).
  absl::StatusOr<GradTarget> Grad(int u, int first, int count) override {
    return units_[u]->grad_target(first, count);
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

  absl::Status AdvanceReduce(int u) override {
    return reducers_ == nullptr ? units_[u]->AdvanceGradReduce() : absl::OkStatus();
  }

  absl::Status FinishReductions() override {
    // HSDP: every unit's cross-replica stage in flight before any is waited for, in the
    // order backward issued their first stages (the last unit first).
    for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
      GRADSUM_RETURN_IF_ERROR((*it)->AdvanceGradReduce());
    }
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
