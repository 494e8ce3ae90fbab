#include "parallel/unit_grad.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/thread_backend.h"
#include "core/exact_sum.h"
#include "core/half.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

using testing::RunRanks;

UnitGradOptions Options(Communicator* group, ShardingMode mode, int64_t numel) {
  UnitGradOptions o;
  o.name = "u";
  o.group = group;
  o.mode = mode;
  o.numel = numel;
  o.layout = ComputeShardLayout(numel, group->size(), group->rank());
  return o;
}

TEST(GradPrecisionTest, WhatEachImplies) {
  EXPECT_EQ(GradWireDType(GradPrecision::kF32), DType::kF32);
  EXPECT_EQ(GradWireDType(GradPrecision::kBF16Wire), DType::kBF16);
  EXPECT_EQ(GradWireDType(GradPrecision::kExact), DType::kI64);
  EXPECT_FALSE(IsExact(GradPrecision::kF32));
  EXPECT_FALSE(IsExact(GradPrecision::kBF16Wire));
  EXPECT_TRUE(IsExact(GradPrecision::kExact));
  EXPECT_STREQ(GradPrecisionName(GradPrecision::kBF16Wire), "bf16_wire");
  EXPECT_FALSE(IsValidGradPrecision(static_cast<GradPrecision>(7)));
  EXPECT_STREQ(GradPrecisionName(static_cast<GradPrecision>(7)), "invalid");
}

TEST(UnitGradTest, CreateRefusesBadPrecisionAndNullGroup) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  Communicator* c = (*comms)[0].get();
  EXPECT_EQ(UnitGrad::Create(static_cast<GradPrecision>(7), Options(c, ShardingMode::kSharded, 4))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  UnitGradOptions no_group = Options(c, ShardingMode::kSharded, 4);
  no_group.group = nullptr;
  EXPECT_EQ(UnitGrad::Create(GradPrecision::kF32, no_group).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (GradPrecision p : {GradPrecision::kF32, GradPrecision::kBF16Wire, GradPrecision::kExact}) {
    auto g = UnitGrad::Create(p, Options(c, ShardingMode::kReplicated, 4));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ((*g)->precision(), p);
    EXPECT_EQ((*g)->wire_words_per_element(), IsExact(p) ? exact::kLimbs : 1);
    EXPECT_EQ((*g)->carries_rejected_count(), IsExact(p));
    EXPECT_EQ((*g)->local_f32().empty(), IsExact(p));
    EXPECT_EQ((*g)->local_limbs().empty(), !IsExact(p));
  }
}

// The target of each precision: fp32 targets point into the local gradient; exact ones
// add exactly and hand their rejected count to the unit when they go away.
TEST(UnitGradTest, TargetsAddIntoTheLocalGradient) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  Communicator* c = (*comms)[0].get();
  auto f = UnitGrad::Create(GradPrecision::kF32, Options(c, ShardingMode::kReplicated, 6));
  ASSERT_TRUE(f.ok());
  {
    GradTarget t = (*f)->Target(2, 3);
    ASSERT_NE(t.accumulate(), nullptr);
    EXPECT_EQ(t.exact(), nullptr);
    EXPECT_EQ(t.numel(), 3);
    EXPECT_EQ(t.accumulate(), (*f)->local_f32().data() + 2);
  }
  auto e = UnitGrad::Create(GradPrecision::kExact, Options(c, ShardingMode::kReplicated, 6));
  ASSERT_TRUE(e.ok());
  {
    GradTarget t = (*e)->Target(2, 3);
    ASSERT_NE(t.exact(), nullptr);
    EXPECT_EQ(t.accumulate(), nullptr);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    ASSERT_TRUE(t.exact()->Add(1, std::vector<float>{0.25f, nan}).ok());
    EXPECT_EQ(t.exact()->Add(2, std::vector<float>{1.0f, 1.0f}).code(),
              absl::StatusCode::kInvalidArgument);  // runs past the 3 elements
    EXPECT_EQ(t.exact()->Add(-1, std::vector<float>{1.0f}).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*e)->rejected(), 0);  // counted when the target goes away
  }
  EXPECT_EQ((*e)->rejected(), 1);
  absl::Span<const int64_t> limbs = (*e)->local_limbs();
  EXPECT_EQ(exact::ToDouble(limbs.subspan(3 * exact::kLimbs, exact::kLimbs)), 0.25);
  for (int64_t i : {0, 1, 2, 4, 5}) {
    EXPECT_EQ(exact::ToDouble(limbs.subspan(i * exact::kLimbs, exact::kLimbs)), 0.0) << i;
  }
}

