#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace gradsum::optim {

double LearningRate(const LrSchedule& s, int64_t step_index) {
  const int64_t warmup = s.warmup_steps;
  const double done = static_cast<double>(step_index) + 1.0;  // steps taken with this one
  if (s.decay == LrDecay::kConstant || done <= warmup) {
    return s.lr * (warmup > 0 ? std::min(1.0, done / warmup) : 1.0);
  }
  const double span = static_cast<double>(s.decay_end - warmup);
  const double t = span > 0 ? std::clamp((done - warmup) / span, 0.0, 1.0) : 1.0;
  if (s.decay == LrDecay::kCosine) {
    return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1.0 + std::cos(M_PI * t));
  }
  return s.lr - (s.lr - s.min_lr) * t;
}

}  // namespace gradsum::optim
