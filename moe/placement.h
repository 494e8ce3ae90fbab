#ifndef GRADSUM_MOE_PLACEMENT_H_
#define GRADSUM_MOE_PLACEMENT_H_

// ExpertPlacement: which EP rank owns which expert, and which group sums an expert's
// gradient (SEMANTICS.md §1, §7).
//
// `E` experts are split evenly over the `P` ranks of an EP group: expert `e` lives on EP
// slot `p = e / (E / P)`, and EP rank `p` holds the contiguous experts
// `[p * E/P, (p + 1) * E/P)`. Its gradient is summed over that slot's EDP group (the `F`
// ranks of the world with the same `p`), never over the world.
//
//   GRADSUM_ASSIGN_OR_RETURN(ExpertPlacement placement, ExpertPlacement::Create(8, 4));
//   placement.OwnerEpRank(5);           // 2
//   placement.FirstLocalExpert(2);      // 4, and experts_per_rank() == 2
//   ReduceGroupOfExpertParams();        // ParamReduceGroup::kEdp

#include "absl/status/statusor.h"

namespace gradsum::moe {

// The group over which a parameter's gradient is SUM-reduced (SEMANTICS.md §7).
enum class ParamReduceGroup {
  kWorld = 0,  // dense parameters: embedding, norms, routers, LM head
  kEdp = 1,    // expert parameters: the F ranks holding the same experts
};

// Routers are dense (every rank holds all of Wr): world group.
constexpr ParamReduceGroup ReduceGroupOfRouterParams() { return ParamReduceGroup::kWorld; }
// Expert weights (Wg, Wu, Wd of a local expert): the owning slot's EDP group.
constexpr ParamReduceGroup ReduceGroupOfExpertParams() { return ParamReduceGroup::kEdp; }

class ExpertPlacement {
 public:
  // InvalidArgument unless num_experts >= 1, ep_size >= 1 and num_experts % ep_size == 0
  // (the message names E and P).
  static absl::StatusOr<ExpertPlacement> Create(int num_experts, int ep_size);

  int num_experts() const { return num_experts_; }
  int ep_size() const { return ep_size_; }
  int experts_per_rank() const { return num_experts_ / ep_size_; }

  // The EP slot p = e / (E / P) that holds expert `expert`. Precondition: 0 <= expert < E.
  int OwnerEpRank(int expert) const { return expert / experts_per_rank(); }
  // First global expert index held by EP rank `ep_rank`. Precondition: 0 <= ep_rank < P.
  int FirstLocalExpert(int ep_rank) const { return ep_rank * experts_per_rank(); }

  // Checked form of OwnerEpRank: OutOfRange naming the expert when it is not in [0, E).
  absl::StatusOr<int> CheckedOwnerEpRank(int expert) const;

 private:
  ExpertPlacement(int num_experts, int ep_size) : num_experts_(num_experts), ep_size_(ep_size) {}
  int num_experts_;
  int ep_size_;
};

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_PLACEMENT_H_
