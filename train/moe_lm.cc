#include "train/moe_lm.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/half.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "losses/linear_cross_entropy.h"
#include "losses/router_losses.h"
#include "train/layers.h"

namespace gradsum::train {
namespace {

std::string LayerName(int l, const char* what) { return absl::StrCat("layers.", l, ".", what); }
std::string ExpertName(int l, int e, const char* what) {
  return absl::StrCat("layers.", l, ".experts.", e, ".", what);
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

moe::MoeLayerConfig LayerConfig(const ModelConfig& m) {
  moe::MoeLayerConfig c;
  c.d_model = m.dim();
  c.hidden = m.expert_dim();
  c.num_experts = m.experts();
  c.top_k = m.top_k();
  c.norm_topk_prob = m.norm_topk_prob();
  c.router_scale = m.router_scale();
  return c;
}

}  // namespace

absl::Status CheckMicroBatchTokens(const MicroBatch& batch, int64_t vocab) {
  if (batch.labels.size() != batch.tokens.size() || batch.mask.size() != batch.tokens.size()) {
    return absl::InvalidArgumentError("micro-batch: tokens, labels and mask differ in length");
  }
  for (size_t t = 0; t < batch.tokens.size(); ++t) {
    if (batch.tokens[t] < 0 || batch.tokens[t] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token ", batch.tokens[t], " at position ",
                                                     t, " outside [0, ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<const float>> MicroBatchTokenWeights(const losses::StepStats& stats,
                                                               int micro_index, int64_t tokens) {
  if (micro_index < 0 || micro_index >= stats.num_micro_batches) {
    return absl::InvalidArgumentError(absl::StrCat("micro_index ", micro_index, " outside [0, ",
                                                   stats.num_micro_batches, ")"));
  }
  if (stats.mode == losses::CeWeightMode::kToken) return absl::Span<const float>();
  if (micro_index >= static_cast<int>(stats.token_weights.size()) ||
      static_cast<int64_t>(stats.token_weights[micro_index].size()) != tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step statistics hold no CE weights for the ", tokens, " tokens of micro-batch ",
        micro_index, " (", losses::CeWeightModeName(stats.mode), " mode)"));
  }
  return absl::MakeConstSpan(stats.token_weights[micro_index]);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> MoeLmParamShapes(const ModelConfig& m) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  const int64_t V = m.vocab(), D = m.dim(), E = m.experts(), H = m.expert_dim();
  shapes.push_back({"emb", {V, D}});
  for (int l = 0; l < m.layers(); ++l) {
    shapes.push_back({LayerName(l, "norm"), {D}});
    shapes.push_back({LayerName(l, "router"), {D, E}});
    for (int e = 0; e < E; ++e) {
      shapes.push_back({ExpertName(l, e, "wg"), {D, H}});
      shapes.push_back({ExpertName(l, e, "wu"), {D, H}});
      shapes.push_back({ExpertName(l, e, "wd"), {H, D}});
    }
  }
  shapes.push_back({"final_norm", {D}});
  shapes.push_back({"out", {D, V}});
  return shapes;
}

absl::StatusOr<std::unique_ptr<MoeLm>> MoeLm::Create(const MoeLmOptions& options,
                                                     const MoeLmGroups& groups) {
  auto model = std::unique_ptr<MoeLm>(new MoeLm());
  GRADSUM_RETURN_IF_ERROR(Init(options, groups, model.get()));
  return model;
}

absl::Status MoeLm::Init(const MoeLmOptions& options, const MoeLmGroups& groups, MoeLm* model) {
  if (groups.world == nullptr || groups.ep_group == nullptr || groups.edp_group == nullptr) {
    return absl::InvalidArgumentError("MoeLm needs the world, EP and EDP communicators");
  }
  const ModelConfig& m = options.model;
  const int P = groups.ep_group->size();
  if (P * groups.edp_group->size() != groups.world->size()) {
    return absl::InvalidArgumentError(absl::StrCat("mesh: ep_group size ", P, " * edp_group size ",
                                                   groups.edp_group->size(), " != world size ",
                                                   groups.world->size()));
  }
  for (const auto& [name, v] : {std::pair<const char*, int>{"vocab", m.vocab()},
                                {"dim", m.dim()},
                                {"layers", m.layers()},
                                {"experts", m.experts()},
                                {"top_k", m.top_k()},
                                {"expert_dim", m.expert_dim()}}) {
    if (v <= 0)
      return absl::InvalidArgumentError(absl::StrCat("model.", name, "=", v, ": must be > 0"));
  }
  if (m.top_k() > m.experts()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.top_k=", m.top_k(), ": exceeds model.experts=", m.experts()));
  }
  if (m.experts() % P != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.experts=", m.experts(), " is not divisible by ep=", P, " (SEMANTICS.md §7)"));
  }
  model->options_ = options;
  model->comm_ = groups;
  model->ep_rank_ = groups.ep_group->rank();
  FlatParamOptions fp_options;
  fp_options.mode = options.sharding;
  fp_options.compute_dtype = options.compute_dtype;
  fp_options.reduce_dtype = options.reduce_dtype;

  const int64_t V = m.vocab(), D = m.dim(), E = m.experts(), H = m.expert_dim();
  std::vector<ParamSpec> dense = {{"emb", {V, D}}};
  for (int l = 0; l < m.layers(); ++l) {
    model->norm_index_.push_back(static_cast<int>(dense.size()));
    dense.push_back({LayerName(l, "norm"), {D}});
    model->router_index_.push_back(static_cast<int>(dense.size()));
    dense.push_back({LayerName(l, "router"), {D, E}});
  }
  model->final_norm_index_ = static_cast<int>(dense.size());
  dense.push_back({"final_norm", {D}});
  model->out_index_ = static_cast<int>(dense.size());
  dense.push_back({"out", {D, V}});
  GRADSUM_ASSIGN_OR_RETURN(model->dense_,
                           FlatParam::Create("dense", std::move(dense), groups.world, fp_options));

  // This EP slot's experts, stacked per kind so moe/experts.h sees [E/P, ...] blocks.
  const int local = m.experts() / P, first = model->ep_rank_ * local;
  for (int l = 0; l < m.layers(); ++l) {
    std::vector<ParamSpec> specs;
    for (const char* kind : {"wg", "wu", "wd"}) {
      for (int j = 0; j < local; ++j) {
        const bool down = std::string(kind) == "wd";
        specs.push_back({ExpertName(l, first + j, kind),
                         down ? std::vector<int64_t>{H, D} : std::vector<int64_t>{D, H}});
      }
    }
    GRADSUM_ASSIGN_OR_RETURN(
        std::unique_ptr<FlatParam> group,
        FlatParam::Create(absl::StrCat("layers.", l, ".experts.ep", model->ep_rank_),
                          std::move(specs), groups.edp_group, fp_options));
    model->experts_.push_back(std::move(group));
  }
  model->layer_state_.resize(m.layers());
  return absl::OkStatus();
}

NamedParams MoeLm::InitialParameters(const ModelConfig& m, uint64_t seed) {
  SplitMix64 rng(MixSeed(seed, 0x696e6974ull));
  NamedParams params;
  for (const auto& [name, shape] : MoeLmParamShapes(m)) {
    std::vector<float>& v = params[name];
    v.resize(NumElements(shape));
    const bool gain = name == "final_norm" || absl::EndsWith(name, ".norm");
    for (float& x : v) {
      if (gain) {
        x = 1.0f;
      } else if (name == "emb") {
        x = static_cast<float>(rng.Normal());
      } else {
        x = static_cast<float>(rng.Normal() * m.init_std());
      }
    }
  }
  return params;
}

std::vector<FlatParam*> MoeLm::groups() {
  std::vector<FlatParam*> g = {dense_.get()};
  for (auto& e : experts_) g.push_back(e.get());
  return g;
}

absl::Status MoeLm::SetFullParameters(const NamedParams& params) {
  for (FlatParam* g : groups()) {
    for (int i = 0; i < g->num_params(); ++i) {
      const FlatParamEntry& entry = g->entries()[i];
      auto it = params.find(entry.name);
      if (it == params.end()) {
        return absl::InvalidArgumentError(absl::StrCat("missing parameter ", entry.name));
      }
      if (static_cast<int64_t>(it->second.size()) != entry.numel) {
        return absl::InvalidArgumentError(absl::StrCat("parameter ", entry.name, " has ",
                                                       it->second.size(), " elements, expected ",
                                                       entry.numel));
      }
      GRADSUM_RETURN_IF_ERROR(g->SetFullValue(i, it->second));
    }
    GRADSUM_RETURN_IF_ERROR(g->MasterUpdated());
  }
  return absl::OkStatus();
}

absl::Status MoeLm::Unshard() {
  for (FlatParam* g : groups()) GRADSUM_RETURN_IF_ERROR(g->StartUnshard());
  compute_f32_.clear();
  for (FlatParam* g : groups()) {
    if (g->unshard_in_flight()) GRADSUM_RETURN_IF_ERROR(g->WaitUnshard());
    if (options_.compute_dtype != DType::kBF16) continue;
    // bf16 parameters (halved all-gather traffic); the CPU kernels read them widened
    // to fp32, which is exact.
    std::vector<float>& f32 = compute_f32_[g];
    f32.resize(g->numel());
    for (int i = 0; i < g->num_params(); ++i) {
      GRADSUM_ASSIGN_OR_RETURN(TensorView view, g->param(i));
      const BF16* src = view.data<BF16>();
      const FlatParamEntry& e = g->entries()[i];
      for (int64_t k = 0; k < e.numel; ++k) f32[e.offset + k] = src[k].ToFloat();
    }
  }
  return absl::OkStatus();
}

const float* MoeLm::Param(FlatParam* g, int index) {
  if (options_.compute_dtype == DType::kBF16) {
    return compute_f32_.at(g).data() + g->entries()[index].offset;
  }
  return g->param(index)->data<float>();
}

absl::StatusOr<float*> MoeLm::Grad(FlatParam* g, int index) {
  GRADSUM_ASSIGN_OR_RETURN(TensorView view, g->grad(index));
  return view.data<float>();
}

absl::Status MoeLm::ReduceGrads(bool last_micro_batch) {
  for (FlatParam* g : groups()) GRADSUM_RETURN_IF_ERROR(g->ReduceGrad(last_micro_batch));
  return absl::OkStatus();
}

absl::Status MoeLm::RegisterDisplayTerms(losses::StepDisplay* display) {
  for (const char* term : {"ce", "z", "bal"}) GRADSUM_RETURN_IF_ERROR(display->RegisterTerm(term));
  return absl::OkStatus();
}

absl::StatusOr<MicroBatchLosses> MoeLm::ForwardBackward(const MicroBatch& batch,
                                                        const losses::StepStats& stats,
                                                        int micro_index,
                                                        losses::StepDisplay* display) {
  // The GEMMs below (router, experts) use this rank's thread budget.
  ScopedComputeThreads compute_threads(options_.num_threads);
  const ModelConfig& m = options_.model;
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  const int64_t D = m.dim(), V = m.vocab(), E = m.experts();
  const int L = m.layers(), K = m.top_k();
  GRADSUM_RETURN_IF_ERROR(CheckMicroBatchTokens(batch, V));
  GRADSUM_ASSIGN_OR_RETURN(absl::Span<const float> token_weights,
                           MicroBatchTokenWeights(stats, micro_index, T));
  for (FlatParam* g : groups()) {
    if (!g->is_unsharded()) {
      return absl::FailedPreconditionError(
          absl::StrCat("parameter group ", g->name(), " is not unsharded: call Unshard()"));
    }
  }
  std::vector<uint8_t> mask(batch.mask.begin(), batch.mask.end());
  std::vector<int64_t> labels(batch.labels.begin(), batch.labels.end());
  const moe::MoeLayerConfig layer_config = LayerConfig(m);
  const int local = m.experts() / comm_.ep_group->size();
  const int64_t expert_block = local * D * m.expert_dim();

  auto layer_weights = [&](int l) {
    moe::MoeLayerWeights w;
    w.router = absl::MakeConstSpan(Param(dense_.get(), router_index_[l]), D * E);
    FlatParam* g = experts_[l].get();
    w.local_experts.gate = absl::MakeConstSpan(Param(g, 0), expert_block);
    w.local_experts.up = absl::MakeConstSpan(Param(g, local), expert_block);
    w.local_experts.down = absl::MakeConstSpan(Param(g, 2 * local), expert_block);
    return w;
  };

  // ---- Forward. ----
  std::vector<float> h(T * D);
  EmbeddingForward(absl::MakeConstSpan(Param(dense_.get(), emb_index_), V * D), batch.tokens, D,
                   absl::MakeSpan(h));
  std::vector<std::vector<float>> h_in(L), a(L), inv_rms(L);
  std::vector<losses::ExpertCountReduction> counts;
  counts.reserve(L);
  std::vector<float> y(T * D);
  for (int l = 0; l < L; ++l) {
    h_in[l] = h;
    a[l].resize(T * D);
    inv_rms[l].resize(T);
    RmsNormForward(h, absl::MakeConstSpan(Param(dense_.get(), norm_index_[l]), D), T, D,
                   absl::MakeSpan(a[l]), absl::MakeSpan(inv_rms[l]));
    GRADSUM_RETURN_IF_ERROR(moe::MoeLayerForward(*comm_.ep_group, layer_config, layer_weights(l),
                                                 a[l], mask, absl::MakeSpan(y), &layer_state_[l]));
    // c[l, m, :] of §5 travels while the next layers compute.
    GRADSUM_ASSIGN_OR_RETURN(losses::ExpertCountReduction c,
                             losses::ExpertCountReduction::Start(
                                 *comm_.world, layer_state_[l].route.local_expert_counts, K));
    counts.push_back(std::move(c));
    for (int64_t i = 0; i < T * D; ++i) h[i] += y[i];
  }
  std::vector<float> f(T * D), inv_rms_final(T), grad_f(T * D);
  const float* final_norm = Param(dense_.get(), final_norm_index_);
  RmsNormForward(h, absl::MakeConstSpan(final_norm, D), T, D, absl::MakeSpan(f),
                 absl::MakeSpan(inv_rms_final));

  // ---- Loss head: fused LM-head matmul + CE forward and backward (§3). ----
  GRADSUM_ASSIGN_OR_RETURN(TensorView f_view, TensorView::Create(f.data(), DType::kF32, {T, D}));
  GRADSUM_ASSIGN_OR_RETURN(
      TensorView head_view,
      TensorView::Create(const_cast<float*>(Param(dense_.get(), out_index_)), DType::kF32, {D, V}));
  GRADSUM_ASSIGN_OR_RETURN(TensorView grad_f_view,
                           TensorView::Create(grad_f.data(), DType::kF32, {T, D}));
  GRADSUM_ASSIGN_OR_RETURN(float* grad_out, Grad(dense_.get(), out_index_));
  GRADSUM_ASSIGN_OR_RETURN(TensorView grad_head_view,
                           TensorView::Create(grad_out, DType::kF32, {D, V}));
  losses::LinearCrossEntropyOptions ce_options;
  ce_options.num_threads = options_.num_threads;
  GRADSUM_ASSIGN_OR_RETURN(
      losses::LinearCrossEntropyResult ce,
      losses::LinearCrossEntropyForwardBackward(f_view, head_view, labels, token_weights,
                                                stats.global_ce_weight_sum, grad_f_view,
                                                grad_head_view, ce_options));

  // ---- Backward. ----
  std::vector<float> dh(T * D, 0.0f);
  GRADSUM_ASSIGN_OR_RETURN(float* grad_final_norm, Grad(dense_.get(), final_norm_index_));
  RmsNormBackward(h, absl::MakeConstSpan(final_norm, D), inv_rms_final, grad_f, T, D,
                  absl::MakeSpan(dh), absl::MakeSpan(grad_final_norm, D));
  MicroBatchLosses result;
  result.ce = ce.ce.local_loss;
  std::vector<float> du(T * E), da(T * D);
  for (int l = L - 1; l >= 0; --l) {
    moe::RouterOutput& route = layer_state_[l].route;
    std::fill(du.begin(), du.end(), 0.0f);
    GRADSUM_ASSIGN_OR_RETURN(TensorView u,
                             TensorView::Create(route.logits.data(), DType::kF32, {T, E}));
    GRADSUM_ASSIGN_OR_RETURN(TensorView du_view,
                             TensorView::Create(du.data(), DType::kF32, {T, E}));
    GRADSUM_ASSIGN_OR_RETURN(double z,
                             losses::RouterZLossForwardBackward(u, mask, stats.global_routed_tokens,
                                                                options_.alpha_z, du_view));
    GRADSUM_ASSIGN_OR_RETURN(absl::Span<const int64_t> global_counts, counts[l].Wait());
    GRADSUM_ASSIGN_OR_RETURN(double bal, losses::LoadBalancingLossForwardBackward(
                                             u, mask, global_counts, K, stats.num_micro_batches,
                                             options_.alpha_b, du_view));
    result.z += z;
    result.bal += bal;
    if (display != nullptr)
      GRADSUM_RETURN_IF_ERROR(display->AddGlobalExpertCounts(l, global_counts));

    std::fill(da.begin(), da.end(), 0.0f);
    FlatParam* g = experts_[l].get();
    GRADSUM_ASSIGN_OR_RETURN(float* grad_router, Grad(dense_.get(), router_index_[l]));
    GRADSUM_ASSIGN_OR_RETURN(float* grad_gate, Grad(g, 0));
    GRADSUM_ASSIGN_OR_RETURN(float* grad_up, Grad(g, local));
    GRADSUM_ASSIGN_OR_RETURN(float* grad_down, Grad(g, 2 * local));
    moe::MoeLayerGrads grads;
    grads.router = absl::MakeSpan(grad_router, D * E);
    grads.local_experts.gate = absl::MakeSpan(grad_gate, expert_block);
    grads.local_experts.up = absl::MakeSpan(grad_up, expert_block);
    grads.local_experts.down = absl::MakeSpan(grad_down, expert_block);
    moe::RouterLossGrads loss_grads;
    loss_grads.d_logits = du;
    // h_out = h_in + y: dL/dy = dL/dh_out, and dL/dh_in = dL/dh_out + the norm branch.
    GRADSUM_RETURN_IF_ERROR(moe::MoeLayerBackward(*comm_.ep_group, layer_config, layer_weights(l),
                                                  a[l], layer_state_[l], dh, loss_grads,
                                                  absl::MakeSpan(da), grads));
    GRADSUM_ASSIGN_OR_RETURN(float* grad_norm, Grad(dense_.get(), norm_index_[l]));
    RmsNormBackward(h_in[l], absl::MakeConstSpan(Param(dense_.get(), norm_index_[l]), D),
                    inv_rms[l], da, T, D, absl::MakeSpan(dh), absl::MakeSpan(grad_norm, D));
  }
  GRADSUM_ASSIGN_OR_RETURN(float* grad_emb, Grad(dense_.get(), emb_index_));
  EmbeddingBackward(batch.tokens, dh, D, absl::MakeSpan(grad_emb, V * D));

  if (display != nullptr) {
    GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("ce", result.ce));
    GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("z", result.z));
    GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("bal", result.bal));
  }
  return result;
}

