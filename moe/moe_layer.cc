#include "moe/moe_layer.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"
#include "losses/router_losses.h"

namespace gradsum::moe {

MoeLayersCpu::MoeLayersCpu(Communicator& ep_group, Communicator& world,
                           const MoeLayerConfig& config, const MoeLossWeights& losses,
                           int num_layers)
    : ep_(ep_group), world_(world), config_(config), losses_(losses), layers_(num_layers) {}

void MoeLayersCpu::BeginMicroBatch(const MoeMicroBatchCpu& batch) {
  batch_ = batch;
  mask_.assign(batch.mask.begin(), batch.mask.end());
  batch_.mask = {};
  config_.row_block = batch.row_block;
  counts_.clear();
  counts_.reserve(layers_.size());
  terms_ = MoeLossTerms();
  terms_.global_expert_counts.assign(layers_.size(), {});
}

MoeLossTerms MoeLayersCpu::TakeLossTerms() {
  counts_.clear();
  MoeLossTerms out = std::move(terms_);
  terms_ = MoeLossTerms();
  return out;
}

DispatchConfig MoeLayersCpu::DispatchConfigOf(const Layer& layer) {
  DispatchConfig d{.d_model = config_.d_model,
                   .hidden = config_.hidden,
                   .num_experts = config_.num_experts,
                   .top_k = config_.top_k};
  d.scratch = &scratch_;
  if (config_.row_block > 0) d.expert_row_blocks = &layer.expert_row_blocks;
  return d;
}

ExpertWeights MoeLayersCpu::LocalExperts(const MoeBlockWeights& w) const {
  const int64_t block = config_.num_experts / ep_.size() * config_.d_model * config_.hidden;
  return ExpertWeights{.gate = absl::MakeConstSpan(w.local_experts, block),
                       .up = absl::MakeConstSpan(w.local_experts + block, block),
                       .down = absl::MakeConstSpan(w.local_experts + 2 * block, block)};
}

// The owner-side row blocks of this rank's experts (MoeLayerConfig::row_block): each rank
// counts the copies every one of its blocks sends to every expert, one all-gather shares
// the counts, and local expert j's rows (grouped by source rank, each source's rows in
// token order, moe/dispatch.h) split into the blocks of source 0, then source 1, ...
absl::Status MoeLayersCpu::ExpertRowBlocks(Layer& layer) {
  const int P = ep_.size();
  const int E = config_.num_experts, K = config_.top_k, El = E / P;
  const RouterOutput& route = layer.route;
  const int64_t T = route.num_tokens;
  int64_t blocks = (T + config_.row_block - 1) / config_.row_block;
  // The same block count on every EP rank, or every rank fails with the same message.
  std::vector<int64_t> all_blocks(P);
  GRADSUM_RETURN_IF_ERROR(Annotate(ep_.AllGather(&blocks, all_blocks.data(), 1, DType::kI64),
                                   "exchanging block counts"));
  for (int q = 0; q < P; ++q) {
    if (all_blocks[q] != all_blocks[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "reproducible MoE layer: EP rank ", q, " has ", all_blocks[q], " row blocks, rank 0 has ",
          all_blocks[0], "; every EP rank needs the same number of row blocks"));
    }
  }
  std::vector<int64_t> counts(static_cast<size_t>(E) * blocks, 0);  // [E, blocks]
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const int32_t e = route.expert_index[t * K + k];
      if (e >= 0) ++counts[e * blocks + t / config_.row_block];
    }
  }
  std::vector<int64_t> all(static_cast<size_t>(P) * E * blocks);
  GRADSUM_RETURN_IF_ERROR(
      Annotate(ep_.AllGather(counts.data(), all.data(), counts.size(), DType::kI64),
               "exchanging row block counts"));
  layer.expert_row_blocks.assign(El, {});
  for (int j = 0; j < El; ++j) {
    const int e = ep_.rank() * El + j;
    std::vector<int64_t>& b = layer.expert_row_blocks[j];
    for (int q = 0; q < P; ++q) {
      const int64_t* c = &all[(static_cast<size_t>(q) * E + e) * blocks];
      b.insert(b.end(), c, c + blocks);
    }
  }
  return absl::OkStatus();
}

