#include "moe/moe_layer.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/status.h"

namespace gradsum::moe {

namespace {

// The owner-side row blocks of this rank's experts (MoeLayerConfig::row_block): each rank
// counts the copies every one of its blocks sends to every expert, one all-gather shares
// the counts, and local expert j's rows (grouped by source rank, each source's rows in
// token order, moe/dispatch.h) split into the blocks of source 0, then source 1, ...
absl::Status ExpertRowBlocks(Communicator& ep_group, const MoeLayerConfig& config,
                             const RouterOutput& route, MoeLayerState* state) {
  const int P = ep_group.size();
  const int E = config.num_experts, K = config.top_k, El = E / P;
  const int64_t T = route.num_tokens;
  int64_t blocks = (T + config.row_block - 1) / config.row_block;
  // The same block count on every EP rank, or every rank fails with the same message.
  std::vector<int64_t> all_blocks(P);
  GRADSUM_RETURN_IF_ERROR(Annotate(ep_group.AllGather(&blocks, all_blocks.data(), 1, DType::kI64),
                                   "exchanging block counts"));
  for (int q = 0; q < P; ++q) {
    if (all_blocks[q] != all_blocks[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "reproducible MoE layer: EP rank ", q, " has ", all_blocks[q], " row blocks, rank 0 has ",
          all_blocks[0], "; every EP rank needs the same number of row blocks"));
    }
  }
  std::vector<int64_t> counts(static_cast<size_t>(E) * blocks, 0);  // [E, blocks]
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const int32_t e = route.expert_index[t * K + k];
      if (e >= 0) ++counts[e * blocks + t / config.row_block];
    }
  }
  std::vector<int64_t> all(static_cast<size_t>(P) * E * blocks);
  GRADSUM_RETURN_IF_ERROR(
      Annotate(ep_group.AllGather(counts.data(), all.data(), counts.size(), DType::kI64),
               "exchanging row block counts"));
  state->expert_row_blocks.assign(El, {});
  for (int j = 0; j < El; ++j) {
    const int e = ep_group.rank() * El + j;
    std::vector<int64_t>& b = state->expert_row_blocks[j];
    for (int q = 0; q < P; ++q) {
      const int64_t* c = &all[(static_cast<size_t>(q) * E + e) * blocks];
      b.insert(b.end(), c, c + blocks);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MoeLayerForward(Communicator& ep_group, const MoeLayerConfig& config,
                             const MoeLayerWeights& weights, absl::Span<const float> a,
                             absl::Span<const uint8_t> mask, absl::Span<float> y,
                             MoeLayerState* state) {
  if (state == nullptr) return absl::InvalidArgumentError("MoE layer state must not be null");
  GRADSUM_RETURN_IF_ERROR(ValidateDispatchConfig(config.dispatch(), ep_group.size()));
  GRADSUM_ASSIGN_OR_RETURN(
      state->route, RouterForward(config.router(), a, weights.router, mask, weights.expert_bias));
  DispatchConfig dispatch = config.dispatch();
  dispatch.scratch = state->scratch;
  if (config.row_block > 0) {
    GRADSUM_RETURN_IF_ERROR(ExpertRowBlocks(ep_group, config, state->route, state));
    dispatch.expert_row_blocks = &state->expert_row_blocks;
  }
  GRADSUM_RETURN_IF_ERROR(DispatchCombineForward(ep_group, dispatch, weights.local_experts, a,
                                                 state->route.expert_index,
                                                 state->route.combine_weight, y, &state->dispatch));
  state->dispatch_counts.assign(state->dispatch.all_counts.begin(),
                                state->dispatch.all_counts.end());
  return absl::OkStatus();
}

absl::Status MoeLayerRecomputeForward(Communicator& ep_group, const MoeLayerConfig& config,
                                      const MoeLayerWeights& weights, absl::Span<const float> a,
                                      absl::Span<float> y, MoeLayerState* state) {
  if (state == nullptr) return absl::InvalidArgumentError("MoE layer state must not be null");
  const int64_t T = config.d_model > 0 ? static_cast<int64_t>(a.size()) / config.d_model : -1;
  if (state->route.num_tokens != T || (config.row_block > 0 && state->expert_row_blocks.empty())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MoE layer recompute: the kept routing is of ", state->route.num_tokens,
        " tokens, the input has ", T, "; re-run only a layer whose forward ran on this input"));
  }
  DispatchConfig dispatch = config.dispatch();
  dispatch.scratch = state->scratch;
  if (config.row_block > 0) dispatch.expert_row_blocks = &state->expert_row_blocks;
  dispatch.all_counts = &state->dispatch_counts;
  return DispatchCombineForward(ep_group, dispatch, weights.local_experts, a,
                                state->route.expert_index, state->route.combine_weight, y,
                                &state->dispatch);
}

absl::Status MoeLayerBackward(Communicator& ep_group, const MoeLayerConfig& config,
                              const MoeLayerWeights& weights, absl::Span<const float> a,
                              const MoeLayerState& state, absl::Span<const float> dy,
                              const RouterLossGrads& loss_grads, absl::Span<float> d_a,
                              const MoeLayerGrads& grads) {
  std::vector<float> d_combine_weight(state.route.combine_weight.size());
  DispatchConfig dispatch = config.dispatch();
  dispatch.scratch = state.scratch;
  if (config.row_block > 0) dispatch.expert_row_blocks = &state.expert_row_blocks;
  GRADSUM_RETURN_IF_ERROR(
      DispatchCombineBackward(ep_group, dispatch, weights.local_experts, state.dispatch, dy, d_a,
                              absl::MakeSpan(d_combine_weight), grads.local_experts));
  RouterOutputGrads router_grads;
  router_grads.d_combine_weight = d_combine_weight;
  router_grads.d_probs = loss_grads.d_probs;
  router_grads.d_gating_sums = loss_grads.d_gating_sums;
  router_grads.d_logits = loss_grads.d_logits;
  return RouterBackward(config.router(), a, weights.router, state.route, router_grads, grads.router,
                        d_a, grads.router_exact);
}

}  // namespace gradsum::moe
