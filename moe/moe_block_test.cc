// The orchestration of moe/moe_block.h against a recording device: the steps of forward,
// re-run and backward in the order the header gives, the activation sets lent and
// borrowed once per layer, and the out-of-order calls refused by name before any step.
#include "moe/moe_block.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Records every step as "<step> <layer>".
class RecordingKernels : public MoeLayerKernels {
 public:
  absl::Status Route(int l, const float*, const MoeBlockWeights&) override {
    return Log("Route", l);
  }
  absl::Status StartCountSum(int l) override { return Log("StartCountSum", l); }
  absl::Status Dispatch(int l, const float*, const MoeBlockWeights&, float*, bool rerun) override {
    return Log(rerun ? "Redispatch" : "Dispatch", l);
  }
  absl::Status CheckGrads(const MoeBlockGrads&) const override { return grads_status; }
  absl::Status RouterLosses(int l) override { return Log("RouterLosses", l); }
  absl::Status DispatchBackward(int l, const float*, const MoeBlockWeights&, const float*, float*,
                                const MoeBlockGrads&) override {
    return Log("DispatchBackward", l);
  }
  absl::Status RouterBackward(int l, const float*, const MoeBlockWeights&, float*,
                              const MoeBlockGrads&) override {
    return Log("RouterBackward", l);
  }
  void LendActivations(int l) override { Log("Lend", l).IgnoreError(); }
  void BorrowActivations(int l) override { Log("Borrow", l).IgnoreError(); }

  std::vector<std::string> TakeSteps() { return std::move(steps); }

  std::vector<std::string> steps;
  absl::Status grads_status;

 private:
  absl::Status Log(const char* step, int l) {
    steps.push_back(absl::StrCat(step, " ", l));
    return absl::OkStatus();
  }
};

TEST(MoeBlockTest, ForwardReRunAndBackwardRunTheirStepsInOrder) {
  RecordingKernels k;
  MoeBlock block(&k, 2);
  const GradTarget none;
  const MoeBlockGrads g{&none, &none};
  block.BeginMicroBatch();
  ASSERT_TRUE(block.Forward(0, nullptr, {}, nullptr).ok());
  EXPECT_THAT(k.TakeSteps(), ElementsAre("Borrow 0", "Route 0", "StartCountSum 0", "Dispatch 0"));
  block.Release(0);
  block.Release(0);  // holds none: nothing to lend
  ASSERT_TRUE(block.Forward(1, nullptr, {}, nullptr).ok());
  EXPECT_THAT(k.TakeSteps(),
              ElementsAre("Lend 0", "Borrow 1", "Route 1", "StartCountSum 1", "Dispatch 1"));
  ASSERT_TRUE(block.Backward(1, nullptr, {}, nullptr, nullptr, g).ok());
  EXPECT_THAT(k.TakeSteps(),
              ElementsAre("RouterLosses 1", "DispatchBackward 1", "RouterBackward 1"));
  ASSERT_TRUE(block.Recompute(0, nullptr, {}, nullptr).ok());
  ASSERT_TRUE(block.Recompute(0, nullptr, {}, nullptr).ok());  // holds one: no borrow
  ASSERT_TRUE(block.Backward(0, nullptr, {}, nullptr, nullptr, g).ok());
  EXPECT_THAT(k.TakeSteps(),
              ElementsAre("Borrow 0", "Redispatch 0", "Redispatch 0", "RouterLosses 0",
                          "DispatchBackward 0", "RouterBackward 0"));
  // The next micro-batch: layer 0 still holds its set.
  block.BeginMicroBatch();
  ASSERT_TRUE(block.Forward(0, nullptr, {}, nullptr).ok());
  EXPECT_THAT(k.TakeSteps(), ElementsAre("Route 0", "StartCountSum 0", "Dispatch 0"));
}

TEST(MoeBlockTest, OutOfOrderCallsAreFailedPreconditionBeforeAnyStep) {
  RecordingKernels k;
  MoeBlock block(&k, 2);
  const GradTarget none;
  const MoeBlockGrads g{&none, &none};
  block.BeginMicroBatch();
  absl::Status s = block.Forward(1, nullptr, {}, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("MoE layer 1 ran forward out of order"));
  s = block.Recompute(0, nullptr, {}, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("MoE layer 0 has no forward to re-run"));
  s = block.Backward(0, nullptr, {}, nullptr, nullptr, g);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("MoE layer 0 has no forward"));
  EXPECT_THAT(k.TakeSteps(), IsEmpty());

  ASSERT_TRUE(block.Forward(0, nullptr, {}, nullptr).ok());
  s = block.Forward(0, nullptr, {}, nullptr);  // twice in one micro-batch
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  block.Release(0);
  k.TakeSteps();
  s = block.Backward(0, nullptr, {}, nullptr, nullptr, g);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("MoE layer 0 released its activations"));
  ASSERT_TRUE(block.Recompute(0, nullptr, {}, nullptr).ok());
  k.grads_status = absl::InvalidArgumentError("bad targets");
  k.TakeSteps();
  s = block.Backward(0, nullptr, {}, nullptr, nullptr, g);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(k.TakeSteps(), IsEmpty());  // refused before the losses
}

}  // namespace
}  // namespace gradsum::moe
