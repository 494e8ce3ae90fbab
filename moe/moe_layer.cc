#include "moe/moe_layer.h"

#include <vector>

#include "core/status.h"

namespace gradsum::moe {

absl::Status MoeLayerForward(Communicator& ep_group, const MoeLayerConfig& config,
                             const MoeLayerWeights& weights, absl::Span<const float> a,
                             absl::Span<const uint8_t> mask, absl::Span<float> y,
                             MoeLayerState* state) {
  if (state == nullptr) return absl::InvalidArgumentError("MoE layer state must not be null");
  GRADSUM_RETURN_IF_ERROR(ValidateDispatchConfig(config.dispatch(), ep_group.size()));
  GRADSUM_ASSIGN_OR_RETURN(state->route, RouterForward(config.router(), a, weights.router, mask));
  return DispatchCombineForward(ep_group, config.dispatch(), weights.local_experts, a,
                                state->route.expert_index, state->route.combine_weight, y,
                                &state->dispatch);
}

absl::Status MoeLayerBackward(Communicator& ep_group, const MoeLayerConfig& config,
                              const MoeLayerWeights& weights, absl::Span<const float> a,
                              const MoeLayerState& state, absl::Span<const float> dy,
                              const RouterLossGrads& loss_grads, absl::Span<float> d_a,
                              const MoeLayerGrads& grads) {
  std::vector<float> d_combine_weight(state.route.combine_weight.size());
  GRADSUM_RETURN_IF_ERROR(
      DispatchCombineBackward(ep_group, config.dispatch(), weights.local_experts, state.dispatch,
                              dy, d_a, absl::MakeSpan(d_combine_weight), grads.local_experts));
  RouterOutputGrads router_grads;
  router_grads.d_combine_weight = d_combine_weight;
  router_grads.d_probs = loss_grads.d_probs;
  router_grads.d_gating_sums = loss_grads.d_gating_sums;
  router_grads.d_logits = loss_grads.d_logits;
  return RouterBackward(config.router(), a, weights.router, state.route, router_grads, grads.router,
                        d_a);
}

}  // namespace gradsum::moe