absl::Status MoeLayersCpu::Route(int l, const float* a, const MoeBlockWeights& w) {
  Layer& layer = layers_[l];
  const int64_t D = config_.d_model, E = config_.num_experts;
  GRADSUM_RETURN_IF_ERROR(ValidateDispatchConfig(DispatchConfigOf(layer), ep_.size()));
  absl::Span<const float> bias;
  if (w.expert_bias != nullptr) bias = absl::MakeConstSpan(w.expert_bias, E);
  GRADSUM_ASSIGN_OR_RETURN(layer.route,
                           RouterForward(config_.router(), absl::MakeConstSpan(a, batch_.rows * D),
                                         absl::MakeConstSpan(w.router, D * E), mask_, bias));
  if (config_.row_block > 0) GRADSUM_RETURN_IF_ERROR(ExpertRowBlocks(layer));
  return absl::OkStatus();
}

absl::Status MoeLayersCpu::StartCountSum(int l) {
  if (static_cast<int>(counts_.size()) != l) {
    return absl::FailedPreconditionError(
        absl::StrCat("MoE layer ", l, " summed its expert counts out of order"));
  }
  GRADSUM_ASSIGN_OR_RETURN(losses::ExpertCountReduction c,
                           losses::ExpertCountReduction::Start(
                               world_, layers_[l].route.local_expert_counts, config_.top_k));
  counts_.push_back(std::move(c));
  return absl::OkStatus();
}

// A re-run (activation recomputation) takes the routing decisions and row blocks of the
// layer's forward: no router pass and no all-gather (the dispatch's exchanged counts are
// kept too); the row exchange is re-done, the same rows in the same order, so the dispatch
// state and y come out bit-identical to the first forward's.
absl::Status MoeLayersCpu::Dispatch(int l, const float* a, const MoeBlockWeights& w, float* y,
                                    bool rerun) {
  Layer& layer = layers_[l];
  const int64_t D = config_.d_model, T = batch_.rows;
  DispatchConfig dispatch = DispatchConfigOf(layer);
  if (rerun) {
    if (layer.route.num_tokens != T || (config_.row_block > 0 && layer.expert_row_blocks.empty())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "MoE layer recompute: the kept routing is of ", layer.route.num_tokens,
          " tokens, the input has ", T, "; re-run only a layer whose forward ran on this input"));
    }
    dispatch.all_counts = &layer.dispatch_counts;
  }
  GRADSUM_RETURN_IF_ERROR(DispatchCombineForward(
      ep_, dispatch, LocalExperts(w), absl::MakeConstSpan(a, T * D), layer.route.expert_index,
      layer.route.combine_weight, absl::MakeSpan(y, T * D), &layer.dispatch));
  if (!rerun) {
    layer.dispatch_counts.assign(layer.dispatch.all_counts.begin(),
                                 layer.dispatch.all_counts.end());
  }
  return absl::OkStatus();
}

absl::Status MoeLayersCpu::CheckGrads(const MoeBlockGrads& g) const {
  if ((g.router->exact() != nullptr) != (g.local_experts->exact() != nullptr)) {
    return absl::InvalidArgumentError(
        "MoE layer gradients: the router and the experts need the same kind of target");
  }
  return absl::OkStatus();
}

// The z and balancing losses, per row block: row-wise gradients into loss_d_logits_, the
// values (sums over the rows) into the terms.
absl::Status MoeLayersCpu::RouterLosses(int l) {
  const int64_t E = config_.num_experts, T = batch_.rows;
  const int K = config_.top_k;
  if (l >= static_cast<int>(counts_.size())) {
    return absl::FailedPreconditionError(absl::StrCat("MoE layer ", l, " has no forward"));
  }
  RouterOutput& route = layers_[l].route;
  loss_d_logits_.assign(T * E, 0.0f);
  GRADSUM_ASSIGN_OR_RETURN(absl::Span<const int64_t> global_counts, counts_[l].Wait());
  const int64_t S = batch_.row_block > 0 ? batch_.row_block : T;
  for (int64_t r0 = 0; r0 < T; r0 += S) {
    GRADSUM_ASSIGN_OR_RETURN(TensorView u,
                             TensorView::Create(route.logits.data() + r0 * E, DType::kF32, {S, E}));
    GRADSUM_ASSIGN_OR_RETURN(TensorView du_view, TensorView::Create(loss_d_logits_.data() + r0 * E,
                                                                    DType::kF32, {S, E}));
    const auto m_rows = absl::MakeConstSpan(mask_).subspan(r0, S);
    GRADSUM_ASSIGN_OR_RETURN(
        double z, losses::RouterZLossForwardBackward(u, m_rows, batch_.global_routed_tokens,
                                                     losses_.alpha_z, du_view));
    GRADSUM_ASSIGN_OR_RETURN(double bal, losses::LoadBalancingLossForwardBackward(
                                             u, m_rows, global_counts, K, batch_.num_micro_batches,
                                             losses_.alpha_b, du_view));
    terms_.z += z;
    terms_.bal += bal;
    if (batch_.row_block > 0) {
      terms_.z_terms.push_back(z);
      terms_.bal_terms.push_back(bal);
    }
  }
  terms_.global_expert_counts[l].assign(global_counts.begin(), global_counts.end());
  return absl::OkStatus();
}

