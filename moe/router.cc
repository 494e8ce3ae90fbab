#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "core/gemm.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "core/vec_math.h"
#include "moe/shapes.h"

namespace gradsum::moe {
namespace {

absl::StatusOr<int64_t> CheckInputs(const RouterConfig& config, absl::Span<const float> a,
                                    absl::Span<const float> router_weight) {
  GRADSUM_RETURN_IF_ERROR(ValidateRouterConfig(config));
  if (a.size() % static_cast<size_t>(config.d_model) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router input a has ", a.size(), " elements, not a multiple of D=", config.d_model));
  }
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("router weight Wr", router_weight.size(),
                                              config.d_model * config.num_experts, "[D, E]"));
  return static_cast<int64_t>(a.size()) / config.d_model;
}

// Runs fn(first_row, rows) over the row blocks of config.row_block (one block of all T
// rows when it is 0), in parallel over the thread budget; the first error in block order.
absl::Status ForEachRowBlock(const RouterConfig& config, int64_t T,
                             const std::function<absl::Status(int64_t, int64_t)>& fn) {
  if (config.row_block <= 0) return fn(0, T);
  const int64_t blocks = (T + config.row_block - 1) / config.row_block;
  return ParallelForStatus(ComputeThreads(), blocks, [&](int64_t b) {
    const int64_t r0 = b * config.row_block;
    return fn(r0, std::min(config.row_block, T - r0));
  });
}

// Threads for one GEMM of ForEachRowBlock's fn: the budget when there is one block of all
// rows, else 1 (the blocks are the parallelism).
int GemmThreads(const RouterConfig& config) { return config.row_block > 0 ? 1 : ComputeThreads(); }

// The optional expert bias ([E], finite) and mask ([T], 0 or 1) of RouterForward.
absl::Status CheckBiasAndMask(int E, int64_t T, absl::Span<const uint8_t> mask,
                              absl::Span<const float> expert_bias) {
  if (!expert_bias.empty()) {
    GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert bias", expert_bias.size(), E, "[E]"));
    for (int e = 0; e < E; ++e) {
      if (!std::isfinite(expert_bias[e])) {
        return absl::InvalidArgumentError(
            absl::StrCat("expert bias[", e, "] is not finite (", expert_bias[e], ")"));
      }
    }
  }
  if (!mask.empty()) {
    GRADSUM_RETURN_IF_ERROR(internal::CheckSize("router mask", mask.size(), T, "[T]"));
    for (int64_t t = 0; t < T; ++t) {
      if (mask[t] > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "router mask[", t, "] is ", static_cast<int>(mask[t]), ", expected 0 or 1"));
      }
    }
  }
  return absl::OkStatus();
}

// A RouterOutput for T tokens, zeroed (expert_index -1), every token routed unless `mask`.
RouterOutput EmptyRouterOutput(int64_t T, int E, int K, absl::Span<const uint8_t> mask) {
  RouterOutput out;
  out.num_tokens = T;
  out.num_experts = E;
  out.top_k = K;
  out.logits.assign(T * E, 0.0f);
  out.probs.assign(T * E, 0.0f);
  out.expert_index.assign(T * K, -1);
  out.combine_weight.assign(T * K, 0.0f);
  out.routed.assign(T, 1);
  if (!mask.empty()) std::copy(mask.begin(), mask.end(), out.routed.begin());
  out.local_expert_counts.assign(E, 0);
  out.local_gating_sums.assign(E, 0.0);
  return out;
}

