#include "moe/placement.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace gradsum::moe {

absl::StatusOr<ExpertPlacement> ExpertPlacement::Create(int num_experts, int ep_size) {
  if (num_experts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("number of experts E must be >= 1, got E=", num_experts));
  }
  if (ep_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("EP group size P must be >= 1, got P=", ep_size));
  }
  // SEMANTICS.md §7: experts are split evenly; an uneven split is an error, not a pad.
  if (num_experts % ep_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "number of experts E=", num_experts, " is not divisible by the EP group size P=", ep_size));
  }
  return ExpertPlacement(num_experts, ep_size);
}

absl::StatusOr<int> ExpertPlacement::CheckedOwnerEpRank(int expert) const {
  if (expert < 0 || expert >= num_experts_) {
    return absl::OutOfRangeError(
        absl::StrCat("expert index ", expert, " is outside [0, E=", num_experts_, ")"));
  }
  return OwnerEpRank(expert);
}

}  // namespace gradsum::moe
