#include "model/moe_lm.h"

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

absl::StatusOr<std::unique_ptr<MoeLmModel>> MoeLmModel::Create(const MoeLmSpec& spec,
                                                               ModelParams* params,
                                                               std::unique_ptr<ModelOps> ops) {
  if (params == nullptr || ops == nullptr) {
    return absl::InvalidArgumentError("MoeLmModel needs its parameters and a device's ops");
  }
  const int local = params->num_local_experts();
  if (local < 1 || spec.config().experts % local != 0) {
    return absl::InvalidArgumentError(absl::StrCat("MoeLmModel: ", local,
                                                   " local experts do not divide model.experts=",
                                                   spec.config().experts));
  }
  auto model = std::unique_ptr<MoeLmModel>(new MoeLmModel());
  model->spec_ = spec;
  model->params_ = params;
  model->ops_ = std::move(ops);
  return model;
}

absl::Status MoeLmModel::RegisterDisplayTerms(losses::StepDisplay* display) {
  for (const char* term : {"ce", "z", "bal"}) GRADSUM_RETURN_IF_ERROR(display->RegisterTerm(term));
  return absl::OkStatus();
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
  rows_ = -1;
  h_.resize(L + 1);
  a_.resize(L);
  inv_rms_.resize(L);
  for (int l = 0; l <= L; ++l) GRADSUM_RETURN_IF_ERROR(alloc(h_[l], T * D));
  for (int l = 0; l < L; ++l) {
    GRADSUM_RETURN_IF_ERROR(alloc(a_[l], T * D));
    GRADSUM_RETURN_IF_ERROR(alloc(inv_rms_[l], T));
  }
  for (Array* a : {&y_, &dh_, &da_, &f_, &grad_f_}) GRADSUM_RETURN_IF_ERROR(alloc(*a, T * D));
  GRADSUM_RETURN_IF_ERROR(alloc(inv_rms_f_, T));
  rows_ = T;
  return absl::OkStatus();
}

MoeWeights MoeLmModel::LayerWeights(int l) {
  MoeWeights w;
  w.router = params_->Values(spec_.router(l));
  w.local_experts = params_->LocalExperts(l);
  return w;
}

absl::Status MoeLmModel::Forward(int stage) {
  const StageDef& s = spec_.stages()[stage];
  switch (s.kind) {
    case StageKind::kEmbedding:
      return ops_->EmbeddingForward(params_->Values(spec_.emb()), h_[0]->data());
    case StageKind::kLayer:
      return LayerForward(s.layer);
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
      return ops_->EmbeddingBackward(dh_->data(), std::move(demb));
    }
    case StageKind::kLayer:
      return LayerBackward(s.layer);
    case StageKind::kHead:
      break;
  }
  return absl::InternalError(absl::StrCat("stage ", stage, " has no separate backward"));
}

// a_l = RMSNorm(h_l; g_l); h_{l+1} = h_l + MoE_l(a_l).
absl::Status MoeLmModel::LayerForward(int l) {
  const int64_t n = rows_ * spec_.config().dim;
  GRADSUM_RETURN_IF_ERROR(ops_->RmsNormForward(h_[l]->data(), params_->Values(spec_.norm(l)),
                                               a_[l]->data(), inv_rms_[l]->data()));
  GRADSUM_RETURN_IF_ERROR(ops_->MoeForward(l, a_[l]->data(), LayerWeights(l), y_->data()));
  return ops_->Add(h_[l]->data(), y_->data(), h_[l + 1]->data(), n);
}

// dh holds dL/dh_{l+1} (= dL/dy through the residual); afterwards dL/dh_l.
absl::Status MoeLmModel::LayerBackward(int l) {
  MoeGrads grads;
  GRADSUM_ASSIGN_OR_RETURN(grads.router, params_->Grad(spec_.router(l)));
  GRADSUM_ASSIGN_OR_RETURN(grads.local_experts, params_->LocalExpertsGrad(l));
  GRADSUM_RETURN_IF_ERROR(ops_->MoeBackward(l, a_[l]->data(), LayerWeights(l), dh_->data(),
                                            da_->data(), std::move(grads)));
  GRADSUM_ASSIGN_OR_RETURN(GradTarget dgain, params_->Grad(spec_.norm(l)));
  return ops_->RmsNormBackward(h_[l]->data(), params_->Values(spec_.norm(l)),
                               inv_rms_[l]->data(), da_->data(), dh_->data(),
                               /*accumulate_dx=*/true, std::move(dgain));
}

