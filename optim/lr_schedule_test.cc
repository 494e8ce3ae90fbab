// The learning-rate schedule (optim/lr_schedule.h) against its closed forms, written here
// again from the definitions: warmup, then constant, half-cosine or linear decay to min_lr.
#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "gtest/gtest.h"

namespace gradsum::optim {
namespace {

LrSchedule Schedule(LrDecay decay, double lr, double min_lr, int warmup, int decay_end) {
  LrSchedule s;
  s.decay = decay;
  s.lr = lr;
  s.min_lr = min_lr;
  s.warmup_steps = warmup;
  s.decay_end = decay_end;
  return s;
}

// The trainer's expression before the schedule existed: the default stays those bits.
TEST(LrScheduleTest, ConstantIsTheWarmupExpressionBitForBit) {
  for (int warmup : {0, 1, 10}) {
    const LrSchedule o = Schedule(LrDecay::kConstant, 0.01, 0.0, warmup, 500);
    for (int s = 0; s < 40; ++s) {
      const double want = 0.01 * (warmup > 0 ? std::min(1.0, (s + 1.0) / warmup) : 1.0);
      EXPECT_EQ(LearningRate(o, s), want) << "warmup " << warmup << " step " << s;
    }
  }
  EXPECT_EQ(LrSchedule().decay, LrDecay::kConstant);
}

TEST(LrScheduleTest, CosineAndLinearFollowTheirFormulas) {
  const double lr = 3e-3, min_lr = 3e-4;
  const int warmup = 4, steps = 20;
  for (LrDecay decay : {LrDecay::kCosine, LrDecay::kLinear}) {
    const LrSchedule o = Schedule(decay, lr, min_lr, warmup, steps);
    for (int s = 0; s < steps + 5; ++s) {
      const double done = s + 1.0;
      double want;
      if (done <= warmup) {
        want = lr * done / warmup;
      } else {
        const double t = std::min(1.0, (done - warmup) / (steps - warmup));
        want = decay == LrDecay::kCosine
                   ? min_lr + (lr - min_lr) * (1 + std::cos(3.14159265358979323846 * t)) / 2
                   : lr + (min_lr - lr) * t;
      }
      EXPECT_NEAR(LearningRate(o, s), want, 1e-15) << static_cast<int>(decay) << " " << s;
    }
    // The ends: the last warmup step at lr, the last step (and after) at min_lr, and the
    // middle of the decay half way for both shapes.
    EXPECT_EQ(LearningRate(o, warmup - 1), lr);
    EXPECT_NEAR(LearningRate(o, steps - 1), min_lr, 1e-18);
    EXPECT_NEAR(LearningRate(o, steps + 100), min_lr, 1e-18);
    EXPECT_NEAR(LearningRate(o, warmup + (steps - warmup) / 2 - 1), (lr + min_lr) / 2, 1e-15);
    // Monotone after the warmup.
    for (int s = warmup; s < steps; ++s) EXPECT_LE(LearningRate(o, s), LearningRate(o, s - 1));
  }
}

TEST(LrScheduleTest, TheDecayEndsAtItsEndNotAtTheRunLength) {
  const LrSchedule o = Schedule(LrDecay::kLinear, 1.0, 0.0, 0, /*decay_end=*/10);
  EXPECT_DOUBLE_EQ(LearningRate(o, 0), 0.9);
  EXPECT_DOUBLE_EQ(LearningRate(o, 4), 0.5);
  EXPECT_EQ(LearningRate(o, 9), 0.0);
  EXPECT_EQ(LearningRate(o, 50), 0.0);
}

}  // namespace
}  // namespace gradsum::optim
