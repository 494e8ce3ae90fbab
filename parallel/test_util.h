#ifndef GRADSUM_PARALLEL_TEST_UTIL_H_
#define GRADSUM_PARALLEL_TEST_UTIL_H_

// Test helpers for sharding: deterministic values and a toy quadratic training loop whose
// gradients are known in closed form, so multi-rank results can be compared with a
// single-process double-precision reference.
//
// Toy loss: L = sum over ranks r, micro-batches m of
//   sum_i 0.5 * a(r, m, i) * (theta_i - c(r, m, i))^2,
// so rank r's micro-batch gradient is a * (theta - c), with a in [0.5, 1) and c in [-1, 1)
// drawn from (parameter name, element, rank, micro-batch, step).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "collectives/communicator.h"
#include "optim/adamw.h"
#include "parallel/flat_param.h"

namespace gradsum::sharding_testing {

// Deterministic value in [-1, 1) from a string and integers.
double Noise(absl::string_view name, uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0);

// Dense parameters of uneven sizes (7, 13, 1, 0 and 3x5 elements): no size is a multiple
// of any world size above 1, so every layout has padding.
std::vector<ParamSpec> DenseSpecs();

// The parameters of EP slot `slot`'s experts ("expert<e>.w1" [3,2], "expert<e>.w2" [5]),
// experts e in [slot * experts_per_slot, (slot + 1) * experts_per_slot).
std::vector<ParamSpec> ExpertSpecs(int slot, int experts_per_slot);

// The same initial value of a parameter on every rank.
std::vector<float> InitValue(absl::string_view param_name, int64_t numel);

// Sets every parameter of `group` to InitValue.
absl::Status InitGroup(FlatParam& group);

// Rank `world_rank`'s gradient of micro-batch `micro` at step `step` for a parameter
// with current values `theta`.
void ToyGrad(absl::string_view param_name, int world_rank, int micro, int64_t step,
             const float* theta, int64_t numel, float* grad_out);

// One optimizer step of the toy loss: G micro-batches of unshard (with prefetch of the
// next group), gradient, reshard, reduce; then optional clipping (max_norm > 0), AdamW,
// ZeroGrad. Collective over `world` and every group's communicator.
absl::Status ToyTrainStep(const std::vector<FlatParam*>& groups, ShardedAdamW& opt,
                          Communicator& world, int micro_batches, double max_norm);

}  // namespace gradsum::sharding_testing

#endif  // GRADSUM_PARALLEL_TEST_UTIL_H_
