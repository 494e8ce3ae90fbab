#ifndef GRADSUM_OPTIM_LR_SCHEDULE_H_
#define GRADSUM_OPTIM_LR_SCHEDULE_H_

// The learning rate of each optimizer step: a function of the schedule and the step alone,
// so a resumed run, on any mesh, continues the schedule. It sits with AdamW and the
// gradient norm (what an optimizer step reads); train/config.h ToLrSchedule fills it from
// the config's optim section, and the config's validation names the flags.
//
// Step s = 0, 1, ... (the s + 1-th optimizer step), W = warmup_steps, E = decay_end,
// t = (s + 1 - W) / (E - W) clamped to [0, 1]:
//   s + 1 <= W:  lr * (s + 1) / W                       (linear warmup; none when W = 0)
//   after:       kConstant  lr
//                kCosine    min_lr + (lr - min_lr) * (1 + cos(pi t)) / 2
//                kLinear    lr - (lr - min_lr) * t
// so the last warmup step runs at lr and step E - 1 (the E-th) at min_lr. The constant
// schedule is lr * min(1, (s + 1) / W), the expression the trainer has always used.
//
//   const double lr = optim::LearningRate(schedule, step_index);

#include <cstdint>

namespace gradsum::optim {

enum class LrDecay { kConstant, kCosine, kLinear };

struct LrSchedule {
  LrDecay decay = LrDecay::kConstant;
  double lr = 0;
  double min_lr = 0;         // the decay's end value (unused by kConstant)
  int64_t warmup_steps = 0;  // W >= 0
  int64_t decay_end = 0;     // E: the step count at which the decay reaches min_lr
};

// Defined for any schedule; a decay whose end is not after the warmup jumps to min_lr
// after it (the config's validation refuses that case by name).
double LearningRate(const LrSchedule& schedule, int64_t step_index);

}  // namespace gradsum::optim

#endif  // GRADSUM_OPTIM_LR_SCHEDULE_H_
