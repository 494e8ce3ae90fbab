#ifndef GRADSUM_MOE_EXPERTS_H_
#define GRADSUM_MOE_EXPERTS_H_

// Grouped SwiGLU experts (SEMANTICS.md §10): the local experts of one EP rank, each applied
// to its own contiguous group of rows.
//
//   Expert_j(x) = (SiLU(x Wg_j) * (x Wu_j)) Wd_j      Wg_j, Wu_j: [D, H], Wd_j: [H, D]
//
// Rows arrive grouped by local expert: the first group_sizes[0] rows go to local expert 0,
// the next group_sizes[1] to local expert 1, and so on (a group may be empty). The weights of
// the local experts are stacked, expert j's matrix starting at j * D * H.
//
//   ExpertsConfig config{.d_model = D, .hidden = H, .num_local_experts = 2};
//   ExpertWeights w{.gate = wg, .up = wu, .down = wd};
//   ExpertsSaved saved;
//   GRADSUM_RETURN_IF_ERROR(ExpertsForward(config, w, x, group_sizes, y, &saved));
//   ExpertWeightGrads g{.gate = dwg, .up = dwu, .down = dwd};   // accumulated (+=)
//   GRADSUM_RETURN_IF_ERROR(ExpertsBackward(config, w, x, group_sizes, saved, dy, dx, g));
//
// Every product is one single-threaded fp32 BLAS GEMM per expert (per row block of an expert
// with ExpertsConfig::row_blocks; core/gemm.h); the local
// experts are spread over the calling thread's compute budget (ComputeThreads(),
// core/thread_pool.h), one expert per task, so results do not depend on the thread count.
// Weight gradients accumulate in fp32 so that micro-batches sum (SEMANTICS.md §2).
// The [N, H] temporaries live in scratch buffers of the calling thread that are kept for the
// next call (at most 3 * N * H floats per thread, the largest N seen).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/grad_sink.h"

namespace gradsum::moe {

struct ExpertsConfig {
  int64_t d_model = 0;        // D >= 1
  int64_t hidden = 0;         // H >= 1
  int num_local_experts = 0;  // E / P >= 1
  // Reproducible mode (docs/REPRODUCIBILITY.md): when set, [E_local] lists; expert j's
  // rows are the consecutive blocks (*row_blocks)[j] (sizes >= 0 that sum to its group
  // size whenever that is not 0). Every product then runs per block, so a row's output
  // does not depend on the rows of other blocks, and the weight gradients are summed per
  // block (ExpertWeightGrads::exact). Not owned.
  const std::vector<std::vector<int64_t>>* row_blocks = nullptr;
};

// InvalidArgument naming the field unless D, H and the local expert count are >= 1.
absl::Status ValidateExpertsConfig(const ExpertsConfig& config);

// Stacked weights of the local experts (row-major).
struct ExpertWeights {
  absl::Span<const float> gate;  // [E_local, D, H]  Wg
  absl::Span<const float> up;    // [E_local, D, H]  Wu
  absl::Span<const float> down;  // [E_local, H, D]  Wd
};

// Their gradients, same shapes. Accumulated (+=), never overwritten.
struct ExpertWeightGrads {
  absl::Span<float> gate;
  absl::Span<float> up;
  absl::Span<float> down;
  // Reproducible mode: when set, the spans above are not used (they may be empty) and each
  // row block's contribution (computed alone, into fp32 scratch) is added exactly here, at
  // the offsets of the stacking "all Wg, then all Wu, then all Wd": expert j's Wg at
  // j * D * H, its Wu at (E_local + j) * D * H, its Wd at (2 * E_local + j) * D * H.
  ExactGradSink* exact = nullptr;
};

// InvalidArgument (naming the matrix and both sizes) unless the config is valid and each
// stacked matrix has E_local * D * H elements. Lets callers that exchange rows first
// (moe/dispatch.h) reject bad weights before any collective.
absl::Status CheckExpertWeights(const ExpertsConfig& config, const ExpertWeights& weights);
absl::Status CheckExpertWeightGrads(const ExpertsConfig& config, const ExpertWeightGrads& grads);

// Activations that forward keeps for backward.
struct ExpertsSaved {
  std::vector<float> gate_pre;  // [N, H] x Wg (before SiLU)
  std::vector<float> up_pre;    // [N, H] x Wu
};

// y = Expert_j(x) row by row for rows of group j. `x`, `y`: [N, D] with
// N = sum(group_sizes); `group_sizes`: [E_local], each >= 0. `y` is overwritten.
// `saved` may be null when no backward follows.
// Errors: InvalidArgument for a bad config, a negative group size, or any span of the
// wrong size (the message names it and both sizes).
absl::Status ExpertsForward(const ExpertsConfig& config, const ExpertWeights& weights,
                            absl::Span<const float> x, absl::Span<const int64_t> group_sizes,
                            absl::Span<float> y, ExpertsSaved* saved);

// Given dy = dL/dy ([N, D]), overwrites dx = dL/dx ([N, D]) and adds the weight gradients
// into `grads`. `x`, `group_sizes`, `saved` must be those of the matching forward.
// Errors: as ExpertsForward, plus `saved` of the wrong size.
absl::Status ExpertsBackward(const ExpertsConfig& config, const ExpertWeights& weights,
                             absl::Span<const float> x, absl::Span<const int64_t> group_sizes,
                             const ExpertsSaved& saved, absl::Span<const float> dy,
                             absl::Span<float> dx, const ExpertWeightGrads& grads);

// FLOPs of one forward over N rows: 3 GEMMs of 2*N*D*H each (the elementwise SwiGLU is not
// counted). Backward is twice this. For benchmarks.
inline double ExpertsForwardFlops(int64_t num_rows, int64_t d_model, int64_t hidden) {
  return 6.0 * static_cast<double>(num_rows) * static_cast<double>(d_model) *
         static_cast<double>(hidden);
}

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_EXPERTS_H_