// out.probs from out.logits. Pass 1, in token order (the first bad logit is the one
// reported): check the logits, zero the padding rows' logits, and write u - max(u) into p
// (-inf for padding, so its probabilities come out 0). Pass 2: one vectorised exp over all
// of p (core/vec_math.h). Sigmoid scores: pass 1 checks, pass 2 is one vectorised sigmoid
// of the routed rows. Softmax rows are normalised later, by SelectTopK.
absl::Status ScoresFromLogits(bool sigmoid, RouterOutput& out) {
  const int64_t T = out.num_tokens;
  const int E = out.num_experts;
  for (int64_t t = 0; t < T; ++t) {
    float* u = &out.logits[t * E];
    float* p = &out.probs[t * E];
    if (!out.routed[t]) {
      std::fill(u, u + E, 0.0f);
      std::fill(p, p + E, -std::numeric_limits<float>::infinity());
      continue;
    }
    float max_u = u[0];
    for (int e = 0; e < E; ++e) {
      if (!std::isfinite(u[e])) {
        return absl::InvalidArgumentError(absl::StrCat("router logit u[token ", t, ", expert ", e,
                                                       "] is not finite (", u[e], ")"));
      }
      max_u = std::max(max_u, u[e]);
    }
    if (!sigmoid) {
      for (int e = 0; e < E; ++e) p[e] = u[e] - max_u;
    }
  }
  if (sigmoid) {
    for (int64_t t = 0; t < T; ++t) {
      if (out.routed[t]) {
        vec::Sigmoid(&out.logits[t * E], &out.probs[t * E], E);
      } else {
        std::fill(&out.probs[t * E], &out.probs[t * E] + E, 0.0f);
      }
    }
  } else {
    vec::Exp(out.probs.data(), out.probs.data(), T * E);
  }
  return absl::OkStatus();
}

// Per routed token: the softmax normalisation (softmax scores), the gating sums, and the
// top-K experts with their combine weights and counts.
void SelectTopK(const RouterConfig& config, bool sigmoid, absl::Span<const float> expert_bias,
                RouterOutput& out) {
  const int E = out.num_experts;
  const int K = out.top_k;
  std::vector<int> order(E);
  std::vector<float> biased(expert_bias.empty() ? 0 : E);
  for (int64_t t = 0; t < out.num_tokens; ++t) {
    if (!out.routed[t]) continue;
    ++out.local_routed_tokens;
    float* p = &out.probs[t * E];
    if (!sigmoid) {
      double z = 0.0;
      for (int e = 0; e < E; ++e) z += p[e];
      const float inv_z = static_cast<float>(1.0 / z);
      for (int e = 0; e < E; ++e) p[e] *= inv_z;
    }
    for (int e = 0; e < E; ++e) out.local_gating_sums[e] += p[e];

    // Top-K by p (+ the bias, §5.1), descending; equal: lower expert index first (§10).
    const float* key = p;
    if (!expert_bias.empty()) {
      for (int e = 0; e < E; ++e) biased[e] = p[e] + expert_bias[e];
      key = biased.data();
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [key](int x, int y) {
      return key[x] > key[y] || (key[x] == key[y] && x < y);
    });
    double topk_sum = 0.0;
    for (int k = 0; k < K; ++k) topk_sum += p[order[k]];
    // Unbiased softmax selection: topk_sum >= max_e p >= 1/E > 0. A bias or sigmoid scores
    // may pick scores that all round to 0: then the weights are 0, not NaN.
    const double norm = !config.norm_topk_prob ? 1.0 : (topk_sum > 0.0 ? 1.0 / topk_sum : 0.0);
    for (int k = 0; k < K; ++k) {
      const int e = order[k];
      out.expert_index[t * K + k] = e;
      out.combine_weight[t * K + k] =
          static_cast<float>(p[e] * norm * static_cast<double>(config.router_scale));
      ++out.local_expert_counts[e];
    }
  }
}

}  // namespace

const char* RouterScoreName(RouterScore score) {
  switch (score) {
    case RouterScore::kSoftmax:
      return "softmax";
    case RouterScore::kSigmoid:
      return "sigmoid";
  }
  return "unknown";
}

absl::Status ValidateRouterConfig(const RouterConfig& config) {
  if (config.d_model < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("router d_model must be >= 1, got D=", config.d_model));
  }
  if (config.num_experts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("number of experts must be >= 1, got E=", config.num_experts));
  }
  if (config.top_k < 1 || config.top_k > config.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k must be in [1, E=", config.num_experts, "], got K=", config.top_k));
  }
  if (!std::isfinite(config.router_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("router_scale must be finite, got ", config.router_scale));
  }
  if (config.row_block < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("router row_block must be >= 0, got ", config.row_block));
  }
  return absl::OkStatus();
}

