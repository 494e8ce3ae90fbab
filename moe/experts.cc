#include "moe/experts.h"

#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/gemm.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "core/vec_math.h"
#include "moe/shapes.h"

namespace gradsum::moe {
namespace {

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
  if (config.row_blocks != nullptr) {
    const std::vector<std::vector<int64_t>>& blocks = *config.row_blocks;
    GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert row_blocks", blocks.size(),
                                                config.num_local_experts, "[E_local]"));
    for (size_t j = 0; j < group_sizes.size(); ++j) {
      if (group_sizes[j] == 0) continue;  // not in this call (dispatch's pipeline chunks)
      int64_t sum = 0;
      for (int64_t b : blocks[j]) {
        if (b < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("expert row_blocks[", j, "] has a negative block (", b, ")"));
        }
        sum += b;
      }
      if (sum != group_sizes[j]) {
        return absl::InvalidArgumentError(absl::StrCat("expert row_blocks[", j, "] sum to ", sum,
                                                       " rows, group_sizes[", j, "] is ",
                                                       group_sizes[j]));
      }
    }
  }
  return n;
}

// Runs fn(first_row, rows) for each row block of local expert j, whose rows start at `row`
// and number `n`: the blocks of config.row_blocks in order, else the whole group.
absl::Status ForEachBlock(const ExpertsConfig& config, int j, int64_t row, int64_t n,
                          const std::function<absl::Status(int64_t, int64_t)>& fn) {
  if (config.row_blocks == nullptr) return fn(row, n);
  for (int64_t b : (*config.row_blocks)[j]) {
    if (b > 0) GRADSUM_RETURN_IF_ERROR(fn(row, b));
    row += b;
  }
  return absl::OkStatus();
}

// First row of each group: offsets[j] = sum(group_sizes[0, j)).
std::vector<int64_t> GroupOffsets(absl::Span<const int64_t> group_sizes) {
  std::vector<int64_t> offsets(group_sizes.size() + 1, 0);
  for (size_t j = 0; j < group_sizes.size(); ++j) offsets[j + 1] = offsets[j] + group_sizes[j];
  return offsets;
}

// Scratch of the calling thread, reused across calls: the step's [N, H] temporaries would
// otherwise be fresh allocations (page faults, zero fill) on every forward and backward.
// Contents are unspecified; `slot` picks one of four independent buffers (the fourth holds
// a row block's weight-gradient contribution in reproducible mode).
absl::Span<float> Scratch(int slot, int64_t n) {
  thread_local std::vector<float> buffers[4];
  std::vector<float>& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < n) b.resize(n);
  return absl::MakeSpan(b.data(), n);
}

// Runs fn(j) for every local expert with rows, spread over the rank's compute threads
// (ComputeThreads(), core/thread_pool.h). Each expert touches only its own rows and its own
// weight-gradient block, with single-threaded GEMMs, so the result does not depend on the
// thread count. Returns the first error in expert order.
absl::Status ForEachExpert(absl::Span<const int64_t> group_sizes,
                           const std::function<absl::Status(int)>& fn) {
  return ParallelForStatus(
      ComputeThreads(), static_cast<int64_t>(group_sizes.size()),
      [&](int64_t j) { return group_sizes[j] > 0 ? fn(static_cast<int>(j)) : absl::OkStatus(); });
}

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
  if (grads.exact != nullptr) return absl::OkStatus();  // the spans are not used
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
  const absl::Span<float> act = Scratch(0, N * H);  // SiLU(g) * u
  const std::vector<int64_t> offsets = GroupOffsets(group_sizes);
  return ForEachExpert(group_sizes, [&](int j) -> absl::Status {
    return ForEachBlock(
        config, j, offsets[j], group_sizes[j], [&](int64_t row, int64_t n) -> absl::Status {
          const auto xj = x.subspan(row * D, n * D);
          float* g = s.gate_pre.data() + row * H;
          float* u = s.up_pre.data() + row * H;
          float* a = act.data() + row * H;
          GRADSUM_RETURN_IF_ERROR(Sgemm(Trans::kNo, Trans::kNo, n, H, D, 1.0f, xj, D,
                                        weights.gate.subspan(j * D * H, D * H), H, 0.0f,
                                        absl::MakeSpan(g, n * H), H));
          GRADSUM_RETURN_IF_ERROR(Sgemm(Trans::kNo, Trans::kNo, n, H, D, 1.0f, xj, D,
                                        weights.up.subspan(j * D * H, D * H), H, 0.0f,
                                        absl::MakeSpan(u, n * H), H));
          vec::SwiGlu(g, u, a, n * H);  // vectorised, the same bits on every CPU
          return Sgemm(Trans::kNo, Trans::kNo, n, D, H, 1.0f, absl::MakeConstSpan(a, n * H), H,
                       weights.down.subspan(j * H * D, H * D), D, 0.0f, y.subspan(row * D, n * D),
                       D);
        });
  });
}

