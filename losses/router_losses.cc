#include "losses/router_losses.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"

namespace gradsum::losses {
namespace {

// `what`: "router logits" or "router probabilities", for the messages.
absl::Status CheckRouterViews(const TensorView& logits, absl::Span<const uint8_t> mask,
                              const TensorView& grad, const char* loss,
                              const char* what = "router logits") {
  if (logits.rank() != 2 || logits.dtype() != DType::kF32 || logits.device().type != Device::kCpu ||
      logits.dim(1) < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(loss, ": ", what, " must be a 2-D f32 CPU tensor [T, E] with E >= 1, got ",
                     logits.DebugString()));
  }
  if (grad.dtype() != DType::kF32 || grad.shape() != logits.shape() ||
      grad.device().type != Device::kCpu) {
    return absl::InvalidArgumentError(absl::StrCat(loss, ": the gradient ", grad.DebugString(),
                                                   " must match the ", what, " ",
                                                   logits.DebugString()));
  }
  const char* a = static_cast<const char*>(logits.raw());
  const char* b = static_cast<const char*>(grad.raw());
  if (logits.nbytes() > 0 && a < b + grad.nbytes() && b < a + logits.nbytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat(loss, ": the gradient must not overlap the ", what));
  }
  if (!mask.empty() && static_cast<int64_t>(mask.size()) != logits.dim(0)) {
    return absl::InvalidArgumentError(absl::StrCat(loss, ": input_mask has ", mask.size(),
                                                   " entries for ", logits.dim(0), " rows"));
  }
  for (size_t t = 0; t < mask.size(); ++t) {
    if (mask[t] > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          loss, ": input_mask[", t, "] = ", static_cast<int>(mask[t]), " must be 0 or 1"));
    }
  }
  return absl::OkStatus();
}

bool Routed(absl::Span<const uint8_t> mask, int64_t t) { return mask.empty() || mask[t] == 1; }

int64_t CountRouted(absl::Span<const uint8_t> mask, int64_t rows) {
  if (mask.empty()) return rows;
  int64_t n = 0;
  for (uint8_t m : mask) n += m;
  return n;
}

absl::Status CheckAlpha(double alpha, const char* loss) {
  if (!std::isfinite(alpha) || alpha < 0.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(loss, ": alpha ", alpha, " must be finite and >= 0"));
  }
  return absl::OkStatus();
}

// softmax(u) into p (fp64) and logsumexp(u); InvalidArgument if u has a non-finite entry.
absl::Status RowSoftmax(const float* u, int64_t e, int64_t row, const char* loss,
                        std::vector<double>& p, double* lse) {
  double mx = -INFINITY;
  for (int64_t j = 0; j < e; ++j) {
    if (!std::isfinite(u[j])) {
      return absl::InvalidArgumentError(absl::StrCat(
          loss, ": router logits row ", row, " has a non-finite entry ", u[j], " at expert ", j));
    }
    mx = std::max(mx, static_cast<double>(u[j]));
  }
  double s = 0.0;
  for (int64_t j = 0; j < e; ++j) {
    p[j] = std::exp(static_cast<double>(u[j]) - mx);
    s += p[j];
  }
  for (int64_t j = 0; j < e; ++j) p[j] /= s;
  *lse = mx + std::log(s);
  return absl::OkStatus();
}

