#include "moe/moe_block.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum::moe {

MoeBlock::MoeBlock(MoeLayerKernels* kernels, int num_layers)
    : kernels_(kernels), held_(num_layers, false) {}

void MoeBlock::Hold(int l) {
  if (held_[l]) return;
  kernels_->BorrowActivations(l);
  held_[l] = true;
}

absl::Status MoeBlock::Forward(int l, const float* a, const MoeBlockWeights& w, float* y) {
  if (l != forwarded_ || l >= static_cast<int>(held_.size())) {
    return absl::FailedPreconditionError(
        absl::StrCat("MoE layer ", l, " ran forward out of order"));
  }
  Hold(l);
  GRADSUM_RETURN_IF_ERROR(kernels_->Route(l, a, w));
  // The counts travel while the layer dispatches and the next layers compute.
  GRADSUM_RETURN_IF_ERROR(kernels_->StartCountSum(l));
  ++forwarded_;
  return kernels_->Dispatch(l, a, w, y, /*rerun=*/false);
}

absl::Status MoeBlock::Recompute(int l, const float* a, const MoeBlockWeights& w, float* y) {
  if (l < 0 || l >= forwarded_) {
    return absl::FailedPreconditionError(
        absl::StrCat("MoE layer ", l, " has no forward to re-run"));
  }
  Hold(l);
  return kernels_->Dispatch(l, a, w, y, /*rerun=*/true);
}

// The layer's set goes to the spare pool, where the next layer to run takes it: under full
// recomputation one set of dispatch and expert buffers serves every layer.
void MoeBlock::Release(int l) {
  if (l < 0 || l >= static_cast<int>(held_.size()) || !held_[l]) return;
  kernels_->LendActivations(l);
  held_[l] = false;
}

absl::Status MoeBlock::Backward(int l, const float* a, const MoeBlockWeights& w, const float* dy,
                                float* da, const MoeBlockGrads& g) {
  if (l < 0 || l >= forwarded_) {
    return absl::FailedPreconditionError(absl::StrCat("MoE layer ", l, " has no forward"));
  }
  if (!held_[l]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MoE layer ", l, " released its activations; re-run its forward before backward"));
  }
  GRADSUM_RETURN_IF_ERROR(kernels_->CheckGrads(g));
  GRADSUM_RETURN_IF_ERROR(kernels_->RouterLosses(l));
  GRADSUM_RETURN_IF_ERROR(kernels_->DispatchBackward(l, a, w, dy, da, g));
  return kernels_->RouterBackward(l, a, w, da, g);
}

}  // namespace gradsum::moe