absl::Status ExpertsBackward(const ExpertsConfig& config, const ExpertWeights& weights,
                             absl::Span<const float> x, absl::Span<const int64_t> group_sizes,
                             const ExpertsSaved& saved, absl::Span<const float> dy,
                             absl::Span<float> dx, const ExpertWeightGrads& grads) {
  GRADSUM_ASSIGN_OR_RETURN(const int64_t N, CheckCommon(config, weights, group_sizes));
  const int64_t D = config.d_model;
  const int64_t H = config.hidden;
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert input x", x.size(), N * D, "[N, D]"));
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert dy", dy.size(), N * D, "[N, D]"));
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("expert dx", dx.size(), N * D, "[N, D]"));
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("saved gate_pre", saved.gate_pre.size(), N * H, "[N, H]"));
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("saved up_pre", saved.up_pre.size(), N * H, "[N, H]"));
  GRADSUM_RETURN_IF_ERROR(CheckExpertWeightGrads(config, grads));

  const absl::Span<float> act = Scratch(0, N * H), d_gate = Scratch(1, N * H),
                          d_up = Scratch(2, N * H);
  const std::vector<int64_t> offsets = GroupOffsets(group_sizes);
  const int64_t El = config.num_local_experts;
  return ForEachExpert(group_sizes, [&](int j) -> absl::Status {
    const auto wg = weights.gate.subspan(j * D * H, D * H);
    const auto wu = weights.up.subspan(j * D * H, D * H);
    const auto wd = weights.down.subspan(j * H * D, H * D);
    // Weight gradient `which` (0 Wg, 1 Wu, 2 Wd: the stacked order) of rows [row, row + n):
    // X^T dY (x^T dg, x^T du, act^T dy) into `out`, added to it (beta 1) or over it (beta 0).
    // Wd, Wg, Wu is the order both modes run them in.
    constexpr int kWeightOrder[] = {2, 0, 1};
    auto weight_grad = [&](int which, int64_t row, int64_t n, float beta,
                           absl::Span<float> out) -> absl::Status {
      const int64_t rows = which == 2 ? H : D, cols = which == 2 ? D : H;
      const auto xt = which == 2 ? act.subspan(row * H, n * H) : x.subspan(row * D, n * D);
      const auto d = which == 2   ? dy.subspan(row * D, n * D)
                     : which == 0 ? d_gate.subspan(row * H, n * H)
                                  : d_up.subspan(row * H, n * H);
      return Sgemm(Trans::kYes, Trans::kNo, rows, cols, n, 1.0f, xt, rows, d, cols, beta, out,
                   cols);
    };
    // Row products per block: d(act) = dy Wd^T, the SwiGLU backward (in place: d(act) ->
    // dL/dg; also dL/du and the forward's act, core/vec_math.h), dx = dg Wg^T + du Wu^T.
    GRADSUM_RETURN_IF_ERROR(ForEachBlock(
        config, j, offsets[j], group_sizes[j], [&](int64_t row, int64_t n) -> absl::Status {
          const auto dyj = dy.subspan(row * D, n * D);
          const float* g = saved.gate_pre.data() + row * H;
          const float* u = saved.up_pre.data() + row * H;
          float* dg = d_gate.data() + row * H;
          float* du = d_up.data() + row * H;
          GRADSUM_RETURN_IF_ERROR(Sgemm(Trans::kNo, Trans::kYes, n, H, D, 1.0f, dyj, D, wd, D, 0.0f,
                                        absl::MakeSpan(dg, n * H), H));
          vec::SwiGluBackward(g, u, dg, du, act.data() + row * H, n * H);
          // Without exact gradients, the weight gradients follow here, straight into the
          // gradient spans (as one block).
          if (grads.exact == nullptr) {
            for (int which : kWeightOrder) {
              const absl::Span<float> out = which == 2   ? grads.down.subspan(j * H * D, H * D)
                                            : which == 0 ? grads.gate.subspan(j * D * H, D * H)
                                                         : grads.up.subspan(j * D * H, D * H);
              GRADSUM_RETURN_IF_ERROR(weight_grad(which, row, n, 1.0f, out));
            }
          }
          const auto dxj = dx.subspan(row * D, n * D);
          GRADSUM_RETURN_IF_ERROR(Sgemm(Trans::kNo, Trans::kYes, n, D, H, 1.0f,
                                        absl::MakeConstSpan(dg, n * H), H, wg, H, 0.0f, dxj, D));
          return Sgemm(Trans::kNo, Trans::kYes, n, D, H, 1.0f, absl::MakeConstSpan(du, n * H), H,
                       wu, H, 1.0f, dxj, D);
        }));
    if (grads.exact == nullptr) return absl::OkStatus();
    // Exact: one matrix at a time over every block (its limbs stay in cache), each block's
    // contribution into scratch and then added exactly at its stacked offset.
    const absl::Span<float> c = Scratch(3, D * H);
    for (int which : kWeightOrder) {
      GRADSUM_RETURN_IF_ERROR(ForEachBlock(
          config, j, offsets[j], group_sizes[j], [&](int64_t row, int64_t n) -> absl::Status {
            GRADSUM_RETURN_IF_ERROR(weight_grad(which, row, n, 0.0f, c));
            return grads.exact->Add((which * El + j) * D * H, c);
          }));
    }
    return absl::OkStatus();
  });
}

}  // namespace gradsum::moe
