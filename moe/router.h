#ifndef GRADSUM_MOE_ROUTER_H_
#define GRADSUM_MOE_ROUTER_H_

// The MoE router of SEMANTICS.md §10: fp32 logits, full softmax (or sigmoid) scores, top-K,
// optional renormalisation of the top-K weights, router_scale; forward and backward.
//
//   u_t = a_t @ Wr                         (a: [T, D], Wr: [D, E], fp32)
//   p_t = softmax(u_t)                     (all E experts, before top-K; RouterScore::kSigmoid:
//                                           p_t[e] = sigmoid(u_t[e]))
//   i_1..i_K = the K largest p_t[e] + b[e] (descending; equal: lower expert index first;
//                                           b = the expert bias of §5.1, 0 when none is given)
//   w_k = p_t[i_k]; if norm_topk_prob: w_k /= sum_k p_t[i_k]; w_k *= router_scale
//
// The bias moves the selection only: the weights w_k are of the unbiased scores, and no
// gradient reaches b (it is state updated from the counts, SEMANTICS.md §5.1).
//
// Padding tokens (mask 0) are not routed: expert index -1, combine weight 0, and their rows
// of `logits` and `probs` are zero. They contribute nothing to the routing statistics
// (SEMANTICS.md §5) and receive no gradient.
//
//   RouterConfig config{.d_model = D, .num_experts = E, .top_k = K};
//   GRADSUM_ASSIGN_OR_RETURN(RouterOutput route, RouterForward(config, a, wr, mask));
//   ... dispatch with route.expert_index / route.combine_weight, compute losses ...
//   RouterOutputGrads g{.d_combine_weight = dw, .d_gating_sums = d_bal, .d_logits = d_z};
//   GRADSUM_RETURN_IF_ERROR(RouterBackward(config, a, wr, route, g, d_wr, d_a));
//
// The top-K selection is piecewise constant, so gradients flow only through the values
// p_t[i_k] and, from the balancing and z-losses, through every p_t[e] and u_t[e]; all of
// them go through the full softmax Jacobian.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/grad_sink.h"

namespace gradsum::moe {

// How the router scores experts (SEMANTICS.md §10, §5.1).
enum class RouterScore {
  kSoftmax,  // p = softmax(u) over the E experts (the default)
  kSigmoid,  // p[e] = sigmoid(u[e]) (DeepSeek-V3); the balancing loss of §5 is undefined
};

// "softmax", "sigmoid".
const char* RouterScoreName(RouterScore score);

struct RouterConfig {
  int64_t d_model = 0;          // D, width of the router input a
  int num_experts = 0;          // E
  int top_k = 0;                // K, 1 <= K <= E
  bool norm_topk_prob = false;  // divide the top-K weights by their sum
  float router_scale = 1.0f;    // multiplies the (renormalised) top-K weights; finite
  RouterScore score = RouterScore::kSoftmax;
  // Reproducible mode (docs/REPRODUCIBILITY.md): when > 0, the token rows are taken in
  // consecutive blocks of row_block rows (the last may be shorter; moe_lm: one packed
  // sequence each) and every GEMM runs per block, single-threaded (blocks spread over the
  // thread budget), so a row's values do not depend on the other blocks or the thread
  // count. 0: one GEMM over all rows, split over the threads.
  int64_t row_block = 0;
};

// InvalidArgument naming the offending field unless D >= 1, E >= 1, 1 <= K <= E and
// router_scale is finite.
absl::Status ValidateRouterConfig(const RouterConfig& config);

// Everything one forward pass decides, and what backward and the losses need.
// All arrays are row-major, one row per token of the input.
struct RouterOutput {
  int64_t num_tokens = 0;             // T
  int num_experts = 0;                // E
  int top_k = 0;                      // K
  std::vector<float> logits;          // [T, E] u (fp32; for the z-loss, §4); 0 on padding rows
  std::vector<float> probs;           // [T, E] p = softmax(u) (for §5), or sigmoid(u); 0 on
                                      // padding rows
  std::vector<int32_t> expert_index;  // [T, K] chosen experts, descending p; -1 on padding
  std::vector<float> combine_weight;  // [T, K] w_k; 0 on padding
  std::vector<uint8_t> routed;        // [T] 1 for a routed token, 0 for padding

  // Routing statistics of this rank and micro-batch (SEMANTICS.md §5), detached:
  int64_t local_routed_tokens = 0;           // number of routed tokens
  std::vector<int64_t> local_expert_counts;  // [E] (token, slot) assignments to expert e
  std::vector<double> local_gating_sums;     // [E] sum over routed t of p_t[e]
};

// Routes T = a.size() / D tokens.
// `a`: [T, D]; `router_weight` (Wr): [D, E]; `mask`: [T] with 1 = routed, 0 = padding,
// or empty for "all tokens routed"; `expert_bias`: [E], added to the scores for the top-K
// selection only (SEMANTICS.md §5.1), or empty for none (the selection of §10, bit for bit).
// Errors: InvalidArgument for a bad config, a.size() not a multiple of D, Wr not D*E,
// a mask of the wrong length or with a value other than 0/1, a bias of another length
// than E or with a non-finite value, or a non-finite logit (the message names the token).
absl::StatusOr<RouterOutput> RouterForward(const RouterConfig& config, absl::Span<const float> a,
                                           absl::Span<const float> router_weight,
                                           absl::Span<const uint8_t> mask = {},
                                           absl::Span<const float> expert_bias = {});

// Upstream gradients of the router's outputs. An empty span means "zero". Entries on
// padding rows are ignored.
struct RouterOutputGrads {
  absl::Span<const float> d_combine_weight;  // [T, K] dL/dw_k (from the combine, see dispatch.h)
  absl::Span<const float> d_probs;           // [T, E] dL/dp_t[e]
  absl::Span<const double> d_gating_sums;    // [E] dL/d local_gating_sums[e] (balancing loss);
                                             // applied to every routed token's p_t[e]
  absl::Span<const float> d_logits;          // [T, E] dL/du_t[e] (z-loss), added after softmax
};

// Back-propagates through the combine weights, the softmax (or the sigmoid) and the logits
// GEMM:
//   d_router_weight += a^T du      ([D, E])
//   d_a             += du Wr^T     ([T, D])
// Both are accumulated (+=) so micro-batches and the expert path can add into them.
// `d_router_weight_exact` (reproducible mode): when set, d_router_weight is not used (may
// be empty) and each row block's a_b^T du_b is added exactly to the sink instead.
// `a` and `router_weight` must be those given to the RouterForward that produced `forward`.
// Errors: InvalidArgument for a bad config or any span of the wrong size (named).
absl::Status RouterBackward(const RouterConfig& config, absl::Span<const float> a,
                            absl::Span<const float> router_weight, const RouterOutput& forward,
                            const RouterOutputGrads& grads, absl::Span<float> d_router_weight,
                            absl::Span<float> d_a, ExactGradSink* d_router_weight_exact = nullptr);

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_ROUTER_H_
