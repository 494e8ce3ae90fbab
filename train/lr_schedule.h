#ifndef GRADSUM_TRAIN_LR_SCHEDULE_H_
#define GRADSUM_TRAIN_LR_SCHEDULE_H_

// The learning rate of each optimizer step (train/config.proto OptimConfig), a function of
// the config and the step alone, so a resumed run, on any mesh, continues the schedule.
//
// Step s = 0, 1, ... (the s + 1-th optimizer step), W = warmup_steps, E = decay_steps (0:
// steps), t = (s + 1 - W) / (E - W) clamped to [0, 1]:
//   s + 1 <= W:  lr * (s + 1) / W                       (linear warmup; none when W = 0)
//   after:       constant  lr
//                cosine    min_lr + (lr - min_lr) * (1 + cos(pi t)) / 2
//                linear    lr - (lr - min_lr) * t
// so the last warmup step runs at lr and step E - 1 (the E-th) at min_lr. The constant
// schedule is lr * min(1, (s + 1) / W), the expression the trainer has always used.
//
//   const double lr = LearningRate(config.optim(), step_index);

#include <cstdint>

#include "absl/status/status.h"
#include "train/config.pb.h"

namespace gradsum::train {

double LearningRate(const OptimConfig& optim, int64_t step_index);

// InvalidArgument naming the value: min_lr not in [0, lr]; decay_steps < 0; a decay
// (cosine, linear) whose end (decay_steps, or steps) is not after warmup_steps.
absl::Status CheckLrSchedule(const OptimConfig& optim);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_LR_SCHEDULE_H_
