#include "sharding/bucketed_reduce.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/exact_sum.h"
#include "core/half.h"
#include "core/status.h"

namespace gradsum {

absl::StatusOr<std::unique_ptr<BucketedGradReducer>> BucketedGradReducer::Create(
    std::vector<FlatParam*> groups, size_t bucket_cap_bytes, size_t first_bucket_cap_bytes) {
  if (groups.empty()) return absl::InvalidArgumentError("BucketedGradReducer: no groups");
  for (const FlatParam* g : groups) {
    if (g == nullptr) return absl::InvalidArgumentError("BucketedGradReducer: null group");
    if (g->options().mode != ShardingMode::kReplicated) {
      return absl::InvalidArgumentError(
          absl::StrCat("BucketedGradReducer: group \"", g->name(), "\" is not replicated"));
    }
    if (g->options().exact_grads != groups[0]->options().exact_grads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "BucketedGradReducer: group \"", g->name(), "\" has exact_grads=",
          g->options().exact_grads, " but \"", groups[0]->name(), "\" has ",
          groups[0]->options().exact_grads));
    }
    if (g->group() != groups[0]->group()) {
      return absl::InvalidArgumentError(absl::StrCat("BucketedGradReducer: group \"", g->name(),
                                                     "\" uses another communicator than \"",
                                                     groups[0]->name(), "\""));
    }
  }
  if (bucket_cap_bytes == 0) {
    return absl::InvalidArgumentError("BucketedGradReducer: bucket_cap_bytes must be >= 1");
  }
  GradBucketerOptions options;
  options.mode = GradBucketerOptions::Mode::kAllReduce;
  options.bucket_cap_bytes = bucket_cap_bytes;
  options.first_bucket_cap_bytes = first_bucket_cap_bytes;
  std::unique_ptr<BucketedGradReducer> r(new BucketedGradReducer(groups[0]->group(), options));
  r->exact_ = groups[0]->options().exact_grads;
  for (const FlatParam* g : groups) {
    std::vector<int> ids;
    for (const FlatParamEntry& e : g->entries()) {
      // Exact mode: each element's int64 limbs (SEMANTICS.md §11).
      GRADSUM_ASSIGN_OR_RETURN(
          int id, r->exact_ ? r->bucketer_.Register(absl::StrCat(g->name(), "/", e.name),
                                                    DType::kI64, e.numel * exact::kLimbs)
                            : r->bucketer_.Register(absl::StrCat(g->name(), "/", e.name),
                                                    g->options().reduce_dtype, e.numel));
      ids.push_back(id);
    }
    if (r->exact_) {
      // The group's rejected-contribution count travels in the same buckets, last.
      GRADSUM_ASSIGN_OR_RETURN(
          int id, r->bucketer_.Register(absl::StrCat(g->name(), "/#rejected"), DType::kI64, 1));
      ids.push_back(id);
    }
    r->param_ids_.push_back(std::move(ids));
  }
  GRADSUM_RETURN_IF_ERROR(r->bucketer_.Finalize());
  r->handed_.assign(groups.size(), false);
  r->groups_ = std::move(groups);
  return r;
}

absl::Status BucketedGradReducer::GroupReady(int index) {
  if (index < 0 || index >= static_cast<int>(groups_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("BucketedGradReducer: group index ", index,
                                                   " out of range [0, ", groups_.size(), ")"));
  }
  FlatParam& g = *groups_[index];
  // Checked before touching the bucket storage: an all-reduce may be reading it now.
  if (handed_[index]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BucketedGradReducer: group \"", g.name(), "\" was already handed over this step"));
  }
  handed_[index] = true;
  if (exact_) return ExactGroupReady(index);
  absl::Span<const float> full = g.full_grad();
  // Backward produces the last parameters first: mark them in that order.
  for (int k = g.num_params() - 1; k >= 0; --k) {
    const FlatParamEntry& e = g.entries()[k];
    const int id = param_ids_[index][k];
    TensorView view = bucketer_.grad(id);
    const float* src = full.data() + e.offset;
    if (view.dtype() == DType::kBF16) {
      BF16* dst = view.data<BF16>();
      for (int64_t i = 0; i < e.numel; ++i) dst[i] = BF16::FromFloat(src[i]);
    } else {
      std::copy(src, src + e.numel, view.data<float>());
    }
    GRADSUM_RETURN_IF_ERROR(bucketer_.MarkReady(id));
  }
  return absl::OkStatus();
}

absl::Status BucketedGradReducer::ExactGroupReady(int index) {
  FlatParam& g = *groups_[index];
  const std::vector<int>& ids = param_ids_[index];
  TensorView rejected = bucketer_.grad(ids.back());
  *rejected.data<int64_t>() = g.exact_rejected();
  GRADSUM_RETURN_IF_ERROR(bucketer_.MarkReady(ids.back()));
  absl::Span<const int64_t> full = g.exact_full_grad();
  for (int k = g.num_params() - 1; k >= 0; --k) {
    const FlatParamEntry& e = g.entries()[k];
    TensorView view = bucketer_.grad(ids[k]);
    absl::Span<int64_t> dst(view.data<int64_t>(), e.numel * exact::kLimbs);
    std::copy_n(full.data() + e.offset * exact::kLimbs, dst.size(), dst.data());
    GRADSUM_RETURN_IF_ERROR(exact::Normalize(dst));  // canonical before the SUM
    GRADSUM_RETURN_IF_ERROR(bucketer_.MarkReady(ids[k]));
  }
  return absl::OkStatus();
}

absl::Status BucketedGradReducer::Finish() {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!handed_[gi]) {
      return absl::FailedPreconditionError(absl::StrCat("BucketedGradReducer: group \"",
                                                        groups_[gi]->name(),
                                                        "\" was not handed over this step"));
    }
  }
  GRADSUM_RETURN_IF_ERROR(bucketer_.Finish());
  std::fill(handed_.begin(), handed_.end(), false);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    FlatParam& g = *groups_[gi];
    absl::Span<float> out = g.master_grad();  // replicated: the full gradient, numel elements
    if (exact_) {
      const int64_t rejected = *bucketer_.grad(param_ids_[gi].back()).data<int64_t>();
      for (int k = 0; k < g.num_params(); ++k) {
        const FlatParamEntry& e = g.entries()[k];
        TensorView view = bucketer_.grad(param_ids_[gi][k]);
        GRADSUM_RETURN_IF_ERROR(exact::ToFloats(
            absl::MakeConstSpan(view.data<int64_t>(), e.numel * exact::kLimbs), rejected,
            out.subspan(e.offset, e.numel)));
      }
      continue;
    }
    for (int k = 0; k < g.num_params(); ++k) {
      const FlatParamEntry& e = g.entries()[k];
      TensorView view = bucketer_.grad(param_ids_[gi][k]);
      float* dst = out.data() + e.offset;
      if (view.dtype() == DType::kBF16) {
        const BF16* src = view.data<BF16>();
        for (int64_t i = 0; i < e.numel; ++i) dst[i] = src[i].ToFloat();
      } else {
        std::copy(view.data<float>(), view.data<float>() + e.numel, dst);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace gradsum
