#ifndef GRADSUM_MOE_CUDA_ROUTER_CUDA_H_
#define GRADSUM_MOE_CUDA_ROUTER_CUDA_H_

// The MoE router on a CUDA device (SEMANTICS.md §4, §5, §10): the GPU counterpart of
// moe/router.h (same conventions: padding rows get probs 0, expert index -1, weight 0) plus
// the z-loss and load-balancing loss terms and the complete gradient with respect to the
// router logits. The logits GEMM u = a @ Wr and its backward (d_Wr += a^T du,
// d_a += du Wr^T) go through core/cuda/gemm.h (f32).
//
// One layer, one micro-batch, all on `stream`, no host sync except where stated:
//
//   RouterForwardCudaArgs f;                    // after GemmRowMajor(u = a @ Wr)
//   f.logits = u; f.mask = mask; f.tokens = T; f.experts = E; f.top_k = K;
//   f.probs = p; f.expert_index = idx; f.combine_weight = w; f.logsumexp = lse;
//   f.local_expert_counts = c_local; f.local_routed_tokens = n_local;
//   f.local_gating_sums = gsum; f.error = &flag;        // &flag: checked later
//   GRADSUM_RETURN_IF_ERROR(RouterForwardCuda(f, stream));
//   ... SUM all-reduce c_local -> c_global (NCCL, same stream), dispatch, experts ...
//   RouterAuxCudaArgs x;
//   x.probs = p; x.logsumexp = lse; x.mask = mask; x.tokens = T; x.experts = E; x.top_k = K;
//   x.alpha_z = 1e-3f; x.alpha_b = 1e-3f; x.num_micro_batches = G;
//   x.global_routed_tokens = n_step_dev; x.global_expert_counts = c_global;
//   x.local_gating_sums = gsum; x.z_loss = zl; x.balance_loss = bl; x.accumulate_loss = true;
//   GRADSUM_RETURN_IF_ERROR(RouterAuxLossCuda(x, stream));
//   x.expert_index = idx; x.d_combine_weight = dw; x.d_logits = du;   // dw from the combine
//   GRADSUM_RETURN_IF_ERROR(RouterBackwardCuda(x, stream));
//
// Limits: 1 <= E <= 1024, 1 <= K <= min(E, 32) (one warp per token).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "core/cuda/device_flag.h"

