#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace gradsum::train {
namespace {

int64_t DecayEnd(const OptimConfig& o) { return o.decay_steps() > 0 ? o.decay_steps() : o.steps(); }

}  // namespace

double LearningRate(const OptimConfig& o, int64_t step_index) {
  const int warmup = o.warmup_steps();
  const double done = static_cast<double>(step_index) + 1.0;  // steps taken with this one
  if (o.lr_decay() == OptimConfig::constant || done <= warmup) {
    return o.lr() * (warmup > 0 ? std::min(1.0, done / warmup) : 1.0);
  }
  const double span = static_cast<double>(DecayEnd(o) - warmup);
  const double t = span > 0 ? std::clamp((done - warmup) / span, 0.0, 1.0) : 1.0;
  const double lr = o.lr(), min_lr = o.min_lr();
  if (o.lr_decay() == OptimConfig::cosine) {
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * t));
  }
  return lr - (lr - min_lr) * t;
}

absl::Status CheckLrSchedule(const OptimConfig& o) {
  if (!(std::isfinite(o.min_lr()) && o.min_lr() >= 0 && o.min_lr() <= o.lr())) {
    return absl::InvalidArgumentError(
        absl::StrCat("optim.min_lr=", o.min_lr(), ": must be in [0, optim.lr=", o.lr(), "]"));
  }
  if (o.decay_steps() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optim.decay_steps=", o.decay_steps(), ": must be >= 0 (0: optim.steps)"));
  }
  if (o.lr_decay() != OptimConfig::constant && DecayEnd(o) <= o.warmup_steps()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optim.lr_decay=", OptimConfig::LrDecay_Name(o.lr_decay()), ": its end (optim.",
        o.decay_steps() > 0 ? "decay_steps=" : "steps=", DecayEnd(o),
        ") must be after optim.warmup_steps=", o.warmup_steps()));
  }
  return absl::OkStatus();
}

}  // namespace gradsum::train
