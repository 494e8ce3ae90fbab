#ifndef GRADSUM_MODEL_MOE_LM_H_
#define GRADSUM_MODEL_MOE_LM_H_

// The moe_lm model (SEMANTICS.md §10), forward and backward of one micro-batch, written
// once for every device: the stages of MoeLmSpec composed from one device's ops
// (model/ops.h) over parameters it reads and writes through ModelParams (sharded or not,
// on whichever device: parallel/parallelize.h decides).
//
//   stage 0       h_0 = Emb[x]
//   stage 1 + l   attention block: b_l = RMSNorm(h_l; g^attn_l); q, k, v = b_l Wq, Wk, Wv;
//                 RoPE; tokens -> heads; document-causal attention; heads -> tokens
//                 (the exchanges and the ring across ranks: model/parallel_attention.h);
//                 m_l = h_l + o Wo   (m_l = h_l without attention)
//                 MoE block: a_l = RMSNorm(m_l; g_l); h_{l+1} = m_l + MoE_l(a_l)
//   (stage 0 also embeds each MTP depth's shifted tokens e_j = Emb[x_j], §15.1)
//   stage L + j   MTP depth j (of k >= 1):       h'_j = RMSNorm(h^{j-1}; g^h_j) M^h_j +
//                 RMSNorm(e_j; g^e_j) M^e_j, h^j = layer L + j - 1 on h'_j (h^0 = h_L)
//   stage L+k+1   f = RMSNorm(h_L; g_f); CE(f @ Wo) forward and backward; RMSNorm backward;
//                 the same for each h^j with depth j's labels and normaliser
//   backward of stage 1 + l: the router losses (§4, §5), MoE backward, RMSNorm backward
//   backward of stage 0: the embedding's scatter-add
//
//   GRADSUM_ASSIGN_OR_RETURN(auto model, MoeLmModel::Create(spec, &params, std::move(ops)));
//   for (int m = 0; m < G; ++m) {
//     GRADSUM_ASSIGN_OR_RETURN(MicroBatchLosses l,
//                              model->ForwardBackward(batch[m], stats, m, &display));
//   }
//
// Each rank back-propagates only its own loss components (§2): the CE is divided by the
// global weight sum D, the z-loss by the global routed count N, the balancing loss uses
// the global expert counts; nothing divides by the world, EP size or G.
//
// Thread safety: one model per rank, used by that rank's thread.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "losses/display.h"
#include "losses/step_stats.h"
#include "model/model_params.h"
#include "model/moe_lm_spec.h"
#include "model/mtp.h"
#include "model/ops.h"
#include "model/parallel_attention.h"

namespace gradsum::model {

// One rank's micro-batch (host memory): `sequences` packed sequences of `seq_len` tokens,
// of which the rank holds `local_seq_len` consecutive tokens each (seq_len / S with
// sequence parallelism, SEMANTICS.md §12; seq_len without), T = sequences * local_seq_len.
struct TokenBatch {
  int sequences = 0;
  int seq_len = 0;
  int local_seq_len = 0;
  absl::Span<const int32_t> tokens;  // [T] in [0, V); padding 0
  absl::Span<const int32_t> labels;  // [T] next token or ignore_index
  absl::Span<const int32_t> mask;    // [T] 1 routed, 0 padding
  // Attention only (model/ops.h MicroBatchInputs): the RoPE position of each local token,
  // and the document start of every token of the whole sequences (-1: padding).
  absl::Span<const int32_t> positions;  // [T]
  absl::Span<const int32_t> doc_start;  // [sequences * seq_len]
  // Label streams 1 .. MoeLmSpec::label_streams() - 1 (data/streams.h), stream j at index
  // j - 1, as the loader rolled them on the whole sequences: each local token's input token
  // x_j and label y_j [T]. None for an evaluation.
  struct Stream {
    absl::Span<const int32_t> tokens;
    absl::Span<const int32_t> labels;
  };
  std::vector<Stream> extra_streams;
};

// One micro-batch's local loss components (detached, §8). z_out: the output z-loss of
// §3.2 (alpha_lse > 0; 0 otherwise), which `ce` then excludes.
struct MicroBatchLosses {
  double ce = 0, z = 0, bal = 0, z_out = 0;
  // Per extra label stream j (index j - 1): its head's local component (MTP depth j's
  // mtp_scale / k * CE_j, model/mtp.h).
  std::vector<double> extra_ce;
};

// InvalidArgument unless tokens, labels and mask have one length and every token is in
// [0, vocab) (naming the first bad token and its position). Labels are the CE's to check.
absl::Status CheckTokenBatch(const TokenBatch& batch, int64_t vocab);

// The CE weights w_t (§3) of micro-batch `micro_index` with `tokens` tokens: empty in token
// mode (w_t = 1 for valid tokens), else stats.token_weights[micro_index]. InvalidArgument
// for a micro_index outside [0, G) or weights of another length.
absl::StatusOr<absl::Span<const float>> MicroBatchTokenWeights(const losses::StepStats& stats,
                                                               int micro_index, int64_t tokens);

// Activation recomputation (docs/SEMANTICS.md §14): what each layer keeps from its forward
// for its backward. Results are bit-identical in every mode; only memory and time differ.
enum class Recompute {
  kNone,       // every activation of every layer kept
  kSelective,  // the matmul, attention and expert outputs kept; the two RMSNorms' outputs
               // re-run in backward (SwiGLU is re-run by the expert kernels in every mode)
  kFull,       // only each layer's input h_l kept; its whole forward re-run in backward,
               // with the routing decisions and counts of the first forward
};

// "none", "selective", "full".
const char* RecomputeName(Recompute r);

// The per-layer expert bias of SEMANTICS.md §5.1, [L][E] fp32.
using ExpertBias = std::vector<std::vector<float>>;

class MoeLmModel {
 public:
  // `params` is not owned and must outlive the model. `attention`: where attention crosses
  // ranks (model/parallel_attention.h; default: one rank holds whole sequences). InvalidArgument
  // for a null argument or params whose experts do not divide the spec's, and
  // ParallelAttention::Create's errors; Unimplemented for Recompute::kFull on ops that cannot
  // re-run a MoE layer (ModelOps::CanRecomputeMoe).
  static absl::StatusOr<std::unique_ptr<MoeLmModel>> Create(
      const MoeLmSpec& spec, ModelParams* params, std::unique_ptr<ModelOps> ops,
      Recompute recompute = Recompute::kNone, const ParallelAttentionOptions& attention = {});

