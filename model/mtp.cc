#include "model/mtp.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "model/moe_lm.h"

namespace gradsum::model {

MtpBlock::MtpBlock(const MoeLmSpec* spec, ModelOps* ops, ModelParams* params)
    : spec_(spec), ops_(ops), params_(params), depths_(spec->config().mtp_depth) {}

std::vector<std::string> MtpBlock::DisplayTerms(const MoeLmConfig& config) {
  std::vector<std::string> names;
  for (int j = 1; j <= config.mtp_depth; ++j) names.push_back(absl::StrCat("mtp_", j));
  return names;
}

absl::Status MtpBlock::RegisterDisplayTerms(const MoeLmConfig& config,
                                            losses::StepDisplay* display) {
  for (const std::string& name : DisplayTerms(config)) {
    GRADSUM_RETURN_IF_ERROR(display->RegisterTerm(name));
  }
  return absl::OkStatus();
}

absl::Status MtpBlock::AddDisplayTerms(const MicroBatchLossTerms& terms,
                                       losses::StepDisplay* display) const {
  for (int j = 1; j <= depths_; ++j) {
    for (double v : terms.extra_ce_terms[j - 1]) {
      GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm(absl::StrCat("mtp_", j), v));
    }
  }
  return absl::OkStatus();
}

// §15.1: depth j's shifted tokens, labels, weights and normaliser D_j * k / mtp_scale.
absl::Status MtpBlock::AddInputs(const TokenBatch& batch, const losses::StepStats& stats,
                                 int micro_index, MicroBatchInputs* in) const {
  const MoeLmConfig& m = spec_->config();
  const int k = depths_;
  if (k == 0) return absl::OkStatus();
  const int64_t T = in->rows;
  if (static_cast<int>(stats.global_stream_weight_sums.size()) != k ||
      static_cast<int>(batch.extra_streams.size()) != k) {
    return absl::InvalidArgumentError(
        absl::StrCat("mtp_depth=", k, ": the micro-batch needs every depth's label stream (",
                     batch.extra_streams.size(), ") and the step's statistics of them (",
                     stats.global_stream_weight_sums.size(), " streams)"));
  }
  for (int j = 0; j < k; ++j) {
    const TokenBatch::Stream& stream = batch.extra_streams[j];
    if (static_cast<int64_t>(stream.labels.size()) != T ||
        static_cast<int64_t>(stream.tokens.size()) != T) {
      return absl::InvalidArgumentError(absl::StrCat("MTP depth ", j + 1,
                                                     ": no labels or shifted tokens for the ", T,
                                                     " tokens of micro-batch ", micro_index));
    }
    for (int64_t t = 0; t < T; ++t) {
      if (stream.tokens[t] < 0 || stream.tokens[t] >= m.vocab) {
        return absl::InvalidArgumentError(absl::StrCat("MTP depth ", j + 1, ": token ",
                                                       stream.tokens[t], " at position ", t,
                                                       " outside [0, ", m.vocab, ")"));
      }
    }
    MicroBatchInputs::Stream s;
    s.tokens = stream.tokens;
    s.labels = stream.labels;
    s.ce_normaliser = stats.global_stream_weight_sums[j] * k / m.mtp_scale;
    if (stats.mode != losses::CeWeightMode::kToken) {
      if (static_cast<int>(stats.stream_token_weights.size()) != k ||
          micro_index >= static_cast<int>(stats.stream_token_weights[j].size()) ||
          static_cast<int64_t>(stats.stream_token_weights[j][micro_index].size()) != T) {
        return absl::InvalidArgumentError(
            absl::StrCat("MTP depth ", j + 1, ": no CE weights for micro-batch ", micro_index, " (",
                         losses::CeWeightModeName(stats.mode), " mode)"));
      }
      s.ce_weights = stats.stream_token_weights[j][micro_index];
    }
    in->extra_streams.push_back(s);
  }
  return absl::OkStatus();
}

absl::Status MtpBlock::Allocate(int64_t T) {
  const int64_t D = spec_->config().dim;
  auto alloc = [&](Array& a, int64_t n) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(a, ops_->Allocate(n));
    return absl::OkStatus();
  };
  rows_ = 0;
  acts_.clear();
  acts_.resize(depths_);
  for (Acts& x : acts_) {
    for (Array* a : {&x.e, &x.nh, &x.ne, &x.in, &x.out, &x.dout, &x.de}) {
      GRADSUM_RETURN_IF_ERROR(alloc(*a, T * D));
    }
    GRADSUM_RETURN_IF_ERROR(alloc(x.rh, T));
    GRADSUM_RETURN_IF_ERROR(alloc(x.re, T));
  }
  rows_ = T;
  return absl::OkStatus();
}

int64_t MtpBlock::floats() const {
  int64_t n = 0;
  for (const Acts& x : acts_) {
    for (const Array* a : {&x.e, &x.nh, &x.rh, &x.ne, &x.re, &x.in, &x.out, &x.dout, &x.de}) {
      if (*a != nullptr) n += (*a)->size();
    }
  }
  return n;
}

absl::Status MtpBlock::EmbeddingForward() {
  for (int j = 1; j <= depths_; ++j) {
    GRADSUM_RETURN_IF_ERROR(
        ops_->EmbeddingForward(j, params_->Values(spec_->emb()), acts_[j - 1].e->data()));
  }
  return absl::OkStatus();
}