absl::StatusOr<RouterOutput> RouterForward(const RouterConfig& config, absl::Span<const float> a,
                                           absl::Span<const float> router_weight,
                                           absl::Span<const uint8_t> mask,
                                           absl::Span<const float> expert_bias) {
  GRADSUM_ASSIGN_OR_RETURN(const int64_t T, CheckInputs(config, a, router_weight));
  const int64_t D = config.d_model;
  const int E = config.num_experts;
  const int K = config.top_k;
  const bool sigmoid = config.score == RouterScore::kSigmoid;
  GRADSUM_RETURN_IF_ERROR(CheckBiasAndMask(E, T, mask, expert_bias));
  RouterOutput out = EmptyRouterOutput(T, E, K, mask);
  if (T == 0) return out;

  // u = a @ Wr in fp32 (SEMANTICS.md §10).
  GRADSUM_RETURN_IF_ERROR(ForEachRowBlock(config, T, [&](int64_t r0, int64_t n) {
    return Sgemm(Trans::kNo, Trans::kNo, n, E, D, 1.0f, a.subspan(r0 * D, n * D), D, router_weight,
                 E, 0.0f, absl::MakeSpan(out.logits).subspan(r0 * E, n * E), E,
                 GemmThreads(config));
  }));
  GRADSUM_RETURN_IF_ERROR(ScoresFromLogits(sigmoid, out));
  SelectTopK(config, sigmoid, expert_bias, out);
  return out;
}

