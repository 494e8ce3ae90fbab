#ifndef GRADSUM_PARALLEL_EXACT_GRAD_TESTING_H_
#define GRADSUM_PARALLEL_EXACT_GRAD_TESTING_H_

// Shared by the exact-gradient tests on the thread and MPI backends (SEMANTICS.md §11):
// synthetic per-sequence contributions to two FlatParam groups, one rank's step in exact
// mode, and an independent reference (testing/exact_sum_reference.h: __int128 sums of each
// contribution rounded to the LSB, the norm from the exact sum of the rounded squares).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "collectives/communicator.h"
#include "parallel/flat_param.h"

namespace gradsum::exact_grad_testing {

inline constexpr int kSequences = 24;

// Group 0: sharding_testing::DenseSpecs() (uneven sizes); group 1: {"w" [4, 6], "b" [5]}.
std::vector<std::vector<ParamSpec>> GroupSpecs();

// Sequence j's contribution to parameter (group, param): values for elements
// [offset, offset + values.size()) (some sequences touch only part of a parameter).
struct Contribution {
  int64_t offset = 0;
  std::vector<float> values;
};
Contribution MakeContribution(int group, int param, int j, int64_t numel);

struct Result {
  std::vector<std::vector<float>> grads;  // per group, numel elements
  double norm = 0;
};
// The reduced gradients and the global norm, from the contributions alone.
Result Reference();

struct Config {
  int world;  // for names and thread runs; a rank step uses its communicator's size
  int micro_batches;
  ShardingMode mode;
  bool reduce_every_micro_batch;
  bool bucketed;  // replicated only: through BucketedGradReducer
  std::string Name() const;
};

// One rank's training step in exact mode: sequence j goes to slot (j + shift) % (W * G),
// micro-batch slot / W, rank slot % W; even sequences are added with AddExactGrad, odd ones
// through exact_grad() and exact::AddFloats. nan_rank (if >= 0) makes one contribution of
// group 0 NaN. Then the norm (ClipGradNorm when max_norm > 0). Writes the rank's owned
// gradient slices into (*grads)[g] at their flat offsets (sized like Reference().grads)
// and the norm into *norm. Collective over `comm`.
absl::Status RankStep(Communicator& comm, const Config& cfg, int shift, int nan_rank,
                      double max_norm, std::vector<std::vector<float>>* grads, double* norm);

}  // namespace gradsum::exact_grad_testing

#endif  // GRADSUM_PARALLEL_EXACT_GRAD_TESTING_H_