absl::Status MtpBlock::EmbeddingBackward() {
  for (int j = 1; j <= depths_; ++j) {
    GRADSUM_ASSIGN_OR_RETURN(GradTarget demb_j, params_->Grad(spec_->emb()));
    GRADSUM_RETURN_IF_ERROR(ops_->EmbeddingBackward(j, acts_[j - 1].de->data(), std::move(demb_j)));
  }
  return absl::OkStatus();
}

// h'_j = RMSNorm(h^{j-1}; g^h_j) M^h_j + RMSNorm(e_j; g^e_j) M^e_j.
absl::Status MtpBlock::ProjectForward(int j, const float* h_last, float* scratch) {
  const MoeLmSpec& spec = *spec_;
  const int64_t D = spec.config().dim;
  Acts& x = acts_[j - 1];
  const float* prev = j == 1 ? h_last : acts_[j - 2].out->data();
  GRADSUM_RETURN_IF_ERROR(
      ops_->RmsNormForward(prev, params_->Values(spec.mtp_hnorm(j)), x.nh->data(), x.rh->data()));
  GRADSUM_RETURN_IF_ERROR(ops_->RmsNormForward(x.e->data(), params_->Values(spec.mtp_enorm(j)),
                                               x.ne->data(), x.re->data()));
  GRADSUM_RETURN_IF_ERROR(
      ops_->MatMul(x.nh->data(), params_->Values(spec.mtp_proj_h(j)), D, D, x.in->data()));
  GRADSUM_RETURN_IF_ERROR(
      ops_->MatMul(x.ne->data(), params_->Values(spec.mtp_proj_e(j)), D, D, scratch));
  return ops_->Add(x.in->data(), scratch, x.in->data(), rows_ * D);
}

// dout holds dL/dh'_j; afterwards dL/dh^{j-1} has been added into depth j - 1's dout (or
// dh_last for h_L), and de holds dL/de_j.
absl::Status MtpBlock::ProjectBackward(int j, const float* h_last, float* dh_last, float* scratch) {
  const MoeLmSpec& spec = *spec_;
  const int64_t D = spec.config().dim;
  Acts& x = acts_[j - 1];
  // The embedding half: dL/dne into scratch, then its norm into de.
  GRADSUM_ASSIGN_OR_RETURN(GradTarget dwe, params_->Grad(spec.mtp_proj_e(j)));
  GRADSUM_RETURN_IF_ERROR(ops_->MatMulBackward(x.ne->data(), params_->Values(spec.mtp_proj_e(j)), D,
                                               D, x.dout->data(), scratch,
                                               /*accumulate_dx=*/false, std::move(dwe)));
  GRADSUM_ASSIGN_OR_RETURN(GradTarget dge, params_->Grad(spec.mtp_enorm(j)));
  GRADSUM_RETURN_IF_ERROR(ops_->RmsNormBackward(x.e->data(), params_->Values(spec.mtp_enorm(j)),
                                                x.re->data(), scratch, x.de->data(),
                                                /*accumulate_dx=*/false, std::move(dge)));
  // The hidden half: dL/dnh into scratch, then its norm added into dL/dh^{j-1}.
  GRADSUM_ASSIGN_OR_RETURN(GradTarget dwh, params_->Grad(spec.mtp_proj_h(j)));
  GRADSUM_RETURN_IF_ERROR(ops_->MatMulBackward(x.nh->data(), params_->Values(spec.mtp_proj_h(j)), D,
                                               D, x.dout->data(), scratch,
                                               /*accumulate_dx=*/false, std::move(dwh)));
  const bool first = j == 1;
  const float* prev = first ? h_last : acts_[j - 2].out->data();
  float* dprev = first ? dh_last : acts_[j - 2].dout->data();
  GRADSUM_ASSIGN_OR_RETURN(GradTarget dgh, params_->Grad(spec.mtp_hnorm(j)));
  return ops_->RmsNormBackward(prev, params_->Values(spec.mtp_hnorm(j)), x.rh->data(), scratch,
                               dprev, /*accumulate_dx=*/true, std::move(dgh));
}

// Each h^j through the same final norm and head, with stream j's labels and normaliser;
// dL/dh^j starts depth j's dout.
absl::Status MtpBlock::HeadForwardBackward(float* f, float* inv_rms_f, float* grad_f) {
  const MoeLmSpec& spec = *spec_;
  const float* gain = params_->Values(spec.final_norm());
  for (int j = 1; j <= depths_; ++j) {
    Acts& x = acts_[j - 1];
    GRADSUM_RETURN_IF_ERROR(ops_->RmsNormForward(x.out->data(), gain, f, inv_rms_f));
    GRADSUM_ASSIGN_OR_RETURN(GradTarget grad_out_j, params_->Grad(spec.out()));
    GRADSUM_RETURN_IF_ERROR(
        ops_->LmHeadCrossEntropy(j, f, params_->Values(spec.out()), grad_f, std::move(grad_out_j)));
    GRADSUM_ASSIGN_OR_RETURN(GradTarget dgain_j, params_->Grad(spec.final_norm()));
    GRADSUM_RETURN_IF_ERROR(ops_->RmsNormBackward(x.out->data(), gain, inv_rms_f, grad_f,
                                                  x.dout->data(),
                                                  /*accumulate_dx=*/false, std::move(dgain_j)));
  }
  return absl::OkStatus();
}

}  // namespace gradsum::model
