#ifndef GRADSUM_TRAIN_TEST_UTIL_H_
#define GRADSUM_TRAIN_TEST_UTIL_H_

// Test helpers for train/: a tiny valid config and an in-process multi-rank run of the
// Trainer on the thread backend that returns what every rank saw.

#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "train/config.pb.h"
#include "train/metrics.pb.h"
#include "train/parity.h"
#include "train/trainer.h"

namespace gradsum::train {

// V=256 (byte data), D=8, L=2, E=4, K=2, H=8; sequences of 16, 2 per micro-batch;
// documents of 2..12 tokens; alpha_b = alpha_z = 0.01 so the aux gradients matter.
TrainConfig TinyConfig(int world, int ep, int grad_acc, TrainConfig::Sharding sharding);

struct RankOutcome {
  std::vector<StepMetrics> history;
  std::optional<NamedParams> first_step_grads;
  std::optional<ParityReport> parity;
  absl::Status status;
};

// Runs `config` on parallelism.world thread ranks (RunRank's mesh and Trainer) and returns
// each rank's outcome. InvalidArgument if the thread communicators cannot be made.
absl::StatusOr<std::vector<RankOutcome>> RunInProcess(const TrainConfig& config);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_TEST_UTIL_H_
