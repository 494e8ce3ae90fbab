#include "sharding/grad_norm.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum {

absl::StatusOr<double> GlobalGradNorm(absl::Span<FlatParam* const> groups, Communicator& world) {
  double local_sq = 0.0;
  exact::ExactScalar exact_sq;
  for (const FlatParam* g : groups) {
    if (g == nullptr) return absl::InvalidArgumentError("GlobalGradNorm: null group");
    if (g->grad_reduce_in_flight()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "GlobalGradNorm: gradient reduction of group \"", g->name(), "\" is still in flight"));
    }
    if (g->options().exact_grads != groups[0]->options().exact_grads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "GlobalGradNorm: group \"", g->name(), "\" has exact_grads=", g->options().exact_grads,
          " but \"", groups[0]->name(), "\" has ", groups[0]->options().exact_grads));
    }
    if (g->options().exact_grads) {
      g->AddOwnedGradSquares(exact_sq);
    } else {
      local_sq += g->OwnedGradSquaredNorm();
    }
  }
  if (!groups.empty() && groups[0]->options().exact_grads) {
    // SEMANTICS.md §11: the exact sum of the squares, reduced as int64 words, is the
    // same bits however the elements are split over ranks.
    exact_sq.Normalize();
    exact::ExactScalar global;
    GRADSUM_RETURN_IF_ERROR(world.AllReduce(exact_sq.words().data(), global.words().data(),
                                            exact::ExactScalar::kWords, DType::kI64,
                                            ReduceOp::kSum));
    return std::sqrt(global.ToDouble());
  }
  double global_sq = 0.0;
  GRADSUM_RETURN_IF_ERROR(world.AllReduce(&local_sq, &global_sq, 1, DType::kF64, ReduceOp::kSum));
  return std::sqrt(global_sq);
}

absl::StatusOr<double> ClipGradNorm(absl::Span<FlatParam* const> groups, Communicator& world,
                                    double max_norm) {
  if (!(max_norm > 0.0)) {
    return absl::InvalidArgumentError(absl::StrCat("max_norm must be > 0, got ", max_norm));
  }
  GRADSUM_ASSIGN_OR_RETURN(const double norm, GlobalGradNorm(groups, world));
  if (!std::isfinite(norm) || norm <= max_norm) return norm;
  const float scale = static_cast<float>(max_norm / (norm + 1e-6));
  for (FlatParam* g : groups) {
    for (float& x : g->master_grad()) x *= scale;
  }
  return norm;
}

}  // namespace gradsum
