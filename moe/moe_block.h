#ifndef GRADSUM_MOE_MOE_BLOCK_H_
#define GRADSUM_MOE_MOE_BLOCK_H_

// The MoE layers of one rank (SEMANTICS.md §10 without the residual and the norm), assembled
// once for every device: MoeBlock orders the steps of a layer and keeps its bookkeeping;
// a device implements the steps' compute (MoeLayerKernels: moe/moe_layer.h on the host,
// moe/cuda/moe_layer_cuda.h on a GPU).
//
// Forward of layer l:   Route (router GEMM, scores, top-K, this rank's expert counts)
//                    -> StartCountSum (c[l, m, :] of §5: the SUM over the world, in flight)
//                    -> Dispatch (copies sorted by expert, the EP exchange, the grouped
//                       SwiGLU experts, the exchange back, the weighted combine into y).
// Backward of layer l: RouterLosses (the z-loss §4 and balancing loss §5 on the summed
//                       counts: their values and their router-logit gradients)
//                    -> DispatchBackward (combine, exchange, experts and exchange backward:
//                       da written, the experts' weight gradients, d combine weight)
//                    -> RouterBackward (the top-K's and the losses' logit gradient through
//                       the router GEMM: its weight gradient, da +=).
// Full activation recomputation (model/moe_lm.h Recompute::kFull): Release lends a layer's
// dispatch and expert activations to the next layer that runs; Recompute re-runs Dispatch
// from the kept routing (no Route, no count SUM), bit-identical to the first forward.
//
//   MoeBlock block(&kernels, L);
//   block.BeginMicroBatch();  // with the kernels' own micro-batch setup
//   GRADSUM_RETURN_IF_ERROR(block.Forward(l, a, w, y));
//   ...
//   GRADSUM_RETURN_IF_ERROR(block.Backward(l, a, w, dy, da, {&d_router, &d_experts}));

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/grad_sink.h"
#include "moe/router.h"

namespace gradsum::moe {

// A layer's shape and routing, the same for every device.
struct MoeLayerConfig {
  int64_t d_model = 0;  // D
  int64_t hidden = 0;   // H
  int num_experts = 0;  // E, E % P == 0
  int top_k = 0;        // K
  bool norm_topk_prob = false;
  float router_scale = 1.0f;
  RouterScore score = RouterScore::kSoftmax;  // softmax or sigmoid scores (§10, §5.1)
  // Reproducible mode (docs/REPRODUCIBILITY.md; the CPU only): when > 0, the tokens are
  // consecutive blocks of row_block rows (moe_lm: packed sequences), the same number on
  // every EP rank. The router computes per block (RouterConfig::row_block), and every
  // expert computes per (block, expert) row group, whichever rank the block came from:
  // Route learns the groups from one extra all-gather of per-(expert, block) counts over
  // the EP group.
  int64_t row_block = 0;

  RouterConfig router() const {
    return RouterConfig{.d_model = d_model,
                        .num_experts = num_experts,
                        .top_k = top_k,
                        .norm_topk_prob = norm_topk_prob,
                        .router_scale = router_scale,
                        .score = score,
                        .row_block = row_block};
  }
};

// The router losses' weights (SEMANTICS.md §4, §5).
struct MoeLossWeights {
  double alpha_z = 0.0, alpha_b = 0.0;
};

// A layer's weights as the device's compute reads them: the router [D, E] (the same on every
// rank) and this rank's E / P experts stacked per matrix: all Wg [E / P, D, H], then all Wu,
// then all Wd [E / P, H, D] (moe/experts.h). expert_bias: [E], HOST memory (SEMANTICS.md
// §5.1: added to the scores for the top-K selection only), or null.
struct MoeBlockWeights {
  const float* router = nullptr;
  const float* local_experts = nullptr;
  const float* expert_bias = nullptr;
};

// Where a layer's weight gradients go (not owned): the router's [D, E], the experts' in the
// stacked layout above.
struct MoeBlockGrads {
  const GradTarget* router = nullptr;
  const GradTarget* local_experts = nullptr;
};

// One device's compute of the steps above, for the rank's layers (indexed by l): the
// layer's routing, plan and activations stay in the implementation between the calls.
// Pointers are the device's memory unless a comment says host. Each call may assume that
// MoeBlock ordered it as the header says.
class MoeLayerKernels {
 public:
  virtual ~MoeLayerKernels() = default;