absl::Status MoeLayersCpu::DispatchBackward(int l, const float* a, const MoeBlockWeights& w,
                                            const float* dy, float* da, const MoeBlockGrads& g) {
  const Layer& layer = layers_[l];
  const int64_t D = config_.d_model, T = batch_.rows;
  std::fill(da, da + T * D, 0.0f);
  ExpertWeightGrads grads;
  if (g.local_experts->exact() != nullptr) {
    grads.exact = g.local_experts->exact();
  } else {
    const int64_t block = config_.num_experts / ep_.size() * D * config_.hidden;
    float* experts = g.local_experts->accumulate();
    grads.gate = absl::MakeSpan(experts, block);
    grads.up = absl::MakeSpan(experts + block, block);
    grads.down = absl::MakeSpan(experts + 2 * block, block);
  }
  d_combine_weight_.assign(layer.route.combine_weight.size(), 0.0f);
  return DispatchCombineBackward(ep_, DispatchConfigOf(layer), LocalExperts(w), layer.dispatch,
                                 absl::MakeConstSpan(dy, T * D), absl::MakeSpan(da, T * D),
                                 absl::MakeSpan(d_combine_weight_), grads);
}

absl::Status MoeLayersCpu::RouterBackward(int l, const float* a, const MoeBlockWeights& w,
                                          float* da, const MoeBlockGrads& g) {
  const int64_t D = config_.d_model, E = config_.num_experts, T = batch_.rows;
  RouterOutputGrads router_grads;
  router_grads.d_combine_weight = d_combine_weight_;
  router_grads.d_gating_sums = loss_d_gating_sums_;
  router_grads.d_logits = loss_d_logits_;
  absl::Span<float> d_router;
  if (g.router->exact() == nullptr) d_router = absl::MakeSpan(g.router->accumulate(), D * E);
  absl::Status s = moe::RouterBackward(
      config_.router(), absl::MakeConstSpan(a, T * D), absl::MakeConstSpan(w.router, D * E),
      layers_[l].route, router_grads, d_router, absl::MakeSpan(da, T * D), g.router->exact());
  // Only backward's: not held between the calls.
  std::vector<float>().swap(d_combine_weight_);
  return s;
}

void MoeLayersCpu::LendActivations(int l) {
  spare_.push_back(std::move(layers_[l].dispatch));
  layers_[l].dispatch = DispatchState();
}

void MoeLayersCpu::BorrowActivations(int l) {
  if (spare_.empty()) return;
  layers_[l].dispatch = std::move(spare_.back());
  spare_.pop_back();
}

int64_t MoeLayersCpu::HeldBytes() const {
  int64_t bytes = 0;
  auto add = [&bytes](const auto& v) {
    bytes += static_cast<int64_t>(v.capacity() * sizeof(v[0]));
  };
  auto add_dispatch = [&add](const DispatchState& d) {
    add(d.send_copy), add(d.copy_pos), add(d.combine_weight), add(d.output_row);
    add(d.copy_output), add(d.expert_input), add(d.expert_output);
    for (const ExpertsSaved& e : d.experts_saved) add(e.gate_pre), add(e.up_pre);
    add(d.scratch_send), add(d.scratch_expert_a), add(d.scratch_expert_b);
  };
  for (const Layer& layer : layers_) {
    const RouterOutput& r = layer.route;
    add(r.logits), add(r.probs), add(r.expert_index), add(r.combine_weight), add(r.routed);
    add_dispatch(layer.dispatch);
  }
  for (const DispatchState& d : spare_) add_dispatch(d);
  add(scratch_.send), add(scratch_.expert_a), add(scratch_.expert_b);
  add(loss_d_logits_);
  return bytes;
}

}  // namespace gradsum::moe
