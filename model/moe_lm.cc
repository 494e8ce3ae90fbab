#include "model/moe_lm.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum::model {

absl::Status CheckTokenBatch(const TokenBatch& batch, int64_t vocab) {
  if (batch.labels.size() != batch.tokens.size() || batch.mask.size() != batch.tokens.size()) {
    return absl::InvalidArgumentError("micro-batch: tokens, labels and mask differ in length");
  }
  for (size_t t = 0; t < batch.tokens.size(); ++t) {
    if (batch.tokens[t] < 0 || batch.tokens[t] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", batch.tokens[t], " at position ", t, " outside [0, ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<const float>> MicroBatchTokenWeights(const losses::StepStats& stats,
                                                               int micro_index, int64_t tokens) {
  if (micro_index < 0 || micro_index >= stats.num_micro_batches) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro_index ", micro_index, " outside [0, ", stats.num_micro_batches, ")"));
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

const char* RecomputeName(Recompute r) {
  switch (r) {
    case Recompute::kNone:
      return "none";
    case Recompute::kSelective:
      return "selective";
    case Recompute::kFull:
      return "full";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<MoeLmModel>> MoeLmModel::Create(
    const MoeLmSpec& spec, ModelParams* params, std::unique_ptr<ModelOps> ops, Recompute recompute,
    const ParallelAttentionOptions& attention) {
  if (params == nullptr || ops == nullptr) {
    return absl::InvalidArgumentError("MoeLmModel needs its parameters and a device's ops");
  }
  const int local = params->num_local_experts();
  if (local < 1 || spec.config().experts % local != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeLmModel: ", local,
                     " local experts do not divide model.experts=", spec.config().experts));
  }
  if (recompute == Recompute::kFull && !ops->CanRecomputeMoe()) {
    return absl::UnimplementedError(
        "recompute=full: this device's ops cannot re-run a MoE layer's forward from its kept "
        "routing (the CUDA ops cannot yet); use recompute=selective or none");
  }
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<ParallelAttention> parallel_attention,
                           ParallelAttention::Create(spec.config(), ops.get(), attention));
  auto model = std::unique_ptr<MoeLmModel>(new MoeLmModel());
  model->attention_ = std::move(parallel_attention);
  model->spec_ = spec;
  model->params_ = params;
  model->ops_ = std::move(ops);
  model->recompute_ = recompute;
  model->mtp_ = MtpBlock(&model->spec_, model->ops_.get(), model->params_);
  if (spec.config().expert_bias_speed > 0) {
    model->expert_bias_.assign(spec.config().layers,
                               std::vector<float>(spec.config().experts, 0.0f));
  }
  return model;
}

absl::Status MoeLmModel::SetExpertBias(ExpertBias bias) {
  const MoeLmConfig& m = spec_.config();
  if (bias.empty()) {
    expert_bias_.clear();
    if (m.expert_bias_speed > 0) {
      expert_bias_.assign(m.layers, std::vector<float>(m.experts, 0.0f));
    }
    return absl::OkStatus();
  }
  if (static_cast<int>(bias.size()) != m.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert bias of ", bias.size(), " layers for a model of ", m.layers));
  }
  for (int l = 0; l < m.layers; ++l) {
    if (static_cast<int>(bias[l].size()) != m.experts) {
      return absl::InvalidArgumentError(absl::StrCat("expert bias of layer ", l, " has ",
                                                     bias[l].size(), " values, the model ",
                                                     m.experts, " experts"));
    }
    for (int e = 0; e < m.experts; ++e) {
      if (!std::isfinite(bias[l][e])) {
        return absl::InvalidArgumentError(absl::StrCat("expert bias of layer ", l, ", expert ", e,
                                                       " is not finite (", bias[l][e], ")"));
      }
    }
  }
  expert_bias_ = std::move(bias);
  return absl::OkStatus();
}

void MoeLmModel::UpdateExpertBias() {
  const MoeLmConfig& m = spec_.config();
  if (m.expert_bias_speed > 0 && !step_expert_counts_.empty()) {
    // u rounded to fp32 once; the sign decided in integers (sum_e c - E c_e has the sign of
    // mean_e c - c_e), so the update is exact and mesh-independent.
    const float u = static_cast<float>(m.expert_bias_speed);
    for (int l = 0; l < m.layers; ++l) {
      const std::vector<int64_t>& c = step_expert_counts_[l];
      int64_t total = 0;
      for (int64_t v : c) total += v;
      for (int e = 0; e < m.experts; ++e) {
        const int64_t diff = total - int64_t{m.experts} * c[e];
        if (diff > 0) expert_bias_[l][e] += u;
        if (diff < 0) expert_bias_[l][e] -= u;
      }
    }
  }
  step_expert_counts_.clear();
}

absl::Status MoeLmModel::RegisterDisplayTerms(const MoeLmConfig& config,
                                              losses::StepDisplay* display) {
  for (const char* term : {"ce", "z", "bal"}) GRADSUM_RETURN_IF_ERROR(display->RegisterTerm(term));
  if (config.ce.alpha_lse > 0.0) GRADSUM_RETURN_IF_ERROR(display->RegisterTerm("z_out"));
  return MtpBlock::RegisterDisplayTerms(config, display);
}

absl::Status MoeLmModel::EnsureActivations(int64_t T) {
  if (rows_ == T) return absl::OkStatus();
  const MoeLmConfig& m = spec_.config();
  const int L = m.layers;
  const int64_t D = m.dim;
  auto alloc = [&](Array& a, int64_t n) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(a, ops_->Allocate(n));
    return absl::OkStatus();
  };
  // The bytes of every array the model holds, counted from the arrays themselves.
  auto count = [&]() {
    int64_t floats = 0;
    auto add = [&floats](const Array& a) {
      if (a != nullptr) floats += a->size();
    };
    for (const std::vector<Array>* v : {&h_, &a_, &inv_rms_}) {
      for (const Array& a : *v) add(a);
    }
    for (const AttentionActs& x : attn_) {
      for (const Array* a : {&x.qh, &x.kh, &x.vh, &x.oh, &x.lse, &x.o, &x.m}) add(*a);
    }
    for (const NormActs& x : attn_norm_) add(x.b), add(x.inv_rms);
    floats += mtp_.floats();
    for (const Array* a : {&y_, &dh_, &da_, &f_, &inv_rms_f_, &grad_f_, &q_, &k_, &v_, &doh_, &dqh_,
                           &dkh_, &dvh_, &dkq_, &dvq_}) {
      add(*a);
    }
    array_bytes_ = floats * static_cast<int64_t>(sizeof(float)) + attention_->HeldBytes();
  };
  rows_ = -1;
  array_bytes_ = 0;
  // The layers' own arrays, or one working set (KeptSlot, NormSlot).
  const int M = spec_.moe_layers();
  const int kept = KeptSlot(M - 1) + 1, normed = NormSlot(M - 1) + 1;
  h_.resize(L + 1);
  a_.resize(normed);
  inv_rms_.resize(normed);
  for (int l = 0; l <= L; ++l) GRADSUM_RETURN_IF_ERROR(alloc(h_[l], T * D));
  for (int l = 0; l < normed; ++l) {
    GRADSUM_RETURN_IF_ERROR(alloc(a_[l], T * D));
    GRADSUM_RETURN_IF_ERROR(alloc(inv_rms_[l], T));
  }
  for (Array* a : {&y_, &dh_, &da_, &f_, &grad_f_}) GRADSUM_RETURN_IF_ERROR(alloc(*a, T * D));
  GRADSUM_RETURN_IF_ERROR(alloc(inv_rms_f_, T));
  GRADSUM_RETURN_IF_ERROR(mtp_.Allocate(T));
  attn_.clear();
  attn_norm_.clear();
  if (m.attention) {
    const int64_t Hq = m.n_heads, kv_dim = m.n_kv_heads * spec_.head_dim();
    attn_.resize(kept);
    for (AttentionActs& x : attn_) {
      for (Array* a : {&x.qh, &x.kh, &x.vh, &x.oh, &x.o, &x.m}) {
        GRADSUM_RETURN_IF_ERROR(alloc(*a, T * D));
      }
      GRADSUM_RETURN_IF_ERROR(alloc(x.lse, T * Hq));
    }
    attn_norm_.resize(normed);
    for (NormActs& x : attn_norm_) {
      GRADSUM_RETURN_IF_ERROR(alloc(x.b, T * D));
      GRADSUM_RETURN_IF_ERROR(alloc(x.inv_rms, T));
    }
    for (Array* a : {&q_, &doh_, &dqh_, &dkh_, &dvh_, &dkq_, &dvq_}) {
      GRADSUM_RETURN_IF_ERROR(alloc(*a, T * D));
    }
    GRADSUM_RETURN_IF_ERROR(alloc(k_, T * kv_dim));
    GRADSUM_RETURN_IF_ERROR(alloc(v_, T * kv_dim));
    GRADSUM_RETURN_IF_ERROR(attention_->Reserve(T));
  }
  count();
  rows_ = T;
  return absl::OkStatus();
}

void MoeLmModel::NoteActivationBytes() {
  peak_activation_bytes_ =
      std::max(peak_activation_bytes_, array_bytes_ + ops_->HeldActivationBytes());
}

int64_t MoeLmModel::TakePeakActivationBytes() {
  const int64_t p = peak_activation_bytes_;
  peak_activation_bytes_ = 0;
  return p;
}

MoeWeights MoeLmModel::LayerWeights(int l) {
  MoeWeights w;
  w.router = params_->Values(spec_.router(l));
  w.local_experts = params_->LocalExperts(l);
  if (!expert_bias_.empty() && l < spec_.config().layers) w.expert_bias = expert_bias_[l].data();
  return w;
}

float* MoeLmModel::LayerInput(int l) {
  const int L = spec_.config().layers;
  return l < L ? h_[l]->data() : mtp_.input(l - L + 1);
}

float* MoeLmModel::LayerOutput(int l) {
  const int L = spec_.config().layers;
  return l < L ? h_[l + 1]->data() : mtp_.output(l - L + 1);
}

float* MoeLmModel::LayerGrad(int l) {
  const int L = spec_.config().layers;
  return l < L ? dh_->data() : mtp_.grad(l - L + 1);
}

// h'_j = MTP depth j's projection block, then its layer on it (h^j).
absl::Status MoeLmModel::MtpForward(int j) {
  GRADSUM_RETURN_IF_ERROR(mtp_.ProjectForward(j, h_[spec_.config().layers]->data(), y_->data()));
  const int l = spec_.mtp_layer(j);
  GRADSUM_RETURN_IF_ERROR(LayerForward(l));
  if (recompute_ == Recompute::kFull) ops_->ReleaseMoeActivations(l);
  return absl::OkStatus();
}

// The depth's grad holds dL/dh^j (its CE and depth j + 1's block); afterwards dL/dh^{j-1}
// has been added into depth j - 1's grad (or dh_ for h_L), and the block keeps dL/de_j.
absl::Status MoeLmModel::MtpBackward(int j) {
  const int l = spec_.mtp_layer(j);
  if (recompute_ == Recompute::kFull) GRADSUM_RETURN_IF_ERROR(LayerRecompute(l));
  GRADSUM_RETURN_IF_ERROR(LayerBackward(l));
  if (recompute_ == Recompute::kFull) ops_->ReleaseMoeActivations(l);
  return mtp_.ProjectBackward(j, h_[spec_.config().layers]->data(), dh_->data(), da_->data());
}

absl::Status MoeLmModel::Forward(int stage) {
  const StageDef& s = spec_.stages()[stage];
  switch (s.kind) {
    case StageKind::kEmbedding:
      GRADSUM_RETURN_IF_ERROR(
          ops_->EmbeddingForward(/*stream=*/0, params_->Values(spec_.emb()), h_[0]->data()));
      return mtp_.EmbeddingForward();
    case StageKind::kLayer:
      GRADSUM_RETURN_IF_ERROR(LayerForward(s.layer));
      if (recompute_ == Recompute::kFull) ops_->ReleaseMoeActivations(s.layer);
      return absl::OkStatus();
    case StageKind::kMtp:
      return MtpForward(s.layer - spec_.config().layers + 1);
    case StageKind::kHead:
      return HeadForwardBackward();
  }
  return absl::InternalError("unknown stage");
}

absl::Status MoeLmModel::Backward(int stage) {
  const StageDef& s = spec_.stages()[stage];
  switch (s.kind) {
    case StageKind::kEmbedding: {
      GRADSUM_ASSIGN_OR_RETURN(GradTarget demb, params_->Grad(spec_.emb()));
      GRADSUM_RETURN_IF_ERROR(ops_->EmbeddingBackward(/*stream=*/0, dh_->data(), std::move(demb)));
      return mtp_.EmbeddingBackward();
    }
    case StageKind::kMtp:
      return MtpBackward(s.layer - spec_.config().layers + 1);
    case StageKind::kLayer:
      if (recompute_ == Recompute::kFull) GRADSUM_RETURN_IF_ERROR(LayerRecompute(s.layer));
      GRADSUM_RETURN_IF_ERROR(LayerBackward(s.layer));
      if (recompute_ == Recompute::kFull) ops_->ReleaseMoeActivations(s.layer);
      return absl::OkStatus();
    case StageKind::kHead:
      break;
  }
  return absl::InternalError(absl::StrCat("stage ", stage, " has no separate backward"));
}

// With attention: m_l = h_l + attention(RMSNorm(h_l; g^attn_l)); without, m_l = h_l.
// Then a_l = RMSNorm(m_l; g_l); h_{l+1} = m_l + MoE_l(a_l).
// The layer's forward up to the MoE block's input: the attention block (if any) into m_l,
// then the MoE block's RMSNorm into a (NormSlot).
absl::Status MoeLmModel::LayerForwardToMoeInput(int l) {
  if (spec_.config().attention) GRADSUM_RETURN_IF_ERROR(AttentionForward(l));
  return ops_->RmsNormForward(MoeBlockInput(l), params_->Values(spec_.norm(l)),
                              a_[NormSlot(l)]->data(), inv_rms_[NormSlot(l)]->data());
}

absl::Status MoeLmModel::LayerForward(int l) {
  const int64_t n = rows_ * spec_.config().dim;
  GRADSUM_RETURN_IF_ERROR(LayerForwardToMoeInput(l));
  GRADSUM_RETURN_IF_ERROR(
      ops_->MoeForward(l, a_[NormSlot(l)]->data(), LayerWeights(l), y_->data()));
  return ops_->Add(MoeBlockInput(l), y_->data(), LayerOutput(l), n);
}

// LayerForward's computations again, into the working set, from the kept h_l, with the MoE
// layer re-run from its kept routing (no count is reduced or added again, SEMANTICS.md
// §14); h_{l+1} is not rewritten (its backward is done).
absl::Status MoeLmModel::LayerRecompute(int l) {
  GRADSUM_RETURN_IF_ERROR(LayerForwardToMoeInput(l));
  return ops_->MoeRecomputeForward(l, a_[NormSlot(l)]->data(), LayerWeights(l), y_->data());
}

// dh holds dL/dh_{l+1} (= dL/dy through the residual); afterwards dL/dh_l.
absl::Status MoeLmModel::LayerBackward(int l) {
  const float* m = MoeBlockInput(l);
  float* a = a_[NormSlot(l)]->data();
  float* inv_rms = inv_rms_[NormSlot(l)]->data();
  if (recompute_ == Recompute::kSelective) {
    GRADSUM_RETURN_IF_ERROR(ops_->RmsNormForward(m, params_->Values(spec_.norm(l)), a, inv_rms));
  }
  MoeGrads grads;
  GRADSUM_ASSIGN_OR_RETURN(grads.router, params_->Grad(spec_.router(l)));
  GRADSUM_ASSIGN_OR_RETURN(grads.local_experts, params_->LocalExpertsGrad(l));
  float* dh = LayerGrad(l);
  GRADSUM_RETURN_IF_ERROR(
      ops_->MoeBackward(l, a, LayerWeights(l), dh, da_->data(), std::move(grads)));
  GRADSUM_ASSIGN_OR_RETURN(GradTarget dgain, params_->Grad(spec_.norm(l)));
  GRADSUM_RETURN_IF_ERROR(ops_->RmsNormBackward(m, params_->Values(spec_.norm(l)), inv_rms,
                                                da_->data(), dh,
                                                /*accumulate_dx=*/true, std::move(dgain)));
  // dh now holds dL/dm_l.
  return spec_.config().attention ? AttentionBackward(l) : absl::OkStatus();
}

// m_l = h_l + o Wo, o = the heads' document-causal attention over RoPE'd q, k, v of
// b_l = RMSNorm(h_l; g^attn_l).
absl::Status MoeLmModel::AttentionForward(int l) {
  const MoeLmConfig& c = spec_.config();
  const int64_t D = c.dim, kv_dim = c.n_kv_heads * spec_.head_dim();
  AttentionActs& x = attn_[KeptSlot(l)];
  NormActs& norm = attn_norm_[NormSlot(l)];
  GRADSUM_RETURN_IF_ERROR(ops_->RmsNormForward(LayerInput(l), params_->Values(spec_.attn_norm(l)),
                                               norm.b->data(), norm.inv_rms->data()));
  const float* b = norm.b->data();
  GRADSUM_RETURN_IF_ERROR(ops_->MatMul(b, params_->Values(spec_.wq(l)), D, D, q_->data()));
  GRADSUM_RETURN_IF_ERROR(ops_->MatMul(b, params_->Values(spec_.wk(l)), D, kv_dim, k_->data()));
  GRADSUM_RETURN_IF_ERROR(ops_->MatMul(b, params_->Values(spec_.wv(l)), D, kv_dim, v_->data()));
  GRADSUM_RETURN_IF_ERROR(ops_->Rope(q_->data(), c.n_heads, /*inverse=*/false));
  GRADSUM_RETURN_IF_ERROR(ops_->Rope(k_->data(), c.n_kv_heads, /*inverse=*/false));
  GRADSUM_RETURN_IF_ERROR(attention_->TokensToHeads(q_->data(), /*kv=*/false, x.qh->data()));
  GRADSUM_RETURN_IF_ERROR(attention_->TokensToHeads(k_->data(), /*kv=*/true, x.kh->data()));
  GRADSUM_RETURN_IF_ERROR(attention_->TokensToHeads(v_->data(), /*kv=*/true, x.vh->data()));
  GRADSUM_RETURN_IF_ERROR(
      attention_->Forward(x.qh->data(), x.kh->data(), x.vh->data(), x.oh->data(), x.lse->data()));
  GRADSUM_RETURN_IF_ERROR(attention_->HeadsToTokens(x.oh->data(), x.o->data()));
  GRADSUM_RETURN_IF_ERROR(
      ops_->MatMul(x.o->data(), params_->Values(spec_.wo(l)), D, D, y_->data()));
  return ops_->Add(LayerInput(l), y_->data(), x.m->data(), rows_ * D);
}

// dh holds dL/dm_l (which is also dL/d(o Wo)); afterwards dL/dh_l.
absl::Status MoeLmModel::AttentionBackward(int l) {
  const MoeLmConfig& c = spec_.config();
  const int64_t D = c.dim, kv_dim = c.n_kv_heads * spec_.head_dim();
  AttentionActs& x = attn_[KeptSlot(l)];
  NormActs& norm = attn_norm_[NormSlot(l)];
  if (recompute_ == Recompute::kSelective) {
    GRADSUM_RETURN_IF_ERROR(ops_->RmsNormForward(LayerInput(l), params_->Values(spec_.attn_norm(l)),
                                                 norm.b->data(), norm.inv_rms->data()));
  }
  float* dh = LayerGrad(l);
  float* d_o = da_->data();  // dL/do, token split (da is free until the norm below)
  GRADSUM_ASSIGN_OR_RETURN(GradTarget dwo, params_->Grad(spec_.wo(l)));
  GRADSUM_RETURN_IF_ERROR(ops_->MatMulBackward(x.o->data(), params_->Values(spec_.wo(l)), D, D, dh,
                                               d_o, /*accumulate_dx=*/false, std::move(dwo)));
  GRADSUM_RETURN_IF_ERROR(attention_->TokensToHeads(d_o, /*kv=*/false, doh_->data()));
  GRADSUM_RETURN_IF_ERROR(attention_->Backward(x.qh->data(), x.kh->data(), x.vh->data(),
                                               x.oh->data(), x.lse->data(), doh_->data(),
                                               dqh_->data(), dkh_->data(), dvh_->data()));
  // Back to the token split: dq [T, D]; dk, dv per query head, then summed per kv head.
  GRADSUM_RETURN_IF_ERROR(attention_->HeadsToTokens(dqh_->data(), q_->data()));
  GRADSUM_RETURN_IF_ERROR(attention_->HeadsToTokens(dkh_->data(), dkq_->data()));
  GRADSUM_RETURN_IF_ERROR(attention_->HeadsToTokens(dvh_->data(), dvq_->data()));
  GRADSUM_RETURN_IF_ERROR(ops_->SumKvGroups(dkq_->data(), k_->data()));
  GRADSUM_RETURN_IF_ERROR(ops_->SumKvGroups(dvq_->data(), v_->data()));
  GRADSUM_RETURN_IF_ERROR(ops_->Rope(q_->data(), c.n_heads, /*inverse=*/true));
  GRADSUM_RETURN_IF_ERROR(ops_->Rope(k_->data(), c.n_kv_heads, /*inverse=*/true));
  // dL/db through the three projections, then the norm into dh.
  float* db = da_->data();
  for (const auto& [w, dy, out] : {std::tuple<int, float*, int64_t>{spec_.wq(l), q_->data(), D},
                                   {spec_.wk(l), k_->data(), kv_dim},
                                   {spec_.wv(l), v_->data(), kv_dim}}) {
    GRADSUM_ASSIGN_OR_RETURN(GradTarget dw, params_->Grad(w));
    GRADSUM_RETURN_IF_ERROR(ops_->MatMulBackward(norm.b->data(), params_->Values(w), D, out, dy, db,
                                                 /*accumulate_dx=*/w != spec_.wq(l),
                                                 std::move(dw)));
  }
  GRADSUM_ASSIGN_OR_RETURN(GradTarget dgain, params_->Grad(spec_.attn_norm(l)));
  return ops_->RmsNormBackward(LayerInput(l), params_->Values(spec_.attn_norm(l)),
                               norm.inv_rms->data(), db, dh, /*accumulate_dx=*/true,
                               std::move(dgain));
}

// The turn stage: final norm, fused LM head + CE forward and backward (§3), and the final
// norm's backward, which starts dL/dh.
absl::Status MoeLmModel::HeadForwardBackward() {
  const int L = spec_.config().layers;
  const float* gain = params_->Values(spec_.final_norm());
  GRADSUM_RETURN_IF_ERROR(
      ops_->RmsNormForward(h_[L]->data(), gain, f_->data(), inv_rms_f_->data()));
  GRADSUM_ASSIGN_OR_RETURN(GradTarget grad_out, params_->Grad(spec_.out()));
  GRADSUM_RETURN_IF_ERROR(ops_->LmHeadCrossEntropy(/*stream=*/0, f_->data(),
                                                   params_->Values(spec_.out()), grad_f_->data(),
                                                   std::move(grad_out)));
  GRADSUM_ASSIGN_OR_RETURN(GradTarget dgain, params_->Grad(spec_.final_norm()));
  GRADSUM_RETURN_IF_ERROR(ops_->RmsNormBackward(h_[L]->data(), gain, inv_rms_f_->data(),
                                                grad_f_->data(), dh_->data(),
                                                /*accumulate_dx=*/false, std::move(dgain)));
  // MTP (§15.1): each h^j through the same head, which starts its dL/dh^j.
  return mtp_.HeadForwardBackward(f_->data(), inv_rms_f_->data(), grad_f_->data());
}

absl::StatusOr<MicroBatchInputs> MoeLmModel::Inputs(const TokenBatch& batch,
                                                    const losses::StepStats& stats, int micro_index,
                                                    bool forward_only) {
  const MoeLmConfig& m = spec_.config();
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  GRADSUM_RETURN_IF_ERROR(CheckTokenBatch(batch, m.vocab));
  MicroBatchInputs in;
  GRADSUM_ASSIGN_OR_RETURN(in.ce_weights, MicroBatchTokenWeights(stats, micro_index, T));
  in.rows = T;
  const int local = batch.local_seq_len > 0 ? batch.local_seq_len : batch.seq_len;
  in.row_block = params_->RowBlock(local);
  if ((in.row_block > 0 || m.attention) &&
      (local < 1 || batch.seq_len % local != 0 || int64_t{batch.sequences} * local != T)) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch of ", T, " tokens is not ",
                                                   batch.sequences, " sequences of ", local,
                                                   " tokens (of ", batch.seq_len, ")"));
  }
  if (in.row_block > 0 && local % in.row_block != 0) {
    return absl::InvalidArgumentError(absl::StrCat("reproducible row block of ", in.row_block,
                                                   " tokens does not divide the ", local,
                                                   " tokens this rank holds of each sequence"));
  }
  in.tokens = batch.tokens;
  in.labels = batch.labels;
  in.mask = batch.mask;
  in.sequences = batch.sequences;
  in.seq_len = batch.seq_len;
  if (m.attention) {
    if (static_cast<int64_t>(batch.positions.size()) != T ||
        static_cast<int64_t>(batch.doc_start.size()) != int64_t{batch.sequences} * batch.seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention needs every token's position (", batch.positions.size(), " for ",
                       T, ") and the whole sequences' document starts (", batch.doc_start.size(),
                       " for ", int64_t{batch.sequences} * batch.seq_len, ")"));
    }
    in.positions = batch.positions;
    in.doc_start = batch.doc_start;
  }
  in.global_ce_weight_sum = stats.global_ce_weight_sum;
  in.global_routed_tokens = stats.global_routed_tokens;
  in.num_micro_batches = stats.num_micro_batches;
  in.forward_only = forward_only;
  // §15.1: the MTP depths' label streams (training only).
  if (!forward_only) GRADSUM_RETURN_IF_ERROR(mtp_.AddInputs(batch, stats, micro_index, &in));
  return in;
}