  // Forward and backward of one micro-batch of this rank. `stats` are the step's global
  // statistics (D, N, in sample / square mode the CE weights of every micro-batch, and each
  // extra label stream's D_j and weights, losses/step_stats.h; InvalidArgument when the batch
  // or the statistics miss a stream the model trains on); `micro_index` in [0, G) picks this
  // micro-batch's weights, and G - 1 marks the last. With MTP its display terms are added
  // too (model/mtp.h). Adds the local gradients through ModelParams (which reduces them as they
  // complete) and the loss components and expert counts into `display` (may be null; terms "ce",
  // "z", "bal", and "z_out" when alpha_lse > 0). Collective over the EP group and the world.
  // Errors: a bad batch as InvalidArgument (CheckTokenBatch); the ops' and the
  // parameters' errors as they are.
  absl::StatusOr<MicroBatchLosses> ForwardBackward(const TokenBatch& batch,
                                                   const losses::StepStats& stats, int micro_index,
                                                   losses::StepDisplay* display);

  // An evaluation of one micro-batch (held-out data): the forward (without the extra
  // streams' blocks) and the main head's CE with §3.2's options, no backward, no gradient, nothing
  // reduced; its counts move no expert bias. `stats` are the evaluation's own (its D).
  // Adds "ce" (and "z_out" with alpha_lse > 0) into `display` (may be null; registered by
  // the caller). Collective over the EP group and the world, as ForwardBackward.
  absl::StatusOr<MicroBatchLosses> Evaluate(const TokenBatch& batch, const losses::StepStats& stats,
                                            int micro_index, losses::StepDisplay* display);

  // Registers the display terms a model of `config` adds: "ce", "z", "bal", with
  // alpha_lse > 0 "z_out", the output z-loss of SEMANTICS.md §3.2 (then not in "ce"), and
  // MTP's (model/mtp.h). With alpha_lse = 0 and no MTP the registry, and so every display
  // value, is as before the options.
  static absl::Status RegisterDisplayTerms(const MoeLmConfig& config, losses::StepDisplay* display);
  // Of those, the terms of the heads of the label streams beyond the main one, in stream
  // order (MTP's, model/mtp.h).
  static std::vector<std::string> ExtraStreamTerms(const MoeLmConfig& config) {
    return MtpBlock::DisplayTerms(config);
  }

  const MoeLmSpec& spec() const { return spec_; }

  // ---- The expert bias (SEMANTICS.md §5.1): model state, not a parameter. ----
  // [L][E], or empty when the model holds none (expert_bias_speed = 0 and none was set):
  // routing is then §10's. With expert_bias_speed > 0 it starts at 0.
  const ExpertBias& expert_bias() const { return expert_bias_; }
  // Sets it (a checkpoint's, or an --init_from file's): [L][E] finite values, or empty for
  // none (zeros when expert_bias_speed > 0). InvalidArgument naming the shape or the value.
  absl::Status SetExpertBias(ExpertBias bias);
  // The step's end, once per optimizer step after its last ForwardBackward: b[l][e] +=
  // u * sign(mean_e c[l, e] - c[l, e]) with c the global counts of the step's training
  // forwards (each ForwardBackward's, summed; a recomputation adds none), then the counts
  // restart. Nothing collective: every rank has the same counts. A no-op when u = 0.
  void UpdateExpertBias();

