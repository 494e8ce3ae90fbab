#include "sharding/grad_norm.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum {

absl::StatusOr<double> GlobalGradNorm(absl::Span<FlatParam* const> groups, Communicator& world) {
  double local_sq = 0.0;
  for (const FlatParam* g : groups) {
    if (g == nullptr) return absl::InvalidArgumentError("GlobalGradNorm: null group");
    if (g->grad_reduce_in_flight()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "GlobalGradNorm: gradient reduction of group \"", g->name(), "\" is still in flight"));
    }
    local_sq += g->OwnedGradSquaredNorm();
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