namespace gradsum::moe {

struct RouterForwardCudaArgs {
  const float* logits = nullptr;  // [T, E] u, fp32 (§10)
  const uint8_t* mask = nullptr;  // [T] 1 routed / 0 padding, or null: all routed
  int64_t tokens = 0;             // T >= 0
  int experts = 0;                // E
  int top_k = 0;                  // K
  bool norm_topk_prob = false;
  float router_scale = 1.0f;  // finite
  // §5.1 (as moe/router.h): sigmoid scores p = sigmoid(u) instead of softmax(u), and an
  // expert bias b [E] (device, finite; the model checks it, model/moe_lm.h SetExpertBias)
  // added to the scores for the top-K selection only: the K largest p + b (the sum in fp32,
  // equal sums -> lower index) are chosen, and the weights are of the unbiased p
  // (renormalised over the chosen p, 0 if they all round to 0). Null: no bias.
  bool sigmoid_scores = false;
  const float* expert_bias = nullptr;
  // Outputs (device; overwritten).
  float* probs = nullptr;  // [T, E] softmax(u) (or sigmoid(u)); 0 on padding rows
  int32_t* expert_index =
      nullptr;  // [T, K] descending p (+ b), equal -> lower index; -1 on padding
  float* combine_weight = nullptr;  // [T, K] w_k (renormalised if asked, times router_scale)
  float* logsumexp = nullptr;       // [T] logsumexp(u) for the z-loss (0 on padding); optional
  int64_t* local_expert_counts = nullptr;  // [E] (token, slot) assignments per expert (§5)
  int64_t* local_routed_tokens = nullptr;  // scalar, optional
  double* local_gating_sums = nullptr;     // [E] sum over routed t of p_t[e], fp64,
                                           // deterministic; optional
  // Where non-finite logits or mask values other than 0/1 are recorded (lowest token).
  // Null: the call waits for the stream and returns InvalidArgument itself.
  cuda::DeviceIndexFlag* error = nullptr;
};

// Errors: InvalidArgument for T < 0, E or K out of the limits, a non-finite router_scale,
// a null / non-device pointer (named); FailedPrecondition without a usable GPU; with
// `error == nullptr`, InvalidArgument naming the first token with a non-finite logit or
// a bad mask value (with a flag, the caller reads it: DeviceIndexFlag::ReadAndReset).
absl::Status RouterForwardCuda(const RouterForwardCudaArgs& args, cudaStream_t stream);

struct RouterAuxCudaArgs {
  const float* probs = nullptr;      // [T, E] from RouterForwardCuda
  const float* logsumexp = nullptr;  // [T] from RouterForwardCuda (needed when alpha_z != 0)
  const uint8_t* mask = nullptr;     // [T] or null
  int64_t tokens = 0;
  int experts = 0;
  int top_k = 0;
  float alpha_z = 0.0f;       // §4 (0 disables)
  float alpha_b = 0.0f;       // §5 (0 disables)
  int num_micro_batches = 1;  // G >= 1 (§5's 1/G)
  // N of §4: routed tokens over all ranks and micro-batches of the step (device fp64).
  const double* global_routed_tokens = nullptr;
  // c[l, m, e] of §5 after the SUM all-reduce over the world (device, [E]). N[l, m] is
  // derived as sum_e c / K; a micro-step with N == 0 contributes 0.
  const int64_t* global_expert_counts = nullptr;
  // Loss only.
  const double* local_gating_sums = nullptr;  // [E] from RouterForwardCuda
  double* z_loss = nullptr;                   // device scalar: local component of §4
  double* balance_loss = nullptr;             // device scalar: local component of §5
  bool accumulate_loss = false;               // += (display accumulation, §8) instead of =
  // Backward only.
  const int32_t* expert_index = nullptr;    // [T, K] from RouterForwardCuda
  const float* d_combine_weight = nullptr;  // [T, K] dL/dw_k, or null (no combine gradient)
  bool norm_topk_prob = false;              // as in forward
  float router_scale = 1.0f;                // as in forward
  // As in forward: `probs` are sigmoid(u) (§5.1). Then alpha_b must be 0 (the balancing loss
  // is of the softmax), and the backward needs the logits for the z-loss's softmax.
  bool sigmoid_scores = false;
  const float* logits = nullptr;  // [T, E] u (backward with sigmoid and alpha_z)
  float* d_logits = nullptr;      // [T, E] dL/du: written (0 on padding rows)
  bool accumulate_grad = false;   // d_logits += instead of =
};

// Local components of the z-loss and the balancing loss into z_loss / balance_loss.
// Errors: InvalidArgument for bad sizes, G < 1, non-finite alphas, alpha_b != 0 with
// sigmoid scores, null / non-device pointers (named); FailedPrecondition without a usable
// GPU.
absl::Status RouterAuxLossCuda(const RouterAuxCudaArgs& args, cudaStream_t stream);

// dL/du for L = (combine path through w_k) + L_z + L_bal, through the full softmax Jacobian:
//   dp[e] = alpha_b / G * E * c_e / (N^2 K)  (+ the w_k terms for chosen experts)
//   du    = p * (dp - <p, dp>) + 2 alpha_z lse p / N_z
// With sigmoid scores: du = p (1 - p) dp + 2 alpha_z lse softmax(u) / N_z.
// Same errors as RouterAuxLossCuda (and a null `logits` with sigmoid scores and alpha_z).
absl::Status RouterBackwardCuda(const RouterAuxCudaArgs& args, cudaStream_t stream);

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_CUDA_ROUTER_CUDA_H_
