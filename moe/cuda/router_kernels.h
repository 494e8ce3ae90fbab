#ifndef GRADSUM_MOE_CUDA_ROUTER_KERNELS_H_
#define GRADSUM_MOE_CUDA_ROUTER_KERNELS_H_

// Internal launch interface of the router CUDA kernels (nvcc side; no absl).
// Use moe/cuda/router_cuda.h.

#include <cuda_runtime.h>

#include <cstdint>

namespace gradsum::moe::cuda_internal {

constexpr int kMaxCudaExperts = 1024;  // one warp per token, <= 32 experts per lane
constexpr int kMaxCudaTopK = 32;       // one lane per selected expert

struct RouterForwardLaunch {
  const float* logits = nullptr;  // [T, E]
  const uint8_t* mask = nullptr;  // [T] or null
  int64_t tokens = 0;
  int experts = 0;
  int top_k = 0;
  bool norm_topk_prob = false;
  float router_scale = 1.0f;
  bool sigmoid = false;                         // scores sigmoid(u) instead of softmax(u) (§5.1)
  const float* expert_bias = nullptr;           // [E] or null: added to the scores for top-K only
  float* probs = nullptr;                       // [T, E]
  int32_t* expert_index = nullptr;              // [T, K]
  float* combine_weight = nullptr;              // [T, K]
  float* logsumexp = nullptr;                   // [T] or null
  unsigned long long* expert_counts = nullptr;  // [E], zeroed by the caller
  unsigned long long* routed_tokens = nullptr;  // scalar, zeroed by the caller
  double* gating_sums = nullptr;                // [E] or null
  double* gating_partials = nullptr;            // [gating_chunks, E] scratch when gating_sums
  int gating_chunks = 0;
  unsigned long long* bad_token = nullptr;  // lowest token with a non-finite logit or bad mask
  int num_blocks = 0;
  cudaStream_t stream = nullptr;
};

cudaError_t LaunchRouterForward(const RouterForwardLaunch& l);

struct RouterAuxLaunch {
  const float* probs = nullptr;             // [T, E]
  const float* logsumexp = nullptr;         // [T]
  const uint8_t* mask = nullptr;            // [T] or null
  const int32_t* expert_index = nullptr;    // [T, K] (backward with d_combine_weight)
  const float* d_combine_weight = nullptr;  // [T, K] or null
  int64_t tokens = 0;
  int experts = 0;
  int top_k = 0;
  bool norm_topk_prob = false;
  float router_scale = 1.0f;
  bool sigmoid = false;           // probs are sigmoid(u) (§5.1)
  const float* logits = nullptr;  // [T, E] u: with sigmoid, the z-loss's softmax
  float alpha_z = 0.0f;
  float alpha_b = 0.0f;
  int num_micro_batches = 1;                      // G
  const double* global_routed_tokens = nullptr;   // N of §4 (whole step), device scalar
  const int64_t* global_expert_counts = nullptr;  // c[l, m, e] of §5, [E]
  const double* local_gating_sums = nullptr;      // [E] (loss)
  double* z_loss = nullptr;                       // (loss) device scalar
  double* balance_loss = nullptr;                 // (loss) device scalar
  bool accumulate = false;
  double* partials = nullptr;  // [num_blocks] scratch (loss)
  float* d_logits = nullptr;   // [T, E] (backward)
  int num_blocks = 0;
  cudaStream_t stream = nullptr;
};

cudaError_t LaunchRouterAuxLoss(const RouterAuxLaunch& l);
cudaError_t LaunchRouterBackward(const RouterAuxLaunch& l);

}  // namespace gradsum::moe::cuda_internal

#endif  // GRADSUM_MOE_CUDA_ROUTER_KERNELS_H_
