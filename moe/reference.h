#ifndef GRADSUM_MOE_REFERENCE_H_
#define GRADSUM_MOE_REFERENCE_H_

// Test-only single-process reference of one MoE layer (SEMANTICS.md §10) in double precision,
// written with plain loops and independently of router.cc / experts.cc / dispatch.cc:
// for each token a softmax, a top-K by repeated arg-max, and each chosen expert in loops.
// Gradients of anything built on it are taken by central finite differences
// (CentralDifference), so the reference never shares a backward with the code under test.

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace gradsum::moe::reference {

struct LayerConfig {
  int d_model = 0;      // D
  int hidden = 0;       // H
  int num_experts = 0;  // E
  int top_k = 0;        // K
  bool norm_topk_prob = false;
  double router_scale = 1.0;
};

// Routing of one token.
struct TokenRoute {
  std::vector<double> logits;   // [E]
  std::vector<double> probs;    // [E]
  std::vector<int> experts;     // [K], descending p, ties to the lower index
  std::vector<double> weights;  // [K]
};

inline TokenRoute RouteToken(const LayerConfig& c, const double* a, const std::vector<double>& wr) {
  TokenRoute r;
  r.logits.assign(c.num_experts, 0.0);
  for (int e = 0; e < c.num_experts; ++e) {
    for (int d = 0; d < c.d_model; ++d) r.logits[e] += a[d] * wr[d * c.num_experts + e];
  }
  double mx = r.logits[0];
  for (double v : r.logits) mx = v > mx ? v : mx;
  double z = 0.0;
  r.probs.resize(c.num_experts);
  for (int e = 0; e < c.num_experts; ++e) z += (r.probs[e] = std::exp(r.logits[e] - mx));
  for (double& p : r.probs) p /= z;
  std::vector<bool> taken(c.num_experts, false);
  double sum = 0.0;
  for (int k = 0; k < c.top_k; ++k) {
    int best = -1;
    for (int e = 0; e < c.num_experts; ++e) {
      // Strict '>' keeps the lower index on equal probabilities.
      if (!taken[e] && (best < 0 || r.probs[e] > r.probs[best])) best = e;
    }
    taken[best] = true;
    r.experts.push_back(best);
    r.weights.push_back(r.probs[best]);
    sum += r.probs[best];
  }
  for (double& w : r.weights) {
    if (c.norm_topk_prob) w /= sum;
    w *= c.router_scale;
  }
  return r;
}

// Expert e of stacked weights wg, wu: [E, D, H], wd: [E, H, D]; adds scale * Expert_e(x) to y.
inline void AddExpert(const LayerConfig& c, int e, const double* x, const std::vector<double>& wg,
                      const std::vector<double>& wu, const std::vector<double>& wd, double scale,
                      double* y) {
  const int D = c.d_model, H = c.hidden;
  for (int h = 0; h < H; ++h) {
    double g = 0.0, u = 0.0;
    for (int d = 0; d < D; ++d) {
      g += x[d] * wg[(static_cast<int64_t>(e) * D + d) * H + h];
      u += x[d] * wu[(static_cast<int64_t>(e) * D + d) * H + h];
    }
    const double act = g / (1.0 + std::exp(-g)) * u;
    for (int d = 0; d < D; ++d) y[d] += scale * act * wd[(static_cast<int64_t>(e) * H + h) * D + d];
  }
}

// The layer's MoE output for T tokens (a: [T, D]); padding tokens (mask 0) give 0.
inline std::vector<double> MoeLayer(const LayerConfig& c, const std::vector<double>& a,
                                    const std::vector<uint8_t>& mask, const std::vector<double>& wr,
                                    const std::vector<double>& wg, const std::vector<double>& wu,
                                    const std::vector<double>& wd) {
  const int64_t T = static_cast<int64_t>(a.size()) / c.d_model;
  std::vector<double> y(a.size(), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    if (!mask.empty() && mask[t] == 0) continue;
    TokenRoute r = RouteToken(c, &a[t * c.d_model], wr);
    for (int k = 0; k < c.top_k; ++k) {
      AddExpert(c, r.experts[k], &a[t * c.d_model], wg, wu, wd, r.weights[k], &y[t * c.d_model]);
    }
  }
  return y;
}

// Central difference (f(x+h) - f(x-h)) / 2h of f with respect to *x; restores *x.
inline double CentralDifference(const std::function<double()>& f, double* x, double h) {
  const double saved = *x;
  *x = saved + h;
  const double plus = f();
  *x = saved - h;
  const double minus = f();
  *x = saved;
  return (plus - minus) / (2.0 * h);
}

}  // namespace gradsum::moe::reference

#endif  // GRADSUM_MOE_REFERENCE_H_
