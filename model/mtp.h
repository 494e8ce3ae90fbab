#ifndef GRADSUM_MODEL_MTP_H_
#define GRADSUM_MODEL_MTP_H_

// Multi-token prediction (SEMANTICS.md §15.1), the model's block: the k depths that
// MoeLmModel (model/moe_lm.h) composes between its main layers and its head. This file owns
// what MTP adds; the rest of the program sees only label streams (data/streams.h: depth j
// trains on stream j), the spec's extra MoE layers and blocks (model/moe_lm_spec.h) and
// display terms:
//   - its inputs: stream j's shifted tokens x_j and labels y_j, its CE weights and the
//     normaliser D_j * k / mtp_scale its CE divides by (D_j: the step statistics' stream j);
//   - in stage 0, e_j = Emb[x_j];
//   - depth j's projection block h'_j = RMSNorm(h^{j-1}; g^h_j) M^h_j + RMSNorm(e_j; g^e_j)
//     M^e_j (h^0 = h_L), whose output the model runs through MoE layer L + j - 1 into h^j;
//   - in the head stage, each h^j through the shared final norm and LM head with stream j's
//     CE, and the display terms "mtp_1" .. "mtp_k".
//
//   MtpBlock mtp(&spec, ops, params);          // none of them owned
//   GRADSUM_RETURN_IF_ERROR(mtp.Allocate(T));
//   ... mtp.EmbeddingForward(); per depth ProjectForward(j, h_L, scratch), then its layer
//   on input(j) into output(j); HeadForwardBackward(...); and the backward in reverse.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "losses/display.h"
#include "losses/step_stats.h"
#include "model/model_params.h"
#include "model/moe_lm_spec.h"
#include "model/ops.h"

namespace gradsum::model {

struct TokenBatch;  // model/moe_lm.h

class MtpBlock {
 public:
  MtpBlock() = default;
  // None owned; each must outlive the block.
  MtpBlock(const MoeLmSpec* spec, ModelOps* ops, ModelParams* params);

  // k (0: the model has no MTP).
  int depths() const { return depths_; }

  // "mtp_1" .. "mtp_k" for a model of `config`, and their registration.
  static std::vector<std::string> DisplayTerms(const MoeLmConfig& config);
  static absl::Status RegisterDisplayTerms(const MoeLmConfig& config, losses::StepDisplay* display);
  // Adds each depth's display values (MicroBatchLossTerms::extra_ce_terms) to its term.
  absl::Status AddDisplayTerms(const MicroBatchLossTerms& terms,
                               losses::StepDisplay* display) const;

  // Fills in->extra_streams for micro-batch `micro_index` of `batch` (one stream per depth,
  // from the step statistics' streams). InvalidArgument naming the depth: a stream missing or
  // of another length, a shifted token outside [0, vocab), CE weights missing outside token
  // mode.
  absl::Status AddInputs(const TokenBatch& batch, const losses::StepStats& stats, int micro_index,
                         MicroBatchInputs* in) const;

  // Sizes the depths' arrays for T tokens; their floats.
  absl::Status Allocate(int64_t T);
  int64_t floats() const;

  // Stage 0: e_j = Emb[x_j] for every depth, and the backward's scatter-adds of dL/de_j.
  absl::Status EmbeddingForward();
  absl::Status EmbeddingBackward();

  // Depth j's (1-based) projection block into input(j); `h_last` is h_L; `scratch` [T, D].
  absl::Status ProjectForward(int j, const float* h_last, float* scratch);
  // Its backward, with grad(j) holding dL/dh'_j: the weight gradients, dL/de_j kept for
  // EmbeddingBackward, and dL/dh^{j-1} added into depth j - 1's grad (into `dh_last` for j =
  // 1). `scratch` [T, D].
  absl::Status ProjectBackward(int j, const float* h_last, float* dh_last, float* scratch);

  // Depth j's MoE layer reads input(j) and writes output(j); its backward reads dL/dh^j from
  // grad(j) and leaves dL/dh'_j there.
  float* input(int j) { return acts_[j - 1].in->data(); }
  float* output(int j) { return acts_[j - 1].out->data(); }
  float* grad(int j) { return acts_[j - 1].dout->data(); }

  // The head stage's part: each h^j through the final norm and LM head with stream j's CE,
  // forward and backward; dL/dh^j starts grad(j). f, inv_rms_f, grad_f: the head's arrays.
  absl::Status HeadForwardBackward(float* f, float* inv_rms_f, float* grad_f);

 private:
  const MoeLmSpec* spec_ = nullptr;
  ModelOps* ops_ = nullptr;
  ModelParams* params_ = nullptr;
  int depths_ = 0;
  int64_t rows_ = 0;
  // Depth j's arrays (index j - 1), all kept from forward to backward: e = Emb[x_j]; its
  // normed inputs nh, ne and their 1/rms; in = h'_j; out = h^j; dout = dL/dh^j (then
  // dL/dh'_j); de = dL/de_j, kept for the embedding stage's backward.
  using Array = std::unique_ptr<DeviceArray>;
  struct Acts {
    Array e, nh, rh, ne, re, in, out, dout, de;
  };
  std::vector<Acts> acts_;
};

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_MTP_H_
