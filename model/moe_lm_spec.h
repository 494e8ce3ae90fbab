#ifndef GRADSUM_MODEL_MOE_LM_SPEC_H_
#define GRADSUM_MODEL_MOE_LM_SPEC_H_

// The moe_lm model of SEMANTICS.md §10 as data, written once for every device and every
// parallelism: its sizes, every parameter (name, shape, initialisation, the layer and expert
// it belongs to) and the stages of its forward pass with the parameters each reads.
//
//   GRADSUM_ASSIGN_OR_RETURN(MoeLmSpec spec, MoeLmSpec::Create(config));
//   NamedParams init = spec.InitialParameters(seed);   // the same on every rank and device
//   for (const ParamDef& p : spec.params()) ...        // names of the dumps and checkpoints
//
// Who reads it:
// - parallel/parallelize.h groups the parameters into sharded units (the wrap policy and
//   the EP placement are parallelism, not model);
// - model/moe_lm.h runs the stages over one device's ops (model/ops.h);
// - the trainer's dumps, exports, --init_from and the parity check name parameters by it.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "losses/ce_options.h"

namespace gradsum::model {

// Full parameter (or gradient) values by name, row-major fp32.
using NamedParams = std::map<std::string, std::vector<float>>;

// SEMANTICS.md §10's sizes (names of the spec in brackets).
struct MoeLmConfig {
  int64_t vocab = 256;       // [V]
  int64_t dim = 128;         // [D] residual width
  int layers = 2;            // [L] MoE layers
  int experts = 8;           // [E] experts per layer
  int top_k = 2;             // [K] experts per routed token
  int64_t expert_dim = 128;  // [H] SwiGLU hidden width
  bool norm_topk_prob = true;
  float router_scale = 1.0f;
  float init_std = 0.1f;  // matrices ~ N(0, init_std^2)
  // The attention block of each layer (§10); false: the per-token model (no attention).
  bool attention = false;
  int n_heads = 4;              // query heads; head_dim = dim / n_heads (even)
  int n_kv_heads = 4;           // key/value heads (GQA), divides n_heads
  double rope_theta = 10000.0;  // RoPE base
  // The loss weights of the router z-loss (§4) and the balancing loss (§5); 0 disables.
  double alpha_z = 0.001;
  double alpha_b = 0.001;
  // The LM head's CE options (§3.2, losses/ce_options.h); 0 = off, the defaults, which
  // leave the CE bit-identical to the plain one.
  losses::CeOptions ce;
  // Aux-loss-free balancing (§5.1): sigmoid router scores instead of softmax (needs
  // alpha_b = 0), and the expert bias's update speed u per step (0 = off, the default: no
  // bias is held unless one is set, and routing is §10's bit for bit).
  bool router_sigmoid = false;
  double expert_bias_speed = 0.0;
  // Multi-token prediction (SEMANTICS.md §15.1): k depths, each a block on
  // [RMSNorm(h); RMSNorm(Emb(x shifted))] and one layer of the model's kind, sharing the
  // embedding, final norm and head; its loss weighs mtp_scale / k per depth. 0 = off.
  int mtp_depth = 0;
  double mtp_scale = 0.1;
};

// How attention's heads fall on each rank of an SP group of `sp` ranks (Ulysses, §12): each
// head's width, the query heads a rank holds, and the query heads per kv head (GQA). Zeros
// (group 1) for a model without attention. Every device's ops lay out heads by it.
struct HeadLayout {
  int64_t head_dim = 0, heads_local = 0;
  int group = 1;
};
HeadLayout HeadLayoutOf(const MoeLmConfig& m, int sp);

// The MoE layer's sizes and routing from the model's config, into a layer config
// (moe/moe_block.h MoeLayerConfig; model/moe_block_ops.h MoeLayerConfigOf adds the score).
template <typename LayerConfig>
void SetMoeLayerShape(const MoeLmConfig& m, LayerConfig* c) {
  c->d_model = m.dim;
  c->hidden = m.expert_dim;
  c->num_experts = m.experts;
  c->top_k = m.top_k;
  c->norm_topk_prob = m.norm_topk_prob;
  c->router_scale = m.router_scale;
}

// How a parameter starts (InitialParameters).
enum class ParamInit {
  kOnes,          // norm gains
  kNormal,        // N(0, 1): the embedding
  kScaledNormal,  // N(0, init_std^2): every matrix
};

// An expert's three matrices, in the order moe/experts.h stacks them.
enum class ExpertMatrix { kGate = 0, kUp = 1, kDown = 2 };
inline constexpr int kNumExpertMatrices = 3;

struct ParamDef {
  std::string name;  // "emb", "layers.{l}.norm", "layers.{l}.experts.{e}.wg", "mtp.{j}.proj_h", ...
  std::vector<int64_t> shape;
  ParamInit init = ParamInit::kScaledNormal;
  int layer = -1;   // its MoE layer (L + j - 1 for MTP depth j's), -1 for emb, final_norm, out
  int expert = -1;  // its expert, -1 for dense parameters (the same on every rank)
  ExpertMatrix matrix = ExpertMatrix::kGate;  // for expert parameters
  int64_t numel() const;
};

// The stages of one micro-batch, in forward order: the shared schedule gathers and frees
// parameter units around them (parallel/unit_schedule.h). The last stage is the turn
// stage: its forward also runs its backward (the head's fused CE). The embedding stage also
// looks up the MTP depths' shifted tokens; MTP depth j's stage (kMtp) is its projection block
// and its layer, MoE layer L + j - 1; the head also runs the MTP depths' CE.
enum class StageKind { kEmbedding, kLayer, kHead, kMtp };
struct StageDef {
  StageKind kind = StageKind::kEmbedding;
  int layer = -1;                     // kLayer and kMtp (its MoE layer, L + j - 1)
  bool backward_reads_params = true;  // the embedding's backward is a scatter-add
};

// The model's counts that the code around it needs without knowing which block adds them
// (the FLOP count, the ops, the trainer): MoE layers (the L main ones, then one per extra
// block), label streams (stream 0, then one per MTP depth, data/streams.h), and the
// weights of the extra blocks' dense projections (each a [2D, D] matrix, as two [D, D]
// halves), which every token multiplies once per forward.
inline int MoeLayersOf(const MoeLmConfig& m) { return m.layers + m.mtp_depth; }
inline int LabelStreamsOf(const MoeLmConfig& m) { return 1 + m.mtp_depth; }
inline int64_t ExtraBlockProjectionWeights(const MoeLmConfig& m) {
  return int64_t{m.mtp_depth} * 2 * m.dim * m.dim;
}

class MoeLmSpec {
 public:
  // InvalidArgument naming the field: a size <= 0, top_k > experts; with attention, heads
  // that do not divide (n_heads % n_kv_heads, dim % n_heads), an odd head_dim, or
  // rope_theta <= 1; mtp_depth < 0, mtp_scale outside (0, mtp_depth] or MTP with the
  // expert bias.
  static absl::StatusOr<MoeLmSpec> Create(const MoeLmConfig& config);
  MoeLmSpec() = default;