absl::StatusOr<MicroBatchLosses> MoeLmModel::ForwardBackward(const TokenBatch& batch,
                                                             const losses::StepStats& stats,
                                                             int micro_index,
                                                             losses::StepDisplay* display) {
  const MoeLmConfig& m = spec_.config();
  GRADSUM_ASSIGN_OR_RETURN(const MicroBatchInputs in,
                           Inputs(batch, stats, micro_index, /*forward_only=*/false));
  const int64_t T = in.rows;
  GRADSUM_RETURN_IF_ERROR(EnsureActivations(T));

  absl::StatusOr<MicroBatchLossTerms> terms = [&]() -> absl::StatusOr<MicroBatchLossTerms> {
    if (m.attention) GRADSUM_RETURN_IF_ERROR(attention_->Begin(in));
    GRADSUM_RETURN_IF_ERROR(ops_->Begin(in));
    StageFns stages;
    stages.forward = [this](int s) {
      absl::Status status = Forward(s);
      NoteActivationBytes();
      return status;
    };
    stages.backward = [this](int s) {
      absl::Status status = Backward(s);
      NoteActivationBytes();
      return status;
    };
    GRADSUM_RETURN_IF_ERROR(
        params_->RunMicroBatch(stages, micro_index == stats.num_micro_batches - 1));
    return ops_->End();
  }();
  if (!terms.ok()) {
    ops_->Abandon();
    return terms.status();
  }
  if (m.expert_bias_speed > 0) {
    // §5.1: this training forward's global counts join the step's (once per micro-batch;
    // a recomputation in backward reduced and added none).
    if (step_expert_counts_.empty()) {
      step_expert_counts_.assign(m.layers, std::vector<int64_t>(m.experts, 0));
    }
    for (int l = 0; l < m.layers; ++l) {
      const std::vector<int64_t>& c = terms->global_expert_counts[l];
      if (static_cast<int>(c.size()) != m.experts) {
        return absl::InternalError(absl::StrCat("layer ", l, " returned ", c.size(),
                                                " expert counts for ", m.experts, " experts"));
      }
      for (int e = 0; e < m.experts; ++e) step_expert_counts_[l][e] += c[e];
    }
  }
  if (display != nullptr) {
    for (int l = 0; l < spec_.moe_layers(); ++l) {
      GRADSUM_RETURN_IF_ERROR(display->AddGlobalExpertCounts(l, terms->global_expert_counts[l]));
    }
    for (const auto& [name, values] :
         {std::pair<const char*, const std::vector<double>*>{"ce", &terms->ce_terms},
          {"z", &terms->z_terms},
          {"bal", &terms->bal_terms}}) {
      for (double v : *values) GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm(name, v));
    }
    // §3.2's output z-loss, its own term (registered only when alpha_lse > 0).
    if (m.ce.alpha_lse > 0.0) {
      if (terms->z_out_terms.empty()) {
        return absl::InternalError("the ops returned no output z-loss term with alpha_lse > 0");
      }
      for (double v : terms->z_out_terms) {
        GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("z_out", v));
      }
    }
    GRADSUM_RETURN_IF_ERROR(mtp_.AddDisplayTerms(*terms, display));
  }
  MicroBatchLosses result;
  result.ce = terms->ce;
  result.z = terms->z;
  result.bal = terms->bal;
  result.extra_ce = terms->extra_ce;
  result.z_out = terms->z_out;
  return result;
}