// The checks of the load-balancing loss (§5) and its coefficients g_e = dL/dp_t[e] =
// alpha_b * E * c_e / (G * K * N_lm^2), N_lm = sum_e c_e / K. `g` is left empty when the
// micro-step contributes 0 (alpha_b == 0 or N_lm == 0).
absl::Status BalancingCoefficients(const TensorView& router, const char* what,
                                   absl::Span<const uint8_t> input_mask,
                                   absl::Span<const int64_t> global_expert_counts, int top_k,
                                   int num_micro_batches, double alpha_b, const TensorView& grad,
                                   const char* kLoss, std::vector<double>* g) {
  absl::Status s = CheckRouterViews(router, input_mask, grad, kLoss, what);
  if (!s.ok()) return s;
  s = CheckAlpha(alpha_b, kLoss);
  if (!s.ok()) return s;
  const int64_t rows = router.dim(0);
  const int64_t e = router.dim(1);
  if (static_cast<int64_t>(global_expert_counts.size()) != e) {
    return absl::InvalidArgumentError(absl::StrCat(kLoss, ": ", global_expert_counts.size(),
                                                   " expert counts for ", e, " experts"));
  }
  if (top_k < 1 || top_k > e) {
    return absl::InvalidArgumentError(
        absl::StrCat(kLoss, ": top_k ", top_k, " must be in [1, ", e, "]"));
  }
  if (num_micro_batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kLoss, ": number of micro-batches G = ", num_micro_batches, " must be >= 1"));
  }
  int64_t assignments = 0;
  for (int64_t j = 0; j < e; ++j) {
    if (global_expert_counts[j] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          kLoss, ": expert count c[", j, "] = ", global_expert_counts[j], " is negative"));
    }
    assignments += global_expert_counts[j];
  }
  if (assignments % top_k != 0) {
    return absl::InvalidArgumentError(absl::StrCat(kLoss, ": expert counts sum to ", assignments,
                                                   ", not a multiple of top_k = ", top_k));
  }
  const int64_t n_lm = assignments / top_k;  // routed tokens of this micro-step, all ranks
  const int64_t local_routed = CountRouted(input_mask, rows);
  if (local_routed > n_lm) {
    return absl::FailedPreconditionError(absl::StrCat(
        kLoss, ": ", local_routed, " routed rows here but the expert counts give N = ", n_lm,
        "; the counts must be summed over all ranks (SEMANTICS.md §5)"));
  }
  g->clear();
  if (alpha_b == 0.0 || n_lm == 0) return absl::OkStatus();
  const double n = static_cast<double>(n_lm);
  g->resize(static_cast<size_t>(e));
  for (int64_t j = 0; j < e; ++j) {
    (*g)[j] = alpha_b * static_cast<double>(e) * static_cast<double>(global_expert_counts[j]) /
              (static_cast<double>(num_micro_batches) * top_k * n * n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<double> RouterZLossForwardBackward(const TensorView& router_logits,
                                                  absl::Span<const uint8_t> input_mask,
                                                  int64_t global_routed_tokens, double alpha_z,
                                                  const TensorView& grad_router_logits) {
  constexpr const char* kLoss = "router z-loss";
  absl::Status s = CheckRouterViews(router_logits, input_mask, grad_router_logits, kLoss);
  if (!s.ok()) return s;
  s = CheckAlpha(alpha_z, kLoss);
  if (!s.ok()) return s;
  const int64_t rows = router_logits.dim(0);
  const int64_t e = router_logits.dim(1);
  if (global_routed_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        kLoss, ": global routed token count N = ", global_routed_tokens, " is negative"));
  }
  const int64_t local_routed = CountRouted(input_mask, rows);
  if (local_routed > global_routed_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        kLoss, ": ", local_routed, " routed rows here but global N = ", global_routed_tokens,
        "; N must count routed tokens over all ranks and micro-batches (SEMANTICS.md §4)"));
  }
  if (alpha_z == 0.0 || global_routed_tokens == 0) return 0.0;

  const float* u = router_logits.data<float>();
  float* du = grad_router_logits.data<float>();
  const double n = static_cast<double>(global_routed_tokens);
  std::vector<double> p(static_cast<size_t>(e));
  double sum_lse_sq = 0.0;
  for (int64_t t = 0; t < rows; ++t) {
    if (!Routed(input_mask, t)) continue;
    double lse = 0.0;
    s = RowSoftmax(u + t * e, e, t, kLoss, p, &lse);
    if (!s.ok()) return s;
    sum_lse_sq += lse * lse;
    const double coeff = alpha_z * 2.0 * lse / n;  // §4: d(lse^2)/du = 2 lse softmax(u)
    for (int64_t j = 0; j < e; ++j) du[t * e + j] += static_cast<float>(coeff * p[j]);
  }
  return alpha_z * sum_lse_sq / n;
}

absl::StatusOr<double> LoadBalancingLossForwardBackward(
    const TensorView& router_logits, absl::Span<const uint8_t> input_mask,
    absl::Span<const int64_t> global_expert_counts, int top_k, int num_micro_batches,
    double alpha_b, const TensorView& grad_router_logits) {
  constexpr const char* kLoss = "load-balancing loss";
  std::vector<double> g;  // g_e = dL/dp_t[e], the same for every routed token (§5)
  absl::Status s =
      BalancingCoefficients(router_logits, "router logits", input_mask, global_expert_counts, top_k,
                            num_micro_batches, alpha_b, grad_router_logits, kLoss, &g);
  if (!s.ok()) return s;
  if (g.empty()) return 0.0;
  const int64_t rows = router_logits.dim(0);
  const int64_t e = router_logits.dim(1);
  const float* u = router_logits.data<float>();
  float* du = grad_router_logits.data<float>();
  std::vector<double> p(static_cast<size_t>(e));
  double loss = 0.0;
  for (int64_t t = 0; t < rows; ++t) {
    if (!Routed(input_mask, t)) continue;
    double lse = 0.0;
    s = RowSoftmax(u + t * e, e, t, kLoss, p, &lse);
    if (!s.ok()) return s;
    double g_dot_p = 0.0;
    for (int64_t j = 0; j < e; ++j) g_dot_p += g[j] * p[j];
    loss += g_dot_p;  // sum_e g_e p_t[e] is token t's share of the loss
    for (int64_t j = 0; j < e; ++j) du[t * e + j] += static_cast<float>(p[j] * (g[j] - g_dot_p));
  }
  return loss;
}

absl::StatusOr<double> LoadBalancingLossFromProbsForwardBackward(
    const TensorView& router_probs, absl::Span<const uint8_t> input_mask,
    absl::Span<const int64_t> global_expert_counts, int top_k, int num_micro_batches,
    double alpha_b, const TensorView& grad_router_probs) {
  constexpr const char* kLoss = "load-balancing loss";
  std::vector<double> g;
  absl::Status s =
      BalancingCoefficients(router_probs, "router probabilities", input_mask, global_expert_counts,
                            top_k, num_micro_batches, alpha_b, grad_router_probs, kLoss, &g);
  if (!s.ok()) return s;
  if (g.empty()) return 0.0;
  const int64_t rows = router_probs.dim(0);
  const int64_t e = router_probs.dim(1);
  const float* p = router_probs.data<float>();
  float* dp = grad_router_probs.data<float>();
  double loss = 0.0;
  for (int64_t t = 0; t < rows; ++t) {
    if (!Routed(input_mask, t)) continue;
    for (int64_t j = 0; j < e; ++j) {
      if (!std::isfinite(p[t * e + j])) {
        return absl::InvalidArgumentError(absl::StrCat(kLoss, ": router probabilities row ", t,
                                                       " has a non-finite entry ", p[t * e + j],
                                                       " at expert ", j));
      }
      loss += g[j] * p[t * e + j];
      dp[t * e + j] += static_cast<float>(g[j]);
    }
  }
  return loss;
}

}  // namespace gradsum::losses