  const MoeLmConfig& config() const { return config_; }
  // Every parameter (emb; per layer: attn_norm, wq, wk, wv, wo when attention is on, then
  // norm, router, each expert's wg, wu, wd; final_norm; out; then per MTP depth j: hnorm,
  // enorm, proj_h, proj_e and its layer's as a layer's): the order of the dumps and of
  // InitialParameters' draws (so MTP leaves the main model's initial values unchanged).
  const std::vector<ParamDef>& params() const { return params_; }
  // Stage 0 the embedding, 1 + l layer l, 1 + L + j - 1 MTP depth j, L + k + 1 the head.
  const std::vector<StageDef>& stages() const { return stages_; }
  // The stage whose forward reads parameter `p` (an index into params()).
  int StageOf(int p) const;

  // head_dim = dim / n_heads (attention only).
  int64_t head_dim() const { return config_.dim / config_.n_heads; }

  // Indices into params() of the parameters the stages read. The attention block's
  // (attn_norm, wq, wk, wv, wo) exist only with config().attention.
  int emb() const { return 0; }
  int attn_norm(int layer) const { return layer_first_[layer]; }
  int wq(int layer) const { return layer_first_[layer] + 1; }
  int wk(int layer) const { return layer_first_[layer] + 2; }
  int wv(int layer) const { return layer_first_[layer] + 3; }
  int wo(int layer) const { return layer_first_[layer] + 4; }
  int norm(int layer) const { return moe_first_[layer]; }
  int router(int layer) const { return moe_first_[layer] + 1; }
  int expert_param(int layer, int expert, ExpertMatrix m) const {
    return moe_first_[layer] + 2 + expert * kNumExpertMatrices + static_cast<int>(m);
  }
  int final_norm() const { return final_norm_; }
  int out() const { return final_norm_ + 1; }
  // MTP depth j (1-based): its norms of h^{j-1} and of the shifted embedding, and the two
  // [D, D] halves of its [2D, D] projection; its layer is MoE layer mtp_layer(j).
  int mtp_hnorm(int j) const { return mtp_first_[j - 1]; }
  int mtp_enorm(int j) const { return mtp_first_[j - 1] + 1; }
  int mtp_proj_h(int j) const { return mtp_first_[j - 1] + 2; }
  int mtp_proj_e(int j) const { return mtp_first_[j - 1] + 3; }
  int mtp_layer(int j) const { return config_.layers + j - 1; }
  // MoE layers including the MTP depths': L + k.
  int moe_layers() const { return MoeLayersOf(config_); }
  // The label streams the model trains on (data/streams.h): stream 0, then stream j for MTP
  // depth j.
  int label_streams() const { return LabelStreamsOf(config_); }
  // The blocks between the main layers and the head, in stage order (MTP depth j's is
  // "mtp.{j}"): each one stage, whose dense parameters are `dense` and then its MoE layer
  // `layer`'s, as a main layer's.
  struct ExtraBlock {
    std::string name;
    std::vector<int> dense;
    int layer = -1;
  };
  const std::vector<ExtraBlock>& extra_blocks() const { return extra_blocks_; }

  // The initial parameters, the same on every rank for a seed: norm gains 1, emb ~ N(0,1),
  // every matrix ~ N(0, init_std^2), drawn in params() order from one SplitMix64 stream.
  NamedParams InitialParameters(uint64_t seed) const;

  // "layers.{l}.what", or "mtp.{j}.what" for MTP depth j's layer (l = L + j - 1, given L).
  static std::string LayerParamName(int layer, const char* what, int main_layers = -1);
  static std::string ExpertParamName(int layer, int expert, const char* what, int main_layers = -1);

 private:
  MoeLmConfig config_;
  std::vector<ParamDef> params_;
  std::vector<StageDef> stages_;
  std::vector<int> layer_first_;  // per layer: index of its first parameter
  std::vector<int> moe_first_;    // per layer: index of its MoE norm
  std::vector<int> mtp_first_;    // per MTP depth: index of its hnorm
  std::vector<ExtraBlock> extra_blocks_;
  int final_norm_ = -1;
};

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_MOE_LM_SPEC_H_