absl::Status RouterBackward(const RouterConfig& config, absl::Span<const float> a,
                            absl::Span<const float> router_weight, const RouterOutput& forward,
                            const RouterOutputGrads& grads, absl::Span<float> d_router_weight,
                            absl::Span<float> d_a, ExactGradSink* d_router_weight_exact) {
  GRADSUM_ASSIGN_OR_RETURN(const int64_t T, CheckInputs(config, a, router_weight));
  const int64_t D = config.d_model;
  const int E = config.num_experts;
  const int K = config.top_k;
  if (forward.num_tokens != T || forward.num_experts != E || forward.top_k != K ||
      forward.probs.size() != static_cast<size_t>(T * E) ||
      forward.expert_index.size() != static_cast<size_t>(T * K) ||
      forward.routed.size() != static_cast<size_t>(T)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router forward output (T=", forward.num_tokens, ", E=", forward.num_experts, ", K=",
        forward.top_k, ") does not match the backward inputs (T=", T, ", E=", E, ", K=", K, ")"));
  }
  if (!grads.d_combine_weight.empty()) {
    GRADSUM_RETURN_IF_ERROR(
        internal::CheckSize("d_combine_weight", grads.d_combine_weight.size(), T * K, "[T, K]"));
  }
  if (!grads.d_probs.empty()) {
    GRADSUM_RETURN_IF_ERROR(internal::CheckSize("d_probs", grads.d_probs.size(), T * E, "[T, E]"));
  }
  if (!grads.d_gating_sums.empty()) {
    GRADSUM_RETURN_IF_ERROR(
        internal::CheckSize("d_gating_sums", grads.d_gating_sums.size(), E, "[E]"));
  }
  if (!grads.d_logits.empty()) {
    GRADSUM_RETURN_IF_ERROR(
        internal::CheckSize("d_logits", grads.d_logits.size(), T * E, "[T, E]"));
  }
  if (d_router_weight_exact == nullptr) {
    GRADSUM_RETURN_IF_ERROR(
        internal::CheckSize("d_router_weight", d_router_weight.size(), D * E, "[D, E]"));
  }
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("d_a", d_a.size(), T * D, "[T, D]"));
  if (T == 0) return absl::OkStatus();

  const double scale = config.router_scale;
  std::vector<float> du(T * E, 0.0f);
  std::vector<double> dp(E);
  for (int64_t t = 0; t < T; ++t) {
    if (!forward.routed[t]) continue;  // padding: no routing, no gradient
    const float* p = &forward.probs[t * E];
    for (int e = 0; e < E; ++e) {
      dp[e] = 0.0;
      if (!grads.d_probs.empty()) dp[e] += grads.d_probs[t * E + e];
      if (!grads.d_gating_sums.empty()) dp[e] += grads.d_gating_sums[e];
    }
    if (!grads.d_combine_weight.empty()) {
      const int32_t* idx = &forward.expert_index[t * K];
      const float* dw = &grads.d_combine_weight[t * K];
      if (config.norm_topk_prob) {
        // w_k = s q_k / Z with Z = sum_j q_j:  dL/dq_j = s/Z (dw_j - sum_k dw_k q_k / Z).
        double z = 0.0, dw_dot_q = 0.0;
        for (int k = 0; k < K; ++k) {
          z += p[idx[k]];
          dw_dot_q += static_cast<double>(dw[k]) * p[idx[k]];
        }
        // Z = 0 (forward's weights were 0, see RouterForward): no gradient.
        for (int k = 0; k < K && z > 0.0; ++k) dp[idx[k]] += scale / z * (dw[k] - dw_dot_q / z);
      } else {
        for (int k = 0; k < K; ++k) dp[idx[k]] += scale * dw[k];
      }
    }
    // Softmax Jacobian: du_e = p_e (dp_e - sum_j p_j dp_j); sigmoid: du_e = p_e (1 - p_e) dp_e.
    const bool sigmoid = config.score == RouterScore::kSigmoid;
    double p_dot_dp = 0.0;
    if (!sigmoid) {
      for (int e = 0; e < E; ++e) p_dot_dp += p[e] * dp[e];
    }
    float* du_t = &du[t * E];
    for (int e = 0; e < E; ++e) {
      double g = sigmoid ? p[e] * (1.0 - p[e]) * dp[e] : p[e] * (dp[e] - p_dot_dp);
      if (!grads.d_logits.empty()) g += grads.d_logits[t * E + e];
      du_t[e] = static_cast<float>(g);
    }
  }

  // dWr += a^T du (exact: each block's share into its own scratch row, added to the sink in
  // block order);  d_a += du Wr^T.
  if (d_router_weight_exact != nullptr) {
    const int64_t block = config.row_block > 0 ? config.row_block : T;
    const int64_t blocks = (T + block - 1) / block;
    std::vector<float> share(blocks * D * E);
    GRADSUM_RETURN_IF_ERROR(ForEachRowBlock(config, T, [&](int64_t r0, int64_t n) {
      return Sgemm(Trans::kYes, Trans::kNo, D, E, n, 1.0f, a.subspan(r0 * D, n * D), D,
                   absl::MakeConstSpan(du).subspan(r0 * E, n * E), E, 0.0f,
                   absl::MakeSpan(share).subspan(r0 / block * D * E, D * E), E, 1);
    }));
    for (int64_t b = 0; b < blocks; ++b) {
      GRADSUM_RETURN_IF_ERROR(
          d_router_weight_exact->Add(0, absl::MakeConstSpan(share).subspan(b * D * E, D * E)));
    }
  } else {
    GRADSUM_RETURN_IF_ERROR(Sgemm(Trans::kYes, Trans::kNo, D, E, T, 1.0f, a, D, du, E, 1.0f,
                                  d_router_weight, E, ComputeThreads()));
  }
  return ForEachRowBlock(config, T, [&](int64_t r0, int64_t n) {
    return Sgemm(Trans::kNo, Trans::kYes, n, D, E, 1.0f,
                 absl::MakeConstSpan(du).subspan(r0 * E, n * E), E, router_weight, E, 1.0f,
                 d_a.subspan(r0 * D, n * D), D, GemmThreads(config));
  });
}

}  // namespace gradsum::moe
