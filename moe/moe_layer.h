#ifndef GRADSUM_MOE_MOE_LAYER_H_
#define GRADSUM_MOE_MOE_LAYER_H_

// The host's compute of the MoE layers' steps (moe/moe_block.h orders them): the router
// (moe/router.h), the dropless dispatch with its pipelined EP exchange and the grouped
// SwiGLU experts (moe/dispatch.h, moe/experts.h), the router z-loss and balancing loss
// (losses/router_losses.h) and the world SUM of the expert counts (losses/step_stats.h).
// Every pointer is host memory.
//
//   MoeLayersCpu kernels(ep_group, world, config, {.alpha_z = az, .alpha_b = ab}, L);
//   MoeBlock block(&kernels, L);
//   kernels.BeginMicroBatch({.rows = T, .mask = mask, .global_routed_tokens = N});
//   block.BeginMicroBatch();
//   ... block.Forward / Recompute / Release / Backward ...
//   MoeLossTerms terms = kernels.TakeLossTerms();
//
// Gradient reduction afterwards (SEMANTICS.md §7): the router's over the world, the
// experts' over this rank's EDP group (moe/placement.h).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "losses/step_stats.h"
#include "moe/dispatch.h"
#include "moe/experts.h"
#include "moe/moe_block.h"
#include "moe/router.h"

namespace gradsum::moe {

// One micro-batch as the layers see it (host memory, valid until the next one).
struct MoeMicroBatchCpu {
  int64_t rows = 0;                  // T
  int64_t row_block = 0;             // MoeLayerConfig::row_block; > 0 divides rows
  absl::Span<const int32_t> mask;    // [T] 1 routed, 0 padding; empty: every token routed
  int64_t global_routed_tokens = 0;  // N (§4)
  int num_micro_batches = 1;         // G (§5)
};

// What the micro-batch's RouterLosses steps computed, in the order they ran.
struct MoeLossTerms {
  double z = 0.0, bal = 0.0;  // L_z[r, m], L_bal[r, m]: sums over the layers
  // With row blocks, one value per (layer, row block); empty otherwise.
  std::vector<double> z_terms, bal_terms;
  // Per layer, c[l, m, :] of §5 (every rank's SUM); empty for a layer without backward.
  std::vector<std::vector<int64_t>> global_expert_counts;
};

class MoeLayersCpu : public MoeLayerKernels {
 public:
  // The communicators (not owned) outlive the kernels. E % ep_group.size() == 0.
  MoeLayersCpu(Communicator& ep_group, Communicator& world, const MoeLayerConfig& config,
               const MoeLossWeights& losses, int num_layers);

  // Starts a micro-batch (the mask is copied; counts still in flight are dropped).
  void BeginMicroBatch(const MoeMicroBatchCpu& batch);
  // The micro-batch's loss terms and counts; waits for the count SUMs still in flight.
  MoeLossTerms TakeLossTerms();
  // After a failed micro-batch: waits for and drops the count SUMs in flight.
  void Abandon() { counts_.clear(); }

  // The bytes of the host buffers held between calls (model/ops.h HeldActivationBytes):
  // every layer's routing and dispatch state, the spare sets, the shared scratch and the
  // router losses' logit gradient.
  int64_t HeldBytes() const;

  // Layer l's routing of the micro-batch (after its Route).
  const RouterOutput& route(int l) const { return layers_[l].route; }

  absl::Status Route(int l, const float* a, const MoeBlockWeights& w) override;
  absl::Status StartCountSum(int l) override;
  absl::Status Dispatch(int l, const float* a, const MoeBlockWeights& w, float* y,
                        bool rerun) override;
  absl::Status CheckGrads(const MoeBlockGrads& g) const override;
  absl::Status RouterLosses(int l) override;
  absl::Status DispatchBackward(int l, const float* a, const MoeBlockWeights& w, const float* dy,
                                float* da, const MoeBlockGrads& g) override;
  absl::Status RouterBackward(int l, const float* a, const MoeBlockWeights& w, float* da,
                              const MoeBlockGrads& g) override;
  void LendActivations(int l) override;
  void BorrowActivations(int l) override;

 protected:
  // The gradients the router losses put on a layer's router outputs, read by RouterBackward
  // (empty: zero): RouterLosses writes d_logits [T, E]; d_gating_sums [E] stays empty
  // (a test's RouterLosses may fill both).
  std::vector<float> loss_d_logits_;
  std::vector<double> loss_d_gating_sums_;
  const MoeMicroBatchCpu& batch() const { return batch_; }

 private:
  struct Layer {
    RouterOutput route;  // routing decisions and statistics of this micro-batch
    DispatchState dispatch;
    // Reproducible mode: the row blocks of each local expert's rows
    // (ExpertsConfig::row_blocks).
    std::vector<std::vector<int64_t>> expert_row_blocks;
    // The dispatch's per-expert row counts of every EP rank (DispatchState::all_counts),
    // kept for a re-run when the dispatch state is lent.
    std::vector<int64_t> dispatch_counts;
  };
  absl::Status ExpertRowBlocks(Layer& layer);
  DispatchConfig DispatchConfigOf(const Layer& layer);
  ExpertWeights LocalExperts(const MoeBlockWeights& w) const;

  Communicator& ep_;
  Communicator& world_;
  MoeLayerConfig config_;
  MoeLossWeights losses_;
  std::vector<Layer> layers_;
  // The dispatch's scratch, one set for every layer (the layers run one at a time).
  DispatchScratch scratch_;
  // Full recomputation: the dispatch states lent by LendActivations.
  std::vector<DispatchState> spare_;
  MoeMicroBatchCpu batch_;
  std::vector<uint8_t> mask_;
  std::vector<losses::ExpertCountReduction> counts_;  // per layer, in flight from forward
  MoeLossTerms terms_;
  // Between DispatchBackward and RouterBackward: d w_tk [T, K] (freed after).
  std::vector<float> d_combine_weight_;
};

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_MOE_LAYER_H_