  // The most activation bytes held at once since the last call, and resets it: the
  // DeviceArrays this model keeps between micro-batches (their sizes) plus what the ops
  // hold (ModelOps::HeldActivationBytes), sampled after every stage's forward and
  // backward of every micro-batch.
  int64_t TakePeakActivationBytes();
  // The most bytes the LM head's CE held inside one call since the last call, and resets
  // it (ModelOps::TakePeakHeadScratchBytes): not among the activation bytes above.
  int64_t TakePeakHeadScratchBytes() { return ops_->TakePeakHeadScratchBytes(); }

 private:
  MoeLmModel() = default;
  // Sizes the activations for `tokens` tokens (kept from one micro-batch to the next).
  absl::Status EnsureActivations(int64_t tokens);
  // Samples the activation bytes held now into peak_activation_bytes_.
  void NoteActivationBytes();
  absl::Status Forward(int stage);
  // An evaluation's stage: the forward without MTP, the head's loss without backward.
  absl::Status EvalForward(int stage);
  // What ops.Begin gets for `batch` (checked); forward_only: an evaluation's (no MTP).
  absl::StatusOr<MicroBatchInputs> Inputs(const TokenBatch& batch, const losses::StepStats& stats,
                                          int micro_index, bool forward_only);
  absl::Status Backward(int stage);
  absl::Status LayerForward(int layer);
  absl::Status LayerBackward(int layer);
  // Layer l's forward up to the MoE block's input (LayerForward and LayerRecompute).
  absl::Status LayerForwardToMoeInput(int layer);
  // Layer l's forward without the residual's output (full recomputation, in backward).
  absl::Status LayerRecompute(int layer);
  // What enters layer l's MoE block (its RMSNorm and residual): m_l = h_l + attention, or
  // h_l without attention.
  float* MoeBlockInput(int l) {
    return spec_.config().attention ? attn_[KeptSlot(l)].m->data() : LayerInput(l);
  }
  absl::Status AttentionForward(int layer);
  absl::Status AttentionBackward(int layer);
  // Which arrays hold layer l's activations: its own (kept), or the one working set that
  // every layer shares (re-run in backward). Norm outputs are re-run unless kNone.
  int KeptSlot(int l) const { return recompute_ == Recompute::kFull ? 0 : l; }
  int NormSlot(int l) const { return recompute_ == Recompute::kNone ? l : 0; }
  absl::Status HeadForwardBackward();
  MoeWeights LayerWeights(int layer);
  // MTP depth j's stage (L + j): its projection block (model/mtp.h), then its layer, run
  // by LayerForward / LayerBackward as MoE layer L + j - 1; and the backward.
  absl::Status MtpForward(int j);
  absl::Status MtpBackward(int j);
  // A layer's input and output arrays: h_l and h_{l+1} for a main layer, h'_j and h^j for
  // MTP depth j's (l = L + j - 1); and the array its backward reads dL/d(output) from and
  // leaves dL/d(input) in (dh_, or depth j's).
  float* LayerInput(int l);
  float* LayerOutput(int l);
  float* LayerGrad(int l);

  MoeLmSpec spec_;
  ModelParams* params_ = nullptr;
  std::unique_ptr<ModelOps> ops_;
  // Declared after ops_: destroyed first (it holds arrays of ops_ and a pointer to it).
  std::unique_ptr<ParallelAttention> attention_;
  Recompute recompute_ = Recompute::kNone;
  // §5.1: the bias [L][E] (empty: none), and the step's global counts so far [L][E].
  ExpertBias expert_bias_;
  std::vector<std::vector<int64_t>> step_expert_counts_;

  // Activations in the device's memory, kept across micro-batches.
  using Array = std::unique_ptr<DeviceArray>;
  int64_t rows_ = -1;        // the T they are sized for
  int64_t array_bytes_ = 0;  // the bytes of the arrays below (their sizes)
  int64_t peak_activation_bytes_ = 0;
  std::vector<Array> h_;          // [L + 1] x [T, D]: h_[l] enters layer l, h_[L] the head
  std::vector<Array> a_;          // [L or 1] x [T, D]: the normed input of the MoE (NormSlot)
  std::vector<Array> inv_rms_;    // [L or 1] x [T]
  Array y_, dh_, da_;             // [T, D]: a block's output; dL/dh; dL/da
  Array f_, inv_rms_f_, grad_f_;  // the head: [T, D], [T], [T, D]
  // The attention block, per layer (kept for backward, KeptSlot): q, k, v and the output
  // per query head in the head split (T * D floats each at any S), the softmax statistics,
  // the output in the token split, and m = h + attention; and per NormSlot the normed
  // input b and its 1/rms.
  struct AttentionActs {
    Array qh, kh, vh, oh, lse, o, m;
  };
  struct NormActs {
    Array b, inv_rms;
  };
  std::vector<AttentionActs> attn_;
  std::vector<NormActs> attn_norm_;
  // The MTP depths' block and arrays (model/mtp.h).
  MtpBlock mtp_;
  // Attention scratch: q [T, D], k and v [T, kv_dim] in the token split; the head-split
  // output gradient and the per-query-head gradients of q, k, v.
  Array q_, k_, v_, doh_, dqh_, dkh_, dvh_, dkq_, dvq_;
};

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_MOE_LM_H_