// The turn stage: final norm, fused LM head + CE forward and backward (§3), and the final
// norm's backward, which starts dL/dh.
absl::Status MoeLmModel::HeadForwardBackward() {
  const int L = spec_.config().layers;
  const float* gain = params_->Values(spec_.final_norm());
  GRADSUM_RETURN_IF_ERROR(
      ops_->RmsNormForward(h_[L]->data(), gain, f_->data(), inv_rms_f_->data()));
  GRADSUM_ASSIGN_OR_RETURN(GradTarget grad_out, params_->Grad(spec_.out()));
  GRADSUM_RETURN_IF_ERROR(ops_->LmHeadCrossEntropy(f_->data(), params_->Values(spec_.out()),
                                                   grad_f_->data(), std::move(grad_out)));
  GRADSUM_ASSIGN_OR_RETURN(GradTarget dgain, params_->Grad(spec_.final_norm()));
  return ops_->RmsNormBackward(h_[L]->data(), gain, inv_rms_f_->data(), grad_f_->data(),
                               dh_->data(), /*accumulate_dx=*/false, std::move(dgain));
}

absl::StatusOr<MicroBatchLosses> MoeLmModel::ForwardBackward(const TokenBatch& batch,
                                                             const losses::StepStats& stats,
                                                             int micro_index,
                                                             losses::StepDisplay* display) {
  const MoeLmConfig& m = spec_.config();
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  GRADSUM_RETURN_IF_ERROR(CheckTokenBatch(batch, m.vocab));
  MicroBatchInputs in;
  GRADSUM_ASSIGN_OR_RETURN(in.ce_weights, MicroBatchTokenWeights(stats, micro_index, T));
  in.rows = T;
  in.row_block = params_->RowBlock(batch.seq_len);
  if (in.row_block > 0 && (batch.seq_len < 1 || int64_t{batch.sequences} * batch.seq_len != T)) {
    return absl::InvalidArgumentError(absl::StrCat("per-sequence row blocks: micro-batch of ", T,
                                                   " tokens is not ", batch.sequences,
                                                   " sequences of ", batch.seq_len));
  }
  in.tokens = batch.tokens;
  in.labels = batch.labels;
  in.mask = batch.mask;
  in.global_ce_weight_sum = stats.global_ce_weight_sum;
  in.global_routed_tokens = stats.global_routed_tokens;
  in.num_micro_batches = stats.num_micro_batches;
  GRADSUM_RETURN_IF_ERROR(EnsureActivations(T));

  absl::StatusOr<MicroBatchLossTerms> terms = [&]() -> absl::StatusOr<MicroBatchLossTerms> {
    GRADSUM_RETURN_IF_ERROR(ops_->Begin(in));
    StageFns stages;
    stages.forward = [this](int s) { return Forward(s); };
    stages.backward = [this](int s) { return Backward(s); };
    GRADSUM_RETURN_IF_ERROR(
        params_->RunMicroBatch(stages, micro_index == stats.num_micro_batches - 1));
    return ops_->End();
  }();
  if (!terms.ok()) {
    ops_->Abandon();
    return terms.status();
  }
  if (display != nullptr) {
    for (int l = 0; l < m.layers; ++l) {
      GRADSUM_RETURN_IF_ERROR(display->AddGlobalExpertCounts(l, terms->global_expert_counts[l]));
    }
    for (const auto& [name, values] : {std::pair<const char*, const std::vector<double>*>{
                                           "ce", &terms->ce_terms},
                                       {"z", &terms->z_terms},
                                       {"bal", &terms->bal_terms}}) {
      for (double v : *values) GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm(name, v));
    }
  }
  MicroBatchLosses result;
  result.ce = terms->ce;
  result.z = terms->z;
  result.bal = terms->bal;
  return result;
}

}  // namespace gradsum::model
