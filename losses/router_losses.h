#ifndef GRADSUM_LOSSES_ROUTER_LOSSES_H_
#define GRADSUM_LOSSES_ROUTER_LOSSES_H_

// Router auxiliary losses of one MoE layer and micro-batch: local components and their
// gradients with respect to the router logits u (fp32). Call once per MoE layer; the sum
// over layers of the returned values is the rank's local component for the micro-batch.
//
// z-loss (SEMANTICS.md §4):
//   L_z[r, m]   = alpha_z * sum over routed t of  logsumexp(u_t)^2 / N
//   dL/du_t     = alpha_z * 2 * logsumexp(u_t) * softmax(u_t) / N
// with N = routed tokens of the whole step, all ranks and micro-batches
// (StepStats::global_routed_tokens).
//
// Load-balancing loss (SEMANTICS.md §5), with c = the GLOBAL expert-count vector of this
// layer and micro-step (ExpertCountReduction), N_lm = sum_e c_e / K, p_t = softmax(u_t):
//   L_bal[r, m] = alpha_b / G * E * sum_e (c_e / (N_lm K)) * (sum over routed t of p_t[e]) / N_lm
//   dL/dp_t[e]  = g_e = alpha_b * E * c_e / (G * K * N_lm^2)      (c is detached)
//   dL/du_t[j]  = p_t[j] * (g_j - sum_e g_e p_t[e])                (through the softmax)
// N_lm == 0 contributes 0. The 1/G keeps the gradient independent of the micro-batch split.
//
// Both ADD their gradient into `grad_router_logits` (the router logits also receive the
// gating gradient from the model's backward; the caller zeroes the buffer once).
//
//   double local_aux = 0;
//   for (int l = 0; l < L; ++l) {
//     GRADSUM_ASSIGN_OR_RETURN(double z, RouterZLossForwardBackward(
//         u[l], mask, stats.global_routed_tokens, 0.001, du[l]));
//     GRADSUM_ASSIGN_OR_RETURN(absl::Span<const int64_t> c, counts[l].Wait());
//     GRADSUM_ASSIGN_OR_RETURN(double b, LoadBalancingLossForwardBackward(
//         u[l], mask, c, /*top_k=*/2, /*num_micro_batches=*/G, 0.001, du[l]));
//   }

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tensor.h"

namespace gradsum::losses {

// router_logits:        [T, E] f32 on the CPU, E >= 1.
// input_mask:           T entries, 1 = routed, 0 = padding (not in the loss, zero
//                       gradient); empty = every row is routed.
// global_routed_tokens: N >= 0, summed over ranks and micro-batches. N == 0 (nothing routed
//                       anywhere) returns 0 and adds nothing.
// alpha_z:              finite, >= 0; 0 returns 0 without reading the logits.
// grad_router_logits:   [T, E] f32, the gradient is added; must not overlap router_logits.
// Returns the local component. Errors: InvalidArgument for bad views, shapes, mask values
// other than 0/1, negative N or alpha, non-finite logits in a routed row (naming the row);
// FailedPrecondition if this call alone has more routed rows than N (N must be global).
absl::StatusOr<double> RouterZLossForwardBackward(const TensorView& router_logits,
                                                  absl::Span<const uint8_t> input_mask,
                                                  int64_t global_routed_tokens, double alpha_z,
                                                  const TensorView& grad_router_logits);

// router_logits, input_mask, grad_router_logits: as above.
// global_expert_counts: c[l, m, :], E entries >= 0, summed over all ranks (detached);
//                       sum_e c_e must be a multiple of top_k.
// top_k:                K in [1, E]. num_micro_batches: G >= 1. alpha_b: finite, >= 0.
// Returns the local component. Errors: InvalidArgument for bad views, shapes, counts,
// K, G, alpha, mask values or non-finite routed rows; FailedPrecondition if this call has
// more routed rows than N_lm = sum_e c_e / K (the counts must be global).
absl::StatusOr<double> LoadBalancingLossForwardBackward(
    const TensorView& router_logits, absl::Span<const uint8_t> input_mask,
    absl::Span<const int64_t> global_expert_counts, int top_k, int num_micro_batches,
    double alpha_b, const TensorView& grad_router_logits);

// The same loss from the probabilities p = softmax(u) themselves ([T, E] f32, e.g. the
// softmax the model routed with), for a caller that back-propagates through its own
// softmax: adds dL/dp_t[e] = g_e to grad_router_probs for routed rows. Same arguments and
// errors (a non-finite probability in a routed row names the row).
absl::StatusOr<double> LoadBalancingLossFromProbsForwardBackward(
    const TensorView& router_probs, absl::Span<const uint8_t> input_mask,
    absl::Span<const int64_t> global_expert_counts, int top_k, int num_micro_batches,
    double alpha_b, const TensorView& grad_router_probs);

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_ROUTER_LOSSES_H_