absl::StatusOr<NamedParams> MoeLm::GatherFull(bool grads) {
  const auto shapes = MoeLmParamShapes(options_.model);
  std::map<std::string, int64_t> offset;
  int64_t total = 0;
  for (const auto& [name, shape] : shapes) {
    offset[name] = total;
    total += NumElements(shape);
  }
  std::vector<float> all(total, 0.0f);
  const int world_rank = comm_.world->rank();
  const int P = comm_.ep_group->size();
  for (FlatParam* g : groups()) {
    absl::Span<const float> owned = grads ? g->owned_grad() : g->owned_master();
    std::vector<float> send(g->shard_numel(), 0.0f);
    std::copy(owned.begin(), owned.end(), send.begin());
    std::vector<float> full(g->shard_numel() * g->group_size());
    GRADSUM_RETURN_IF_ERROR(
        g->group()->AllGather(send.data(), full.data(), g->shard_numel(), DType::kF32));
    // One writer per parameter: world rank 0 for dense values, the f == 0 rank of each EP
    // slot for its experts. Everyone else adds zeros, so the SUM below is exact.
    const bool writer = g == dense_.get() ? world_rank == 0 : world_rank < P;
    if (!writer) continue;
    for (const FlatParamEntry& e : g->entries()) {
      std::copy(full.begin() + e.offset, full.begin() + e.offset + e.numel,
                all.begin() + offset.at(e.name));
    }
  }
  GRADSUM_RETURN_IF_ERROR(
      comm_.world->AllReduce(all.data(), all.data(), all.size(), DType::kF32, ReduceOp::kSum));
  NamedParams out;
  for (const auto& [name, shape] : shapes) {
    out[name].assign(all.begin() + offset.at(name),
                     all.begin() + offset.at(name) + NumElements(shape));
  }
  return out;
}

}  // namespace gradsum::train
