#include "optim/grad_norm.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/exact_sum.h"
#include "core/grad_precision.h"
#include "core/status.h"

namespace gradsum {
namespace {

// fp64: each group's owned squares summed in fp64, then one f64 SUM all-reduce.
absl::StatusOr<double> F64GlobalNorm(absl::Span<FlatParam* const> groups, Communicator& world) {
  double local_sq = 0.0;
  for (const FlatParam* g : groups) local_sq += g->OwnedGradSquaredNorm();
  double global_sq = 0.0;
  GRADSUM_RETURN_IF_ERROR(world.AllReduce(&local_sq, &global_sq, 1, DType::kF64, ReduceOp::kSum));
  return std::sqrt(global_sq);
}

// Exact (SEMANTICS.md §11): the exact sum of the squares, reduced as int64 words, is the
// same bits however the elements are split over ranks.
absl::StatusOr<double> ExactGlobalNorm(absl::Span<FlatParam* const> groups, Communicator& world) {
  exact::ExactScalar local_sq;
  for (const FlatParam* g : groups) g->AddOwnedGradSquares(local_sq);
  local_sq.Normalize();
  exact::ExactScalar global_sq;
  GRADSUM_RETURN_IF_ERROR(world.AllReduce(local_sq.words().data(), global_sq.words().data(),
                                          exact::ExactScalar::kWords, DType::kI64, ReduceOp::kSum));
  return std::sqrt(global_sq.ToDouble());
}

}  // namespace

absl::StatusOr<double> GlobalGradNorm(absl::Span<FlatParam* const> groups, Communicator& world) {
  for (const FlatParam* g : groups) {
    if (g == nullptr) return absl::InvalidArgumentError("GlobalGradNorm: null group");
    if (g->grad_reduce_in_flight()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "GlobalGradNorm: gradient reduction of group \"", g->name(), "\" is still in flight"));
    }
    if (IsExact(g->precision()) != IsExact(groups[0]->precision())) {
      return absl::InvalidArgumentError(
          absl::StrCat("GlobalGradNorm: group \"", g->name(), "\" has precision ",
                       GradPrecisionName(g->precision()), " but \"", groups[0]->name(), "\" has ",
                       GradPrecisionName(groups[0]->precision())));
    }
  }
  // The groups' precision decides how the squares are summed (core/grad_precision.h).
  const bool exact = !groups.empty() && IsExact(groups[0]->precision());
  return exact ? ExactGlobalNorm(groups, world) : F64GlobalNorm(groups, world);
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
