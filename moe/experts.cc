#include "moe/experts.h"

#include <Eigen/Dense>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "moe/shapes.h"

namespace gradsum::moe {
namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const RowMatrix>;
using Map = Eigen::Map<RowMatrix>;

// Checks config, weights and group sizes; returns N = sum(group_sizes).
absl::StatusOr<int64_t> CheckCommon(const ExpertsConfig& config, const ExpertWeights& weights,
                                    absl::Span<const int64_t> group_sizes) {
  GRADSUM_RETURN_IF_ERROR(CheckExpertWeights(config, weights));
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert group_sizes", group_sizes.size(),
                                              config.num_local_experts, "[E_local]"));
  int64_t n = 0;
  for (size_t j = 0; j < group_sizes.size(); ++j) {
    if (group_sizes[j] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert group_sizes[", j, "] is negative (", group_sizes[j], ")"));
    }
    n += group_sizes[j];
  }
  return n;
}

inline float Sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

}  // namespace

absl::Status CheckExpertWeights(const ExpertsConfig& config, const ExpertWeights& weights) {
  GRADSUM_RETURN_IF_ERROR(ValidateExpertsConfig(config));
  const int64_t stacked = config.d_model * config.hidden * config.num_local_experts;
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("expert weight Wg", weights.gate.size(), stacked, "[E_local, D, H]"));
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("expert weight Wu", weights.up.size(), stacked, "[E_local, D, H]"));
  return internal::CheckSize("expert weight Wd", weights.down.size(), stacked, "[E_local, H, D]");
}

absl::Status CheckExpertWeightGrads(const ExpertsConfig& config, const ExpertWeightGrads& grads) {
  GRADSUM_RETURN_IF_ERROR(ValidateExpertsConfig(config));
  const int64_t stacked = config.d_model * config.hidden * config.num_local_experts;
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("expert grad dWg", grads.gate.size(), stacked, "[E_local, D, H]"));
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("expert grad dWu", grads.up.size(), stacked, "[E_local, D, H]"));
  return internal::CheckSize("expert grad dWd", grads.down.size(), stacked, "[E_local, H, D]");
}

absl::Status ValidateExpertsConfig(const ExpertsConfig& config) {
  if (config.d_model < 1 || config.hidden < 1 || config.num_local_experts < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "experts need D >= 1, H >= 1 and at least one local expert; got D=", config.d_model,
        ", H=", config.hidden, ", local experts=", config.num_local_experts));
  }
  return absl::OkStatus();
}

absl::Status ExpertsForward(const ExpertsConfig& config, const ExpertWeights& weights,
                            absl::Span<const float> x, absl::Span<const int64_t> group_sizes,
                            absl::Span<float> y, ExpertsSaved* saved) {
  GRADSUM_ASSIGN_OR_RETURN(const int64_t N, CheckCommon(config, weights, group_sizes));
  const int64_t D = config.d_model;
  const int64_t H = config.hidden;
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert input x", x.size(), N * D, "[N, D]"));
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert output y", y.size(), N * D, "[N, D]"));

  ExpertsSaved local;
  ExpertsSaved& s = saved != nullptr ? *saved : local;
  s.gate_pre.resize(N * H);
  s.up_pre.resize(N * H);
  std::vector<float> act;  // SiLU(g) * u of the current group
  int64_t row = 0;
  for (int j = 0; j < config.num_local_experts; ++j) {
    const int64_t n = group_sizes[j];
    if (n == 0) continue;
    ConstMap xj(x.data() + row * D, n, D);
    Map g(s.gate_pre.data() + row * H, n, H);
    Map u(s.up_pre.data() + row * H, n, H);
    g.noalias() = xj * ConstMap(weights.gate.data() + j * D * H, D, H);
    u.noalias() = xj * ConstMap(weights.up.data() + j * D * H, D, H);
    act.resize(n * H);
    for (int64_t i = 0; i < n * H; ++i) {
      const float gi = g.data()[i];
      act[i] = gi * Sigmoid(gi) * u.data()[i];
    }
    Map(y.data() + row * D, n, D).noalias() =
        ConstMap(act.data(), n, H) * ConstMap(weights.down.data() + j * H * D, H, D);
    row += n;
  }
  return absl::OkStatus();
}

absl::Status ExpertsBackward(const ExpertsConfig& config, const ExpertWeights& weights,
                             absl::Span<const float> x, absl::Span<const int64_t> group_sizes,
                             const ExpertsSaved& saved, absl::Span<const float> dy,
                             absl::Span<float> dx, const ExpertWeightGrads& grads) {
  GRADSUM_ASSIGN_OR_RETURN(const int64_t N, CheckCommon(config, weights, group_sizes));
  const int64_t D = config.d_model;
  const int64_t H = config.hidden;
  const int64_t stacked = D * H * config.num_local_experts;
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert input x", x.size(), N * D, "[N, D]"));
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert dy", dy.size(), N * D, "[N, D]"));
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert dx", dx.size(), N * D, "[N, D]"));
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("saved gate_pre", saved.gate_pre.size(), N * H, "[N, H]"));
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("saved up_pre", saved.up_pre.size(), N * H, "[N, H]"));
  GRADSUM_RETURN_IF_ERROR(CheckExpertWeightGrads(config, grads));

  std::vector<float> act, d_gate, d_up;
  int64_t row = 0;
  for (int j = 0; j < config.num_local_experts; ++j) {
    const int64_t n = group_sizes[j];
    if (n == 0) continue;
    ConstMap xj(x.data() + row * D, n, D);
    ConstMap dyj(dy.data() + row * D, n, D);
    ConstMap wg(weights.gate.data() + j * D * H, D, H);
    ConstMap wu(weights.up.data() + j * D * H, D, H);
    ConstMap wd(weights.down.data() + j * H * D, H, D);
    const float* g = saved.gate_pre.data() + row * H;
    const float* u = saved.up_pre.data() + row * H;
    act.resize(n * H);
    d_gate.resize(n * H);
    d_up.resize(n * H);
    // d(act) = dy Wd^T, computed into d_gate and turned into the two pre-activation grads.
    Map(d_gate.data(), n, H).noalias() = dyj * wd.transpose();
    for (int64_t i = 0; i < n * H; ++i) {
      const float sig = Sigmoid(g[i]);
      const float silu = g[i] * sig;
      const float d_act = d_gate[i];
      act[i] = silu * u[i];
      d_up[i] = d_act * silu;
      // SiLU'(g) = sig(g) (1 + g (1 - sig(g))).
      d_gate[i] = d_act * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
    }
    ConstMap dg(d_gate.data(), n, H);
    ConstMap du(d_up.data(), n, H);
    Map(grads.down.data() + j * H * D, H, D).noalias() +=
        ConstMap(act.data(), n, H).transpose() * dyj;
    Map(grads.gate.data() + j * D * H, D, H).noalias() += xj.transpose() * dg;
    Map(grads.up.data() + j * D * H, D, H).noalias() += xj.transpose() * du;
    Map dxj(dx.data() + row * D, n, D);
    dxj.noalias() = dg * wg.transpose();
    dxj.noalias() += du * wu.transpose();
    row += n;
  }
  return absl::OkStatus();
}

}  // namespace gradsum::moe
