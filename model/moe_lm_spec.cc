#include "model/moe_lm_spec.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/random.h"
#include "core/status.h"

namespace gradsum::model {

HeadLayout HeadLayoutOf(const MoeLmConfig& m, int sp) {
  HeadLayout h;
  if (!m.attention) return h;
  h.head_dim = m.dim / m.n_heads;
  h.heads_local = m.n_heads / sp;
  h.group = m.n_heads / m.n_kv_heads;
  return h;
}

int64_t ParamDef::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string MoeLmSpec::LayerParamName(int layer, const char* what, int main_layers) {
  if (main_layers >= 0 && layer >= main_layers) {
    return absl::StrCat("mtp.", layer - main_layers + 1, ".", what);
  }
  return absl::StrCat("layers.", layer, ".", what);
}

std::string MoeLmSpec::ExpertParamName(int layer, int expert, const char* what, int main_layers) {
  if (main_layers >= 0 && layer >= main_layers) {
    return absl::StrCat("mtp.", layer - main_layers + 1, ".experts.", expert, ".", what);
  }
  return absl::StrCat("layers.", layer, ".experts.", expert, ".", what);
}

namespace {

// The model config's sizes and options, each error naming the value; the attention ones
// only with attention.
absl::Status CheckModelConfig(const MoeLmConfig& m) {
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"vocab", m.vocab},
                                {"dim", m.dim},
                                {"layers", m.layers},
                                {"experts", m.experts},
                                {"top_k", m.top_k},
                                {"expert_dim", m.expert_dim}}) {
    if (v <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("model.", name, "=", v, ": must be > 0"));
    }
  }
  if (m.top_k > m.experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.top_k=", m.top_k, ": exceeds model.experts=", m.experts));
  }
  if (!(std::isfinite(m.expert_bias_speed) && m.expert_bias_speed >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("expert_bias_speed=", m.expert_bias_speed,
                                                   ": must be >= 0 and finite (0 = off)"));
  }
  if (m.router_sigmoid && m.alpha_b != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router_score=sigmoid with alpha_b=", m.alpha_b,
        ": the balancing loss (SEMANTICS.md §5) is defined on softmax probabilities; set "
        "alpha_b=0 (balance with expert_bias_speed, §5.1)"));
  }
  if (m.mtp_depth < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("mtp_depth=", m.mtp_depth, ": must be >= 0 (0 = off)"));
  }
  if (m.mtp_depth > 0 && !(m.mtp_scale > 0 && m.mtp_scale <= m.mtp_depth)) {
    return absl::InvalidArgumentError(absl::StrCat("mtp_scale=", m.mtp_scale,
                                                   ": must be in (0, mtp_depth=", m.mtp_depth,
                                                   "] (SEMANTICS.md §15)"));
  }
  if (m.mtp_depth > 0 && m.expert_bias_speed > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("mtp_depth=", m.mtp_depth, " with expert_bias_speed=", m.expert_bias_speed,
                     ": the expert bias is not defined for MTP layers (SEMANTICS.md §15.1)"));
  }
  if (m.attention) {
    if (m.n_heads < 1 || m.n_kv_heads < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model.heads=", m.n_heads, ", model.kv_heads=", m.n_kv_heads, ": both must be >= 1"));
    }
    if (m.n_heads % m.n_kv_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.heads=", m.n_heads,
                       " is not divisible by model.kv_heads=", m.n_kv_heads, " (GQA)"));
    }
    if (m.dim % m.n_heads != 0 || (m.dim / m.n_heads) % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.dim=", m.dim, " / model.heads=", m.n_heads,
                       ": head_dim must be a whole, even number (RoPE rotates pairs)"));
    }
    if (!(m.rope_theta > 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.rope_theta=", m.rope_theta, ": must be > 1"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MoeLmSpec> MoeLmSpec::Create(const MoeLmConfig& m) {
  GRADSUM_RETURN_IF_ERROR(CheckModelConfig(m));
  MoeLmSpec spec;
  spec.config_ = m;
  const int64_t V = m.vocab, D = m.dim, H = m.expert_dim;
  auto add = [&](std::string name, std::vector<int64_t> shape, ParamInit init, int layer = -1,
                 int expert = -1, ExpertMatrix matrix = ExpertMatrix::kGate) {
    ParamDef p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.init = init;
    p.layer = layer;
    p.expert = expert;
    p.matrix = matrix;
    spec.params_.push_back(std::move(p));
  };
  add("emb", {V, D}, ParamInit::kNormal);
  spec.stages_.push_back({StageKind::kEmbedding, -1, /*backward_reads_params=*/false});
  const int64_t kv_dim = m.attention ? m.n_kv_heads * (D / m.n_heads) : 0;
  const int L = m.layers;
  // Layer l's parameters (a main layer, or MTP depth l - L + 1's).
  auto add_layer = [&](int l) {
    spec.layer_first_[l] = static_cast<int>(spec.params_.size());
    if (m.attention) {
      add(LayerParamName(l, "attn_norm", L), {D}, ParamInit::kOnes, l);
      add(LayerParamName(l, "wq", L), {D, D}, ParamInit::kScaledNormal, l);
      add(LayerParamName(l, "wk", L), {D, kv_dim}, ParamInit::kScaledNormal, l);
      add(LayerParamName(l, "wv", L), {D, kv_dim}, ParamInit::kScaledNormal, l);
      add(LayerParamName(l, "wo", L), {D, D}, ParamInit::kScaledNormal, l);
    }
    spec.moe_first_[l] = static_cast<int>(spec.params_.size());
    add(LayerParamName(l, "norm", L), {D}, ParamInit::kOnes, l);
    add(LayerParamName(l, "router", L), {D, m.experts}, ParamInit::kScaledNormal, l);
    for (int e = 0; e < m.experts; ++e) {
      add(ExpertParamName(l, e, "wg", L), {D, H}, ParamInit::kScaledNormal, l, e,
          ExpertMatrix::kGate);
      add(ExpertParamName(l, e, "wu", L), {D, H}, ParamInit::kScaledNormal, l, e,
          ExpertMatrix::kUp);
      add(ExpertParamName(l, e, "wd", L), {H, D}, ParamInit::kScaledNormal, l, e,
          ExpertMatrix::kDown);
    }
  };
  spec.layer_first_.assign(L + m.mtp_depth, -1);
  spec.moe_first_.assign(L + m.mtp_depth, -1);
  for (int l = 0; l < L; ++l) {
    add_layer(l);
    spec.stages_.push_back({StageKind::kLayer, l, true});
  }
  spec.final_norm_ = static_cast<int>(spec.params_.size());
  add("final_norm", {D}, ParamInit::kOnes);
  add("out", {D, V}, ParamInit::kScaledNormal);
  // MTP depths after the head in params() (the main model's draws come first, unchanged);
  // their stages between the layers and the head.
  for (int j = 1; j <= m.mtp_depth; ++j) {
    const int l = L + j - 1;
    spec.mtp_first_.push_back(static_cast<int>(spec.params_.size()));
    add(LayerParamName(l, "hnorm", L), {D}, ParamInit::kOnes, l);
    add(LayerParamName(l, "enorm", L), {D}, ParamInit::kOnes, l);
    add(LayerParamName(l, "proj_h", L), {D, D}, ParamInit::kScaledNormal, l);
    add(LayerParamName(l, "proj_e", L), {D, D}, ParamInit::kScaledNormal, l);
    spec.extra_blocks_.push_back(
        {absl::StrCat("mtp.", j),
         {spec.mtp_hnorm(j), spec.mtp_enorm(j), spec.mtp_proj_h(j), spec.mtp_proj_e(j)},
         l});
    add_layer(l);
    spec.stages_.push_back({StageKind::kMtp, l, true});
  }
  spec.stages_.push_back({StageKind::kHead, -1, true});
  return spec;
}

int MoeLmSpec::StageOf(int p) const {
  const ParamDef& def = params_[p];
  if (def.layer >= 0) return 1 + def.layer;
  return p == emb() ? 0 : static_cast<int>(stages_.size()) - 1;
}

NamedParams MoeLmSpec::InitialParameters(uint64_t seed) const {
  SplitMix64 rng(MixSeed(seed, 0x696e6974ull));
  NamedParams params;
  for (const ParamDef& p : params_) {
    std::vector<float>& v = params[p.name];
    v.resize(p.numel());
    for (float& x : v) {
      switch (p.init) {
        case ParamInit::kOnes:
          x = 1.0f;
          break;
        case ParamInit::kNormal:
          x = static_cast<float>(rng.Normal());
          break;
        case ParamInit::kScaledNormal:
          x = static_cast<float>(rng.Normal() * config_.init_std);
          break;
      }
    }
  }
  return params;
}

}  // namespace gradsum::model
