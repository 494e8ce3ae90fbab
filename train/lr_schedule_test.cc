// The learning-rate schedule (train/lr_schedule.h) against its closed forms, written here
// again from the definitions: warmup, then constant, half-cosine or linear decay to min_lr.
#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "gtest/gtest.h"

namespace gradsum::train {
namespace {

OptimConfig Optim(OptimConfig::LrDecay decay, double lr, double min_lr, int warmup, int steps,
                  int decay_steps = 0) {
  OptimConfig o;
  o.set_lr_decay(decay);
  o.set_lr(lr);
  o.set_min_lr(min_lr);
  o.set_warmup_steps(warmup);
  o.set_steps(steps);
  o.set_decay_steps(decay_steps);
  return o;
}

// The trainer's expression before the schedule existed: the default stays those bits.
TEST(LrScheduleTest, ConstantIsTheWarmupExpressionBitForBit) {
  for (int warmup : {0, 1, 10}) {
    const OptimConfig o = Optim(OptimConfig::constant, 0.01, 0.0, warmup, 500);
    for (int s = 0; s < 40; ++s) {
      const double want = 0.01 * (warmup > 0 ? std::min(1.0, (s + 1.0) / warmup) : 1.0);
      EXPECT_EQ(LearningRate(o, s), want) << "warmup " << warmup << " step " << s;
    }
  }
  EXPECT_EQ(OptimConfig().lr_decay(), OptimConfig::constant);
}

TEST(LrScheduleTest, CosineAndLinearFollowTheirFormulas) {
  const double lr = 3e-3, min_lr = 3e-4;
  const int warmup = 4, steps = 20;
  for (auto decay : {OptimConfig::cosine, OptimConfig::linear}) {
    const OptimConfig o = Optim(decay, lr, min_lr, warmup, steps);
    for (int s = 0; s < steps + 5; ++s) {
      const double done = s + 1.0;
      double want;
      if (done <= warmup) {
        want = lr * done / warmup;
      } else {
        const double t = std::min(1.0, (done - warmup) / (steps - warmup));
        want = decay == OptimConfig::cosine
                   ? min_lr + (lr - min_lr) * (1 + std::cos(3.14159265358979323846 * t)) / 2
                   : lr + (min_lr - lr) * t;
      }
      EXPECT_NEAR(LearningRate(o, s), want, 1e-15) << OptimConfig::LrDecay_Name(decay) << s;
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

TEST(LrScheduleTest, DecayStepsSetsTheEndNotTheRunLength) {
  const OptimConfig o = Optim(OptimConfig::linear, 1.0, 0.0, 0, 100, /*decay_steps=*/10);
  EXPECT_DOUBLE_EQ(LearningRate(o, 0), 0.9);
  EXPECT_DOUBLE_EQ(LearningRate(o, 4), 0.5);
  EXPECT_EQ(LearningRate(o, 9), 0.0);
  EXPECT_EQ(LearningRate(o, 50), 0.0);
}

TEST(LrScheduleTest, BadSchedulesAreNamed) {
  struct Bad {
    OptimConfig o;
    std::string message;
  };
  for (const Bad& b :
       {Bad{Optim(OptimConfig::cosine, 0.01, 0.02, 10, 100), "optim.min_lr=0.02"},
        Bad{Optim(OptimConfig::cosine, 0.01, -1, 10, 100), "optim.min_lr=-1"},
        Bad{Optim(OptimConfig::cosine, 0.01, NAN, 10, 100), "optim.min_lr=nan"},
        Bad{Optim(OptimConfig::linear, 0.01, 0, 10, 100, -3), "optim.decay_steps=-3"},
        Bad{Optim(OptimConfig::linear, 0.01, 0, 10, 10),
            "optim.lr_decay=linear: its end (optim.steps=10) must be after "
            "optim.warmup_steps=10"},
        Bad{Optim(OptimConfig::cosine, 0.01, 0, 10, 100, 5),
            "optim.lr_decay=cosine: its end (optim.decay_steps=5)"}}) {
    const absl::Status s = CheckLrSchedule(b.o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.message;
    EXPECT_NE(s.message().find(b.message), std::string::npos) << s;
  }
  EXPECT_TRUE(CheckLrSchedule(Optim(OptimConfig::constant, 0.01, 0, 10, 10)).ok());
  EXPECT_TRUE(CheckLrSchedule(Optim(OptimConfig::cosine, 0.01, 0.01, 0, 1)).ok());
}

}  // namespace
}  // namespace gradsum::train