absl::StatusOr<MicroBatchLosses> MoeLmModel::Evaluate(const TokenBatch& batch,
                                                      const losses::StepStats& stats,
                                                      int micro_index,
                                                      losses::StepDisplay* display) {
  const MoeLmConfig& m = spec_.config();
  GRADSUM_ASSIGN_OR_RETURN(const MicroBatchInputs in,
                           Inputs(batch, stats, micro_index, /*forward_only=*/true));
  GRADSUM_RETURN_IF_ERROR(EnsureActivations(in.rows));
  absl::StatusOr<MicroBatchLossTerms> terms = [&]() -> absl::StatusOr<MicroBatchLossTerms> {
    if (m.attention) GRADSUM_RETURN_IF_ERROR(attention_->Begin(in));
    GRADSUM_RETURN_IF_ERROR(ops_->Begin(in));
    StageFns stages;
    stages.forward = [this](int s) {
      absl::Status status = EvalForward(s);
      NoteActivationBytes();
      return status;
    };
    GRADSUM_RETURN_IF_ERROR(params_->RunForward(stages));
    return ops_->End();
  }();
  if (!terms.ok()) {
    ops_->Abandon();
    return terms.status();
  }
  // The counts of an evaluation move nothing (§5.1: only training forwards' do).
  if (display != nullptr) {
    for (double v : terms->ce_terms) GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("ce", v));
    if (m.ce.alpha_lse > 0.0) {
      for (double v : terms->z_out_terms) {
        GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("z_out", v));
      }
    }
  }
  MicroBatchLosses result;
  result.ce = terms->ce;
  result.z_out = terms->z_out;
  return result;
}

absl::Status MoeLmModel::EvalForward(int stage) {
  const StageDef& s = spec_.stages()[stage];
  switch (s.kind) {
    case StageKind::kEmbedding:  // the main stream's only (no MTP inputs)
      return ops_->EmbeddingForward(/*stream=*/0, params_->Values(spec_.emb()), h_[0]->data());
    case StageKind::kLayer:
      return Forward(stage);  // training's, as it is
    case StageKind::kMtp:
      return absl::OkStatus();  // the evaluation is the main head's CE
    case StageKind::kHead: {
      const int L = spec_.config().layers;
      GRADSUM_RETURN_IF_ERROR(ops_->RmsNormForward(
          h_[L]->data(), params_->Values(spec_.final_norm()), f_->data(), inv_rms_f_->data()));
      return ops_->LmHeadLoss(f_->data(), params_->Values(spec_.out()));
    }
  }
  return absl::InternalError("unknown stage");
}

}  // namespace gradsum::model