  // Router logits a Wr, scores, top-K selection and combine weights, this rank's expert
  // counts and gating sums. a [T, D]. May exchange over the EP group (reproducible mode's
  // row blocks).
  virtual absl::Status Route(int l, const float* a, const MoeBlockWeights& w) = 0;
  // Starts the SUM of Route's expert counts over the world. Collective over the world.
  virtual absl::Status StartCountSum(int l) = 0;
  // y [T, D] = sum_k w_tk Expert_{i_tk}(a_t) (0 for padding). `rerun`: the same routing as
  // the layer's last Dispatch, whose exchanged sizes are kept (FailedPrecondition when
  // they are not this input's). Collective over the EP group.
  virtual absl::Status Dispatch(int l, const float* a, const MoeBlockWeights& w, float* y,
                                bool rerun) = 0;
  // Checked before any backward step: targets the device can add into.
  virtual absl::Status CheckGrads(const MoeBlockGrads& g) const = 0;
  // Waits for the count SUM; the router z-loss and balancing loss: their values into the
  // micro-batch's loss terms, their router-logit gradient kept for RouterBackward.
  virtual absl::Status RouterLosses(int l) = 0;
  // dy [T, D]: da [T, D] written, the experts' weight gradients added, the combine
  // weights' gradient kept for RouterBackward. Collective over the EP group.
  virtual absl::Status DispatchBackward(int l, const float* a, const MoeBlockWeights& w,
                                        const float* dy, float* da, const MoeBlockGrads& g) = 0;
  // The router's backward from the kept combine-weight and logit gradients: the router's
  // weight gradient added, da += (through the router GEMM).
  virtual absl::Status RouterBackward(int l, const float* a, const MoeBlockWeights& w, float* da,
                                      const MoeBlockGrads& g) = 0;
  // Full recomputation: layer l's dispatch and expert activations go to a pool of spare
  // sets (Lend), or it takes one from the pool if there is one (Borrow; else its next
  // Dispatch allocates).
  virtual void LendActivations(int l) = 0;
  virtual void BorrowActivations(int l) = 0;
};

class MoeBlock {
 public:
  // `kernels` (not owned) outlives the block; `num_layers` layers, 0 .. num_layers - 1.
  MoeBlock(MoeLayerKernels* kernels, int num_layers);

  // A new micro-batch: every layer forgets its forward (their activation sets stay).
  void BeginMicroBatch() { forwarded_ = 0; }

  // Layers run forward in order 0, 1, ... once per micro-batch; FailedPrecondition
  // otherwise. Collective over the EP group and the world.
  absl::Status Forward(int l, const float* a, const MoeBlockWeights& w, float* y);
  // FailedPrecondition before the layer's Forward. Collective over the EP group.
  absl::Status Recompute(int l, const float* a, const MoeBlockWeights& w, float* y);
  // The layer's activations are not needed before its next Recompute (or forward).
  void Release(int l);
  // FailedPrecondition before the layer's Forward or after its Release without a
  // Recompute. Collective over the EP group.
  absl::Status Backward(int l, const float* a, const MoeBlockWeights& w, const float* dy, float* da,
                        const MoeBlockGrads& g);

 private:
  // Gives layer l an activation set if it holds none.
  void Hold(int l);

  MoeLayerKernels* kernels_;
  int forwarded_ = 0;       // layers that ran forward in this micro-batch
  std::vector<bool> held_;  // per layer: it holds an activation set
};

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_MOE_BLOCK_H_