// ToWire + FromWire on one rank is the identity through each precision's wire format:
// exact for f32 and limbs, bf16 rounding for bf16 on the wire; NaN everywhere for an
// exact unit with a rejected count.
TEST(UnitGradTest, WireRoundTrip) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  Communicator* c = (*comms)[0].get();
  const std::vector<float> values = {1.0f, -0.3f, 1e-3f, 3.14159f, -2.5e4f};
  const int64_t n = static_cast<int64_t>(values.size());
  for (GradPrecision p : {GradPrecision::kF32, GradPrecision::kBF16Wire, GradPrecision::kExact}) {
    auto g = UnitGrad::Create(p, Options(c, ShardingMode::kReplicated, n));
    ASSERT_TRUE(g.ok());
    UnitGrad& grad = **g;
    {
      GradTarget t = grad.Target(0, n);
      if (t.exact() != nullptr) {
        ASSERT_TRUE(t.exact()->Add(0, values).ok());
      } else {
        for (int64_t i = 0; i < n; ++i) t.accumulate()[i] += values[i];
      }
    }
    std::vector<int64_t> wire(n * grad.wire_words_per_element());  // room for any dtype
    ASSERT_TRUE(grad.ToWire(0, n, wire.data()).ok());
    ASSERT_TRUE(grad.FromWire(0, n, wire.data(), /*global_rejected=*/0).ok());
    for (int64_t i = 0; i < n; ++i) {
      const float want =
          p == GradPrecision::kBF16Wire ? BF16::FromFloat(values[i]).ToFloat() : values[i];
      EXPECT_EQ(grad.master_grad()[i], want) << GradPrecisionName(p) << " " << i;
    }
    if (IsExact(p)) {
      ASSERT_TRUE(grad.FromWire(0, n, wire.data(), /*global_rejected=*/1).ok());
      for (float x : grad.master_grad()) EXPECT_TRUE(std::isnan(x));
      EXPECT_EQ(grad.FoldReduced(std::vector<float>(n), true).code(),
                absl::StatusCode::kUnimplemented);
    }
  }
}

// The own reduction of every precision and mode sums the ranks' gradients: rank r adds
// r + 1 to every element, so the sum over W ranks is W (W + 1) / 2, exact in every format.
TEST(UnitGradTest, ReductionSumsOverTheGroup) {
  for (GradPrecision p : {GradPrecision::kF32, GradPrecision::kBF16Wire, GradPrecision::kExact}) {
    for (ShardingMode mode : {ShardingMode::kSharded, ShardingMode::kReplicated}) {
      for (int world : {1, 3}) {
        absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
          const int64_t numel = 7;
          GRADSUM_ASSIGN_OR_RETURN(auto g, UnitGrad::Create(p, Options(&comm, mode, numel)));
          for (int m = 0; m < 2; ++m) {
            {
              GradTarget t = g->Target(0, numel);
              const std::vector<float> mine(numel, static_cast<float>(comm.rank() + 1));
              if (t.exact() != nullptr) {
                GRADSUM_RETURN_IF_ERROR(t.exact()->Add(0, mine));
              } else {
                for (int64_t i = 0; i < numel; ++i) t.accumulate()[i] += mine[i];
              }
            }
            GRADSUM_RETURN_IF_ERROR(g->StartReduce(/*last_micro_batch=*/m == 1));
            if (g->reduce_in_flight()) GRADSUM_RETURN_IF_ERROR(g->FinishReduce());
          }
          const float want = static_cast<float>(2 * world * (world + 1) / 2);
          for (float x : g->owned_grad()) {
            if (x != want) {
              return absl::InternalError(absl::StrCat(GradPrecisionName(p), " ",
                                                      ShardingModeName(mode), " world ", world,
                                                      ": got ", x, ", want ", want));
            }
          }
          g->Zero();
          for (float x : g->master_grad()) {
            if (x != 0.0f) return absl::InternalError("Zero() left a value");
          }
          return absl::OkStatus();
        });
        EXPECT_TRUE(s.ok()) << s;
      }
    }
  }
}

}  // namespace
}  // namespace gradsum
