#ifndef GRADSUM_MOE_MOE_LAYER_H_
#define GRADSUM_MOE_MOE_LAYER_H_

// One MoE block of SEMANTICS.md §10 without the residual and the norm: router + dropless
// dispatch + grouped SwiGLU experts + combine, forward and backward.
//
//   y_t = sum_k w_tk Expert_{i_tk}(a_t)      (0 for padding tokens)
//
// The caller adds y to the residual stream (h = h + y) and back-propagates dy = dL/dh into
// MoeLayerBackward, together with the gradients the z-loss and balancing loss put on the
// router's logits and probabilities (taken from state.route; see moe/router.h).
//
//   MoeLayerConfig config{.d_model = D, .hidden = H, .num_experts = E, .top_k = K};
//   MoeLayerWeights w{.router = wr, .local_experts = {wg, wu, wd}};
//   MoeLayerState state;
//   GRADSUM_RETURN_IF_ERROR(MoeLayerForward(ep_group, config, w, a, mask, y, &state));
//   // losses read state.route.logits / probs / local_expert_counts / local_gating_sums
//   GRADSUM_RETURN_IF_ERROR(MoeLayerBackward(ep_group, config, w, a, state, dy,
//                                            {.d_gating_sums = d_bal, .d_logits = d_z},
//                                            d_a, grads));
//
// Gradient reduction afterwards (SEMANTICS.md §7): grads.router is summed over the world,
// grads.local_experts over this rank's EDP group (moe/placement.h).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "moe/dispatch.h"
#include "moe/experts.h"
#include "moe/router.h"

namespace gradsum::moe {

struct MoeLayerConfig {
  int64_t d_model = 0;  // D
  int64_t hidden = 0;   // H
  int num_experts = 0;  // E, E % P == 0
  int top_k = 0;        // K
  bool norm_topk_prob = false;
  float router_scale = 1.0f;
  RouterScore score = RouterScore::kSoftmax;  // softmax or sigmoid scores (§10, §5.1)
  // Reproducible mode (docs/REPRODUCIBILITY.md): when > 0, the tokens are consecutive
  // blocks of row_block rows (moe_lm: packed sequences), the same number on every EP rank.
  // The router computes per block (RouterConfig::row_block), and every expert computes
  // per (block, expert) row group, whichever rank the block came from: forward learns the
  // groups from one extra all-gather of per-(expert, block) counts over the EP group.
  int64_t row_block = 0;

  RouterConfig router() const {
    return RouterConfig{.d_model = d_model,
                        .num_experts = num_experts,
                        .top_k = top_k,
                        .norm_topk_prob = norm_topk_prob,
                        .router_scale = router_scale,
                        .score = score,
                        .row_block = row_block};
  }
  DispatchConfig dispatch() const {
    return DispatchConfig{
        .d_model = d_model, .hidden = hidden, .num_experts = num_experts, .top_k = top_k};
  }
};

struct MoeLayerWeights {
  absl::Span<const float> router;  // Wr [D, E], identical on every rank
  ExpertWeights local_experts;     // this EP rank's E / P experts, stacked
  // The layer's expert bias [E] (SEMANTICS.md §5.1: selection only; state, not a
  // parameter, identical on every rank), or empty for none.
  absl::Span<const float> expert_bias;
};

// Accumulated (+=).
struct MoeLayerGrads {
  absl::Span<float> router;         // [D, E]
  ExpertWeightGrads local_experts;  // shapes of MoeLayerWeights::local_experts
  // Reproducible mode: when set, `router` is not used and each row block's router gradient
  // is added exactly here (local_experts.exact does the same for the experts).
  ExactGradSink* router_exact = nullptr;
};

// Gradients the auxiliary losses put on the router outputs; empty spans mean zero.
struct RouterLossGrads {
  absl::Span<const float> d_probs;         // [T, E]
  absl::Span<const double> d_gating_sums;  // [E]
  absl::Span<const float> d_logits;        // [T, E]
};

struct MoeLayerState {
  RouterOutput route;  // routing decisions and statistics of this micro-batch
  DispatchState dispatch;
  // Reproducible mode: the row blocks of each local expert's rows (ExpertsConfig::row_blocks).
  std::vector<std::vector<int64_t>> expert_row_blocks;
  // The dispatch's per-expert row counts of every EP rank (DispatchState::all_counts), kept
  // for MoeLayerRecomputeForward when the dispatch state is released.
  std::vector<int64_t> dispatch_counts;
  // Scratch shared with the rank's other layers (DispatchConfig::scratch; not owned), or
  // null for the dispatch state's own.
  DispatchScratch* scratch = nullptr;
};

// a: [T, D]; mask: [T] (1 routed, 0 padding) or empty; y: [T, D] overwritten.
// Collective over `ep_group`. Errors: those of RouterForward and DispatchCombineForward.
absl::Status MoeLayerForward(Communicator& ep_group, const MoeLayerConfig& config,
                             const MoeLayerWeights& weights, absl::Span<const float> a,
                             absl::Span<const uint8_t> mask, absl::Span<float> y,
                             MoeLayerState* state);

// Activation recomputation (model/moe_lm.h Recompute::kFull): re-runs the dispatch, the
// experts and the combine of the MoeLayerForward that filled `state`, on the same `a` and
// weights, with that forward's routing decisions (state->route) and row blocks: no router
// pass and no all-gather (the dispatch's exchanged counts are kept too); the row exchange is
// re-done, the same rows in the same order, so state->dispatch and y come out bit-identical
// to the first forward's.
// Collective over `ep_group`. Errors: FailedPrecondition when `state` holds no routing of
// a.size() / D tokens; those of DispatchCombineForward.
absl::Status MoeLayerRecomputeForward(Communicator& ep_group, const MoeLayerConfig& config,
                                      const MoeLayerWeights& weights, absl::Span<const float> a,
                                      absl::Span<float> y, MoeLayerState* state);

// dy: [T, D]. d_a: [T, D] accumulated (+=) through the experts and the router.
// Collective over `ep_group`. Errors: those of DispatchCombineBackward and RouterBackward.
absl::Status MoeLayerBackward(Communicator& ep_group, const MoeLayerConfig& config,
                              const MoeLayerWeights& weights, absl::Span<const float> a,
                              const MoeLayerState& state, absl::Span<const float> dy,
                              const RouterLossGrads& loss_grads, absl::Span<float> d_a,
                              const MoeLayerGrads& grads);

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_MOE_LAYER_H_
