#ifndef GRADSUM_MODEL_MOE_BLOCK_OPS_H_
#define GRADSUM_MODEL_MOE_BLOCK_OPS_H_

// The model's MoE calls (model/ops.h MoeForward, MoeRecomputeForward, ReleaseMoeActivations,
// MoeBackward), written once for every device over the shared orchestration of
// moe/moe_block.h: a device's ops derive from MoeBlockOps and hand it their kernels
// (moe::MoeLayersCpu, moe::MoeLayersCuda), which are all that differs between devices.

#include <optional>

#include "absl/status/status.h"
#include "model/moe_lm_spec.h"
#include "model/ops.h"
#include "moe/moe_block.h"

namespace gradsum::model {

// The MoE layers' config of the model `m` (the same on every device).
inline moe::MoeLayerConfig MoeLayerConfigOf(const MoeLmConfig& m) {
  moe::MoeLayerConfig c;
  SetMoeLayerShape(m, &c);
  c.score = m.router_sigmoid ? moe::RouterScore::kSigmoid : moe::RouterScore::kSoftmax;
  return c;
}

class MoeBlockOps : public ModelOps {
 public:
  absl::Status MoeForward(int l, const float* a, const MoeWeights& w, float* y) override {
    return moe_block().Forward(l, a, Weights(w), y);
  }
  bool CanRecomputeMoe() const override { return true; }
  absl::Status MoeRecomputeForward(int l, const float* a, const MoeWeights& w, float* y) override {
    return moe_block().Recompute(l, a, Weights(w), y);
  }
  void ReleaseMoeActivations(int l) override { moe_block().Release(l); }
  absl::Status MoeBackward(int l, const float* a, const MoeWeights& w, const float* dy, float* da,
                           MoeGrads g) override {
    return moe_block().Backward(l, a, Weights(w), dy, da, {&g.router, &g.local_experts});
  }

 protected:
  // The spec's MoE layers (MoeLmSpec::moe_layers: the main ones, then the extra blocks')
  // run on `kernels` (not owned; the derived ops' member, so it outlives the block).
  void InitMoeBlock(moe::MoeLayerKernels* kernels, const MoeLmSpec& spec) {
    block_.emplace(kernels, spec.moe_layers());
  }
  moe::MoeBlock& moe_block() { return *block_; }

 private:
  static moe::MoeBlockWeights Weights(const MoeWeights& w) {
    return {w.router, w.local_experts, w.expert_bias};
  }

  std::optional<moe::MoeBlock> block_;
};

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_MOE_BLOCK_OPS_H_
