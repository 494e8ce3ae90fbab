#include "testing/reference_moe_lm.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum::testing {
namespace {

constexpr double kRmsEps = 1e-6;  // SEMANTICS.md §10

// Layer l's parameter names: "layers.{l}." for the L main layers, "mtp.{j}." for MTP depth
// j's layer, l = L + j - 1 (SEMANTICS.md §15.1).
std::string LayerName(int l, int L, const char* what) {
  if (l >= L) return absl::StrCat("mtp.", l - L + 1, ".", what);
  return absl::StrCat("layers.", l, ".", what);
}
std::string ExpertName(int l, int L, int e, const char* what) {
  if (l >= L) return absl::StrCat("mtp.", l - L + 1, ".experts.", e, ".", what);
  return absl::StrCat("layers.", l, ".experts.", e, ".", what);
}

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double Silu(double x) { return x * Sigmoid(x); }
double SiluGrad(double x) {
  const double s = Sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}

double LogSumExp(const std::vector<double>& x) {
  const double mx = *std::max_element(x.begin(), x.end());
  double s = 0;
  for (double v : x) s += std::exp(v - mx);
  return mx + std::log(s);
}

// out = x / sqrt(mean(x^2) + eps) * g; returns r = 1 / sqrt(mean(x^2) + eps).
double RmsNorm(const std::vector<double>& x, const double* g, std::vector<double>* out) {
  double ms = 0;
  for (double v : x) ms += v * v;
  ms /= static_cast<double>(x.size());
  const double r = 1.0 / std::sqrt(ms + kRmsEps);
  out->resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) (*out)[i] = x[i] * r * g[i];
  return r;
}

// Given dout = dL/d(out), adds dL/dg into dg and returns dL/dx.
std::vector<double> RmsNormBackward(const std::vector<double>& x, const double* g, double r,
                                    const std::vector<double>& dout, double* dg) {
  const size_t n = x.size();
  double dot = 0;  // sum_j dout_j g_j x_j
  for (size_t j = 0; j < n; ++j) {
    dg[j] += dout[j] * x[j] * r;
    dot += dout[j] * g[j] * x[j];
  }
  std::vector<double> dx(n);
  // d r / d x_i = -r^3 x_i / n.
  for (size_t i = 0; i < n; ++i) dx[i] = r * g[i] * dout[i] - r * r * r * x[i] * dot / n;
  return dx;
}

// Everything forward keeps for backward, per token and layer.
struct LayerCache {
  std::vector<double> h_in, a, u, p;  // [D], [D], [E], [E]
  double r = 0;
  std::vector<int> experts;                  // [K], by descending p, ties: lower index first
  std::vector<double> w;                     // [K] final gate weights
  std::vector<std::vector<double>> g, v, y;  // per slot: [H], [H], [D]
};

struct TokenCache {
  int micro = 0;
  int position = 0;  // in its sequence
  int token = 0;
  int label = 0;
  bool routed = false;
  bool valid = false;
  double weight = 0;  // w_t of §3 (valid tokens)
  std::vector<LayerCache> layers;
  std::vector<double> h_final, f, logits;
  double r_final = 0;
  // Per MTP depth (§15.1): its input token and label, and what its block keeps.
  struct Mtp {
    int token = 0, label = 0;
    bool valid = false;
    double weight = 0;
    std::vector<double> h_prev, hn, e, en, h_out, f, logits;
    double rh = 0, re = 0, r_final = 0;
  };
  std::vector<Mtp> mtp;
};

// The attention block of one layer over one sequence, per token (empty for padding).
struct AttentionCache {
  std::vector<std::vector<double>> h_in, b;         // [S][D] the block's input, its norm
  std::vector<double> r;                            // [S]
  std::vector<std::vector<double>> q, k, v;         // [S][heads * head_dim], after RoPE (q, k)
  std::vector<std::vector<std::vector<double>>> p;  // [S][Hq][keys of the document up to t]
  std::vector<std::vector<double>> o;               // [S][D] the heads' outputs, concatenated
};

// One sequence: its tokens are cache[first_cache .. first_cache + len).
struct SequenceCache {
  size_t first_cache = 0;
  int len = 0;
  std::vector<int> doc_start;        // [len], -1 for padding
  std::vector<AttentionCache> attn;  // per layer (attention only)
};

// One token's LM-head loss of §3.2 from its raw logits x (the CE with label smoothing over
// the whole vocabulary, of the softcapped logits, plus alpha_lse lse^2), straight from the
// definitions; with `dx` non-null also its gradient with respect to x (before w / D). With
// `z_out` non-null the CE part is returned and the output z-loss alpha_lse lse^2 written
// there (the two display terms); otherwise their sum is returned.
double LmHeadTokenLoss(const ReferenceConfig& c, const std::vector<double>& x, int label,
                       std::vector<double>* dx, double* z_out = nullptr) {
  const int V = static_cast<int>(x.size());
  const double cap = c.ce.logit_softcap, eps = c.ce.label_smoothing;
  std::vector<double> z(x);
  if (cap > 0) {
    for (double& e : z) e = cap * std::tanh(e / cap);
  }
  const double lse = LogSumExp(z);
  double mean_logp = 0.0;
  for (double e : z) mean_logp += (e - lse) / V;
  const double ce = -(1.0 - eps) * (z[label] - lse) - eps * mean_logp;
  const double out_z = c.ce.alpha_lse * lse * lse;
  const double loss = z_out != nullptr ? ce : ce + out_z;
  if (z_out != nullptr) *z_out = out_z;
  if (dx != nullptr) {
    dx->assign(V, 0.0);
    for (int v = 0; v < V; ++v) {
      const double p = std::exp(z[v] - lse);
      double g = (1.0 + 2.0 * c.ce.alpha_lse * lse) * p - eps / V - (v == label ? 1.0 - eps : 0.0);
      if (cap > 0) g *= 1.0 - (z[v] / cap) * (z[v] / cap);
      (*dx)[v] = g;
    }
  }
  return loss;
}

// The config checks that need neither parameters nor batch.
absl::Status CheckConfig(const ReferenceConfig& c) {
  using absl::StrCat;
  for (const auto& [name, value] : {std::pair<const char*, int>{"vocab", c.vocab},
                                    {"dim", c.dim},
                                    {"layers", c.layers},
                                    {"experts", c.experts},
                                    {"top_k", c.top_k},
                                    {"expert_dim", c.expert_dim}}) {
    if (value <= 0) return absl::InvalidArgumentError(StrCat(name, "=", value, ": must be > 0"));
  }
  if (c.top_k > c.experts) {
    return absl::InvalidArgumentError(StrCat("top_k=", c.top_k, ": exceeds experts=", c.experts));
  }
  if (c.attention && (c.n_heads < 1 || c.n_kv_heads < 1 || c.n_heads % c.n_kv_heads != 0 ||
                      c.dim % c.n_heads != 0 || (c.dim / c.n_heads) % 2 != 0)) {
    return absl::InvalidArgumentError(StrCat("attention: heads=", c.n_heads,
                                             " kv_heads=", c.n_kv_heads, " dim=", c.dim,
                                             " do not divide into even heads"));
  }
  if (c.sigmoid_scores && c.alpha_b != 0) {
    return absl::InvalidArgumentError(StrCat("sigmoid scores with alpha_b=", c.alpha_b,
                                             ": the balancing loss is of softmax probabilities"));
  }
  if (c.mtp_depth < 0 || (c.mtp_depth > 0 && !(c.mtp_scale > 0 && c.mtp_scale <= c.mtp_depth))) {
    return absl::InvalidArgumentError(StrCat("mtp_depth=", c.mtp_depth, " with mtp_scale=",
                                             c.mtp_scale, ": need k >= 0, 0 < scale <= k"));
  }
  if (c.mtp_depth > 0 && !c.expert_bias.empty()) {
    return absl::InvalidArgumentError("MTP with an expert bias is not defined");
  }
  if (!c.expert_bias.empty()) {
    bool fits = static_cast<int>(c.expert_bias.size()) == c.layers;
    for (const std::vector<double>& b : c.expert_bias) {
      fits = fits && static_cast<int>(b.size()) == c.experts;
    }
    if (!fits) return absl::InvalidArgumentError("expert_bias is not [layers][experts]");
  }
  return absl::OkStatus();
}

std::string MtpName(int j, const char* what) { return absl::StrCat("mtp.", j, ".", what); }

using Rows = std::vector<std::vector<double>>;  // [S][width], one row per token of a sequence

// One ReferenceLossAndGrads call: its inputs, the global statistics of §3-5, what the
// forward keeps for the backward, and the result being filled in. Run() is the whole
// computation, and each member function one named step of it. The sizes keep the short
// names of SEMANTICS.md's symbols so that the formulas read as written there. The config
// must have passed CheckConfig (the constructor divides by its head count).
class ReferenceModel {
 public:
  ReferenceModel(const ReferenceConfig& c, const NamedTensors& params,
                 const std::vector<std::vector<ReferenceMicroBatch>>& global_batch)
      : c_(c),
        params_(params),
        batch_(global_batch),
        V(c.vocab),
        Dm(c.dim),
        L(c.layers),
        E(c.experts),
        K(c.top_k),
        H(c.expert_dim),
        G(static_cast<int>(global_batch.size())),
        KM(c.mtp_depth),
        Hq(c.attention ? c.n_heads : 0),
        Hk(c.attention ? c.n_kv_heads : 0),
        hd(c.attention ? c.dim / c.n_heads : 0) {}

  absl::StatusOr<ReferenceResult> Run() {
    GRADSUM_RETURN_IF_ERROR(CheckParamsAndZeroGrads());
    GRADSUM_RETURN_IF_ERROR(CountTokens());
    GRADSUM_RETURN_IF_ERROR(RollMtpInputs());
    GRADSUM_RETURN_IF_ERROR(Forward());
    AddLosses();
    for (const SequenceCache& sc : sequences_) BackwardSequence(sc);
    return std::move(result_);
  }

 private:
  const double* P(const std::string& name) const { return params_.at(name).data(); }
  double* Gr(const std::string& name) { return result_.grads.at(name).data(); }

  // Every parameter of ReferenceParamShapes present with its size; its gradient zeroed.
  absl::Status CheckParamsAndZeroGrads() {
    using absl::StrCat;
    for (const auto& [name, shape] : ReferenceParamShapes(c_)) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      auto it = params_.find(name);
      if (it == params_.end()) {
        return absl::InvalidArgumentError(StrCat("missing parameter ", name));
      }
      if (static_cast<int64_t>(it->second.size()) != n) {
        return absl::InvalidArgumentError(
            StrCat("parameter ", name, " has ", it->second.size(), " elements, expected ", n));
      }
      result_.grads[name].assign(n, 0.0);
    }
    return absl::OkStatus();
  }

  // Validates the inputs; the global statistics D and N (§3, §4), n_s per sample and the
  // routed tokens per micro-step.
  absl::Status CountTokens() {
    using absl::StrCat;
    if (c_.ce_mode != "token" && c_.ce_mode != "sample" && c_.ce_mode != "square") {
      return absl::InvalidArgumentError(
          StrCat("ce_mode \"", c_.ce_mode, "\" is not token, sample or square"));
    }
    by_sample_ = c_.ce_mode != "token";
    routed_per_micro_.assign(G, 0.0);
    for (int m = 0; m < G; ++m) {
      for (size_t r = 0; r < batch_[m].size(); ++r) {
        const ReferenceMicroBatch& mb = batch_[m][r];
        if (mb.labels.size() != mb.tokens.size() || mb.mask.size() != mb.tokens.size()) {
          return absl::InvalidArgumentError(
              StrCat("micro-batch [", m, "][", r, "]: tokens, labels and mask differ in length"));
        }
        if (c_.attention && (mb.seq_len < 1 || mb.tokens.size() % mb.seq_len != 0 ||
                             mb.doc_start.size() != mb.tokens.size())) {
          return absl::InvalidArgumentError(StrCat(
              "micro-batch [", m, "][", r, "]: ", mb.tokens.size(), " tokens are not sequences of ",
              mb.seq_len, " with ", mb.doc_start.size(), " document starts"));
        }
        if (by_sample_ && mb.sample_ids.size() != mb.tokens.size()) {
          return absl::InvalidArgumentError(
              StrCat("micro-batch [", m, "][", r, "]: ", mb.sample_ids.size(), " sample ids for ",
                     mb.tokens.size(), " tokens (", c_.ce_mode, " mode)"));
        }
        for (size_t t = 0; t < mb.tokens.size(); ++t) {
          if (mb.tokens[t] < 0 || mb.tokens[t] >= V) {
            return absl::InvalidArgumentError(StrCat("token ", mb.tokens[t], " at [", m, "][", r,
                                                     "][", t, "] outside [0, ", V, ")"));
          }
          const bool ignored = mb.labels[t] == c_.ignore_index;
          if (!ignored && (mb.labels[t] < 0 || mb.labels[t] >= V)) {
            return absl::InvalidArgumentError(StrCat("label ", mb.labels[t], " at [", m, "][", r,
                                                     "][", t, "] outside [0, ", V, ")"));
          }
          if (mb.mask[t] == 0 && !ignored) {
            return absl::InvalidArgumentError(
                StrCat("padding token at [", m, "][", r, "][", t, "] has label ", mb.labels[t]));
          }
          if (!ignored) result_.valid_tokens += 1;
          if (!ignored && by_sample_) sample_size_[{m, r, mb.sample_ids[t]}] += 1;
          if (mb.mask[t] != 0) routed_per_micro_[m] += 1;
        }
      }
      result_.routed_tokens += routed_per_micro_[m];
    }
    // D = sum of w_t.
    for (int m = 0; m < G; ++m) {
      for (size_t r = 0; r < batch_[m].size(); ++r) {
        const ReferenceMicroBatch& mb = batch_[m][r];
        for (size_t t = 0; t < mb.tokens.size(); ++t) {
          if (mb.labels[t] != c_.ignore_index) result_.ce_weight_sum += WeightOf(m, r, t);
        }
      }
    }
    Dce = result_.ce_weight_sum;
    Ntok = result_.routed_tokens;
    return absl::OkStatus();
  }

  // w_t of a valid token (§3).
  double WeightOf(int m, size_t r, size_t t) const {
    if (!by_sample_) return 1.0;
    const double n = sample_size_.at({m, r, batch_[m][r].sample_ids[t]});
    return c_.ce_mode == "sample" ? 1.0 / n : 1.0 / std::sqrt(n);
  }

  // MTP (§15.1): each depth's input tokens and labels, rolled here on the whole sequences;
  // its weights and D_j.
  absl::Status RollMtpInputs() {
    using absl::StrCat;
    mtp_tok_.resize(G);
    mtp_lab_.resize(G);
    for (int m = 0; m < G && KM > 0; ++m) {
      mtp_tok_[m].resize(batch_[m].size());
      mtp_lab_[m].resize(batch_[m].size());
      for (size_t r = 0; r < batch_[m].size(); ++r) {
        const ReferenceMicroBatch& mb = batch_[m][r];
        const int64_t T = static_cast<int64_t>(mb.tokens.size());
        if (mb.seq_len < 1 || T % mb.seq_len != 0 ||
            static_cast<int64_t>(mb.doc_start.size()) != T) {
          return absl::InvalidArgumentError(StrCat("micro-batch [", m, "][", r,
                                                   "]: MTP needs "
                                                   "whole sequences with document starts"));
        }
        for (int j = 1; j <= KM; ++j) {
          std::vector<int> tok(T, 0), lab(T, c_.ignore_index);
          for (int64_t t = 0; t < T; ++t) {
            const int64_t u = t + j;
            if (mb.mask[t] == 0 || u >= T || u / mb.seq_len != t / mb.seq_len || mb.mask[u] == 0 ||
                mb.doc_start[u] != mb.doc_start[t]) {
              continue;
            }
            tok[t] = mb.tokens[u];
            lab[t] = mb.labels[u];
            if (lab[t] != c_.ignore_index && by_sample_) {
              mtp_sample_size_[{j, m, r, mb.sample_ids[t]}] += 1;
            }
          }
          mtp_tok_[m][r].push_back(std::move(tok));
          mtp_lab_[m][r].push_back(std::move(lab));
        }
      }
    }
    result_.mtp.assign(KM, 0.0);
    result_.mtp_weight_sum.assign(KM, 0.0);
    for (int j = 1; j <= KM; ++j) {
      for (int m = 0; m < G; ++m) {
        for (size_t r = 0; r < batch_[m].size(); ++r) {
          for (size_t t = 0; t < mtp_lab_[m][r][j - 1].size(); ++t) {
            if (mtp_lab_[m][r][j - 1][t] != c_.ignore_index) {
              result_.mtp_weight_sum[j - 1] += MtpWeightOf(j, m, r, t);
            }
          }
        }
      }
    }
    return absl::OkStatus();
  }

  // Depth j's w_t of a token whose depth-j label is valid.
  double MtpWeightOf(int j, int m, size_t r, size_t t) const {
    if (!by_sample_) return 1.0;
    const double n = mtp_sample_size_.at({j, m, r, batch_[m][r].sample_ids[t]});
    return c_.ce_mode == "sample" ? 1.0 / n : 1.0 / std::sqrt(n);
  }

  // ---- Forward, sequence by sequence (tokens meet only in attention). ----
  absl::Status Forward() {
    result_.expert_counts.assign(L + KM,
                                 std::vector<std::vector<int64_t>>(G, std::vector<int64_t>(E, 0)));
    for (int m = 0; m < G; ++m) {
      for (size_t r = 0; r < batch_[m].size(); ++r) {
        const ReferenceMicroBatch& mb = batch_[m][r];
        const int64_t T = static_cast<int64_t>(mb.tokens.size());
        const int64_t len = c_.attention ? mb.seq_len : std::max<int64_t>(T, 1);
        for (int64_t first = 0; first < T; first += len) {
          SequenceCache sc;
          Rows h;
          GRADSUM_RETURN_IF_ERROR(EmbedSequence(m, r, first, len, sc, h));
          sc.attn.resize(c_.attention ? L + KM : 0);
          for (int l = 0; l < L; ++l) {
            if (c_.attention) AttentionForward(l, sc, h);
            for (int t = 0; t < sc.len; ++t) {
              TokenCache& tc = cache_[sc.first_cache + t];
              if (tc.routed) MoeForward(l, m, h[t], tc.layers[l]);
            }
          }
          HeadForward(sc, h);
          MtpForward(m, sc, h);
          sequences_.push_back(std::move(sc));
        }
      }
    }
    return absl::OkStatus();
  }

  // The tokens [first, first + len) of micro-batch [m][r] into the cache (padding too; it
  // contributes nothing anywhere) and their embeddings into h.
  absl::Status EmbedSequence(int m, size_t r, int64_t first, int64_t len, SequenceCache& sc,
                             Rows& h) {
    const ReferenceMicroBatch& mb = batch_[m][r];
    sc.len = static_cast<int>(len);
    sc.first_cache = cache_.size();
    sc.doc_start.assign(len, -1);
    h.resize(len);
    for (int64_t t = first; t < first + len; ++t) {
      TokenCache tc;
      tc.micro = m;
      tc.token = mb.tokens[t];
      tc.label = mb.labels[t];
      tc.routed = mb.mask[t] != 0;
      tc.valid = mb.labels[t] != c_.ignore_index;
      tc.weight = tc.valid ? WeightOf(m, r, t) : 0.0;
      if (tc.routed && c_.attention) sc.doc_start[t - first] = mb.doc_start[t];
      if (c_.attention && tc.routed &&
          (mb.doc_start[t] < 0 || mb.doc_start[t] > t - first ||
           mb.mask[first + mb.doc_start[t]] == 0)) {
        return absl::InvalidArgumentError(absl::StrCat("micro-batch [", m, "][", r, "]: token ", t,
                                                       " has document start ", mb.doc_start[t]));
      }
      h[t - first].assign(P("emb") + tc.token * Dm, P("emb") + (tc.token + 1) * Dm);
      if (tc.routed) tc.layers.resize(L + KM);
      tc.position = static_cast<int>(t - first);
      tc.mtp.resize(KM);
      for (int j = 1; j <= KM; ++j) {
        TokenCache::Mtp& mc = tc.mtp[j - 1];
        mc.token = mtp_tok_[m][r][j - 1][t];
        mc.label = mtp_lab_[m][r][j - 1][t];
        mc.valid = mc.label != c_.ignore_index;
        mc.weight = mc.valid ? MtpWeightOf(j, m, r, t) : 0.0;
      }
      cache_.push_back(std::move(tc));
    }
    return absl::OkStatus();
  }

  // The MoE block of layer l on one token (SEMANTICS.md §10): h += sum_k w_k Expert(a).
  void MoeForward(int l, int m, std::vector<double>& h, LayerCache& lc) {
    lc.h_in = h;
    lc.r = RmsNorm(h, P(LayerName(l, L, "norm")), &lc.a);
    const double* wr = P(LayerName(l, L, "router"));
    lc.u.assign(E, 0.0);
    for (int i = 0; i < Dm; ++i) {
      for (int e = 0; e < E; ++e) lc.u[e] += lc.a[i] * wr[i * E + e];
    }
    const double lse = LogSumExp(lc.u);
    lc.p.resize(E);
    for (int e = 0; e < E; ++e) {
      lc.p[e] = c_.sigmoid_scores ? 1.0 / (1.0 + std::exp(-lc.u[e])) : std::exp(lc.u[e] - lse);
    }
    // Selection by score + bias (§5.1); the weights below are of the unbiased scores.
    std::vector<double> key = lc.p;
    if (!c_.expert_bias.empty() && l < L) {
      for (int e = 0; e < E; ++e) key[e] += c_.expert_bias[l][e];
    }
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return key[x] > key[y]; });
    lc.experts.assign(order.begin(), order.begin() + K);
    double sel = 0;
    for (int e : lc.experts) sel += lc.p[e];
    lc.w.resize(K);
    for (int k = 0; k < K; ++k) {
      lc.w[k] = lc.p[lc.experts[k]] / (c_.norm_topk_prob ? sel : 1.0) * c_.router_scale;
      ++result_.expert_counts[l][m][lc.experts[k]];
    }
    lc.g.assign(K, std::vector<double>(H, 0.0));
    lc.v.assign(K, std::vector<double>(H, 0.0));
    lc.y.assign(K, std::vector<double>(Dm, 0.0));
    for (int k = 0; k < K; ++k) {
      const int e = lc.experts[k];
      const double* wg = P(ExpertName(l, L, e, "wg"));
      const double* wu = P(ExpertName(l, L, e, "wu"));
      const double* wd = P(ExpertName(l, L, e, "wd"));
      for (int i = 0; i < Dm; ++i) {
        for (int j = 0; j < H; ++j) {
          lc.g[k][j] += lc.a[i] * wg[i * H + j];
          lc.v[k][j] += lc.a[i] * wu[i * H + j];
        }
      }
      for (int j = 0; j < H; ++j) {
        const double s = Silu(lc.g[k][j]) * lc.v[k][j];
        for (int i = 0; i < Dm; ++i) lc.y[k][i] += s * wd[j * Dm + i];
      }
    }
    for (int k = 0; k < K; ++k) {
      for (int i = 0; i < Dm; ++i) h[i] += lc.w[k] * lc.y[k][i];
    }
  }

  // RoPE (§10, rotate-half) of one head's values at position pos; sign -1: its inverse.
  void Rope(double* x, int pos, double sign) const {
    for (int i = 0; i < hd / 2; ++i) {
      const double angle = pos * std::pow(c_.rope_theta, -2.0 * i / hd);
      const double cs = std::cos(angle), sn = sign * std::sin(angle);
      const double a = x[i], b = x[i + hd / 2];
      x[i] = a * cs - b * sn;
      x[i + hd / 2] = b * cs + a * sn;
    }
  }

  // The attention block of layer l on the sequence's routed tokens: h += o Wo.
  void AttentionForward(int l, SequenceCache& sc, Rows& h) {
    AttentionCache& ac = sc.attn[l];
    const int S = sc.len;
    ac.h_in = h;
    ac.b.assign(S, {});
    ac.r.assign(S, 0.0);
    ac.q.assign(S, std::vector<double>(Hq * hd, 0.0));
    ac.k.assign(S, std::vector<double>(Hk * hd, 0.0));
    ac.v.assign(S, std::vector<double>(Hk * hd, 0.0));
    ac.o.assign(S, std::vector<double>(Dm, 0.0));
    ac.p.assign(S, std::vector<std::vector<double>>(Hq));
    const double* wq = P(LayerName(l, L, "wq"));
    const double* wk = P(LayerName(l, L, "wk"));
    const double* wv = P(LayerName(l, L, "wv"));
    const double* wo = P(LayerName(l, L, "wo"));
    for (int t = 0; t < S; ++t) {
      if (sc.doc_start[t] < 0) continue;
      ac.r[t] = RmsNorm(h[t], P(LayerName(l, L, "attn_norm")), &ac.b[t]);
      for (int i = 0; i < Dm; ++i) {
        for (int j = 0; j < Hq * hd; ++j) ac.q[t][j] += ac.b[t][i] * wq[i * Hq * hd + j];
        for (int j = 0; j < Hk * hd; ++j) {
          ac.k[t][j] += ac.b[t][i] * wk[i * Hk * hd + j];
          ac.v[t][j] += ac.b[t][i] * wv[i * Hk * hd + j];
        }
      }
      const int pos = t - sc.doc_start[t];
      for (int hh = 0; hh < Hq; ++hh) Rope(ac.q[t].data() + hh * hd, pos, 1.0);
      for (int hh = 0; hh < Hk; ++hh) Rope(ac.k[t].data() + hh * hd, pos, 1.0);
    }
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    for (int t = 0; t < S; ++t) {
      if (sc.doc_start[t] < 0) continue;
      for (int hh = 0; hh < Hq; ++hh) {
        const int j = hh / (Hq / Hk);
        std::vector<double> scores;
        for (int s = sc.doc_start[t]; s <= t; ++s) {
          double dot = 0;
          for (int i = 0; i < hd; ++i) dot += ac.q[t][hh * hd + i] * ac.k[s][j * hd + i];
          scores.push_back(dot * scale);
        }
        const double lse = LogSumExp(scores);
        std::vector<double>& p = ac.p[t][hh];
        p.resize(scores.size());
        for (size_t x = 0; x < scores.size(); ++x) {
          p[x] = std::exp(scores[x] - lse);
          const int s = sc.doc_start[t] + static_cast<int>(x);
          for (int i = 0; i < hd; ++i) ac.o[t][hh * hd + i] += p[x] * ac.v[s][j * hd + i];
        }
      }
      for (int i = 0; i < Dm; ++i) {
        for (int j = 0; j < Dm; ++j) h[t][j] += ac.o[t][i] * wo[i * Dm + j];
      }
    }
  }

  // The LM head's logits f Wout of one token.
  std::vector<double> HeadLogits(const std::vector<double>& f) const {
    const double* wo = P("out");
    std::vector<double> logits(V, 0.0);
    for (int i = 0; i < Dm; ++i) {
      for (int v = 0; v < V; ++v) logits[v] += f[i] * wo[i * V + v];
    }
    return logits;
  }

  // The final norm and LM head of the main model on the sequence's final hidden states h.
  void HeadForward(const SequenceCache& sc, const Rows& h) {
    for (int t = 0; t < sc.len; ++t) {
      TokenCache& tc = cache_[sc.first_cache + t];
      tc.h_final = h[t];
      if (tc.valid) {  // only valid tokens reach the LM head with a non-zero weight
        tc.r_final = RmsNorm(h[t], P("final_norm"), &tc.f);
        tc.logits = HeadLogits(tc.f);
      }
    }
  }

  // MTP depths (§15.1): h^0 = h_L; h'_j = RMSNorm(h^{j-1}) M^h + RMSNorm(Emb[x_j]) M^e;
  // h^j = layer L + j - 1 of h'_j; its logits through the shared final norm and head.
  void MtpForward(int m, SequenceCache& sc, const Rows& h) {
    Rows hprev = h;
    for (int j = 1; j <= KM; ++j) {
      const int l = L + j - 1;
      const double* ph = P(MtpName(j, "proj_h"));
      const double* pe = P(MtpName(j, "proj_e"));
      Rows hj(sc.len, std::vector<double>(Dm, 0.0));
      for (int t = 0; t < sc.len; ++t) {
        TokenCache& tc = cache_[sc.first_cache + t];
        if (!tc.routed) continue;
        TokenCache::Mtp& mc = tc.mtp[j - 1];
        mc.h_prev = hprev[t];
        mc.rh = RmsNorm(hprev[t], P(MtpName(j, "hnorm")), &mc.hn);
        mc.e.assign(P("emb") + mc.token * Dm, P("emb") + (mc.token + 1) * Dm);
        mc.re = RmsNorm(mc.e, P(MtpName(j, "enorm")), &mc.en);
        for (int i = 0; i < Dm; ++i) {
          for (int o = 0; o < Dm; ++o) {
            hj[t][o] += mc.hn[i] * ph[i * Dm + o] + mc.en[i] * pe[i * Dm + o];
          }
        }
      }
      if (c_.attention) AttentionForward(l, sc, hj);
      for (int t = 0; t < sc.len; ++t) {
        TokenCache& tc = cache_[sc.first_cache + t];
        if (!tc.routed) continue;
        MoeForward(l, m, hj[t], tc.layers[l]);
        TokenCache::Mtp& mc = tc.mtp[j - 1];
        mc.h_out = hj[t];
        if (mc.valid) {
          mc.r_final = RmsNorm(hj[t], P("final_norm"), &mc.f);
          mc.logits = HeadLogits(mc.f);
        }
      }
      hprev = std::move(hj);
    }
  }

  // ---- Loss values (§3-5). ----
  void AddLosses() {
    for (const TokenCache& tc : cache_) {
      if (tc.valid && Dce > 0) {
        double z_out = 0.0;
        result_.ce += tc.weight * LmHeadTokenLoss(c_, tc.logits, tc.label, nullptr, &z_out) / Dce;
        result_.z_out += tc.weight * z_out / Dce;
      }
      for (int j = 1; j <= KM; ++j) {
        const TokenCache::Mtp& mc = tc.mtp[j - 1];
        const double Dj = result_.mtp_weight_sum[j - 1];
        if (mc.valid && Dj > 0) {
          result_.mtp[j - 1] += c_.mtp_scale / KM * mc.weight *
                                LmHeadTokenLoss(c_, mc.logits, mc.label, nullptr) / Dj;
        }
      }
      if (!tc.routed) continue;
      for (int l = 0; l < L + KM; ++l) {
        const LayerCache& lc = tc.layers[l];
        const double lse = LogSumExp(lc.u);
        result_.z += c_.alpha_z * lse * lse / Ntok;
        const double n_lm = routed_per_micro_[tc.micro];
        for (int e = 0; e < E; ++e) {
          const double coef = result_.expert_counts[l][tc.micro][e] / (n_lm * K);
          result_.bal += c_.alpha_b / G * E * coef * lc.p[e] / n_lm;
        }
      }
    }
  }

  // ---- Backward, sequence by sequence, layer by layer. ----
  void BackwardSequence(const SequenceCache& sc) {
    Rows dh(sc.len, std::vector<double>(Dm, 0.0));
    for (int t = 0; t < sc.len; ++t) {
      const TokenCache& tc = cache_[sc.first_cache + t];
      if (!tc.valid || Dce <= 0) continue;
      std::vector<double> dlogits;
      LmHeadTokenLoss(c_, tc.logits, tc.label, &dlogits);
      for (int v = 0; v < V; ++v) dlogits[v] = tc.weight * dlogits[v] / Dce;
      const std::vector<double> df = HeadBackward(tc.f, dlogits);
      dh[t] = RmsNormBackward(tc.h_final, P("final_norm"), tc.r_final, df, Gr("final_norm"));
    }
    // MTP depths, deepest first: dj = dL/dh^j (its CE and depth j + 1's block), through its
    // layer and block; dL/dh^{j-1} goes to depth j - 1 (or into dh = dL/dh_L).
    Rows carry(sc.len, std::vector<double>(Dm, 0.0));
    for (int j = KM; j >= 1; --j) MtpDepthBackward(j, sc, carry, dh);
    for (int l = L - 1; l >= 0; --l) {
      for (int t = 0; t < sc.len; ++t) {
        const TokenCache& tc = cache_[sc.first_cache + t];
        if (tc.routed) MoeBackward(l, tc, dh[t]);
      }
      if (c_.attention) AttentionBackward(l, sc, dh);
    }
    for (int t = 0; t < sc.len; ++t) {
      const TokenCache& tc = cache_[sc.first_cache + t];
      if (!tc.routed && !tc.valid) continue;  // padding
      double* demb = Gr("emb") + tc.token * Dm;
      for (int i = 0; i < Dm; ++i) demb[i] += dh[t][i];
    }
  }

  // The LM head of one token: adds dL/dWout and returns dL/df from dlogits.
  std::vector<double> HeadBackward(const std::vector<double>& f,
                                   const std::vector<double>& dlogits) {
    const double* wo = P("out");
    double* dwo = Gr("out");
    std::vector<double> df(Dm, 0.0);
    for (int i = 0; i < Dm; ++i) {
      for (int v = 0; v < V; ++v) {
        dwo[i * V + v] += f[i] * dlogits[v];
        df[i] += wo[i * V + v] * dlogits[v];
      }
    }
    return df;
  }

  // MTP depth j's backward on one sequence: carry (dL/dh^j from depth j + 1) plus its own
  // CE through its layer and block; dL/dh^{j-1} goes into carry, or into dh at j = 1.
  void MtpDepthBackward(int j, const SequenceCache& sc, Rows& carry, Rows& dh) {
    const int l = L + j - 1;
    const double Dj = result_.mtp_weight_sum[j - 1];
    Rows dj = carry;
    for (int t = 0; t < sc.len; ++t) {
      const TokenCache& tc = cache_[sc.first_cache + t];
      const TokenCache::Mtp& mc = tc.mtp[j - 1];
      if (!mc.valid || Dj <= 0) continue;
      std::vector<double> dlogits;
      LmHeadTokenLoss(c_, mc.logits, mc.label, &dlogits);
      for (int v = 0; v < V; ++v) dlogits[v] = c_.mtp_scale / KM * mc.weight * dlogits[v] / Dj;
      const std::vector<double> df = HeadBackward(mc.f, dlogits);
      const std::vector<double> dx =
          RmsNormBackward(mc.h_out, P("final_norm"), mc.r_final, df, Gr("final_norm"));
      for (int i = 0; i < Dm; ++i) dj[t][i] += dx[i];
    }
    for (int t = 0; t < sc.len; ++t) {
      const TokenCache& tc = cache_[sc.first_cache + t];
      if (tc.routed) MoeBackward(l, tc, dj[t]);
    }
    if (c_.attention) AttentionBackward(l, sc, dj);
    // dj is dL/dh'_j: through the projection halves and the two norms.
    const double* ph = P(MtpName(j, "proj_h"));
    const double* pe = P(MtpName(j, "proj_e"));
    double* dph = Gr(MtpName(j, "proj_h"));
    double* dpe = Gr(MtpName(j, "proj_e"));
    carry.assign(sc.len, std::vector<double>(Dm, 0.0));
    for (int t = 0; t < sc.len; ++t) {
      const TokenCache& tc = cache_[sc.first_cache + t];
      if (!tc.routed) continue;
      const TokenCache::Mtp& mc = tc.mtp[j - 1];
      std::vector<double> dhn(Dm, 0.0), den(Dm, 0.0);
      for (int i = 0; i < Dm; ++i) {
        for (int o = 0; o < Dm; ++o) {
          dph[i * Dm + o] += mc.hn[i] * dj[t][o];
          dpe[i * Dm + o] += mc.en[i] * dj[t][o];
          dhn[i] += ph[i * Dm + o] * dj[t][o];
          den[i] += pe[i * Dm + o] * dj[t][o];
        }
      }
      const std::vector<double> de =
          RmsNormBackward(mc.e, P(MtpName(j, "enorm")), mc.re, den, Gr(MtpName(j, "enorm")));
      double* demb = Gr("emb") + mc.token * Dm;
      for (int i = 0; i < Dm; ++i) demb[i] += de[i];
      const std::vector<double> dp =
          RmsNormBackward(mc.h_prev, P(MtpName(j, "hnorm")), mc.rh, dhn, Gr(MtpName(j, "hnorm")));
      for (int i = 0; i < Dm; ++i) (j == 1 ? dh[t][i] : carry[t][i]) += dp[i];
    }
  }

  // The MoE block of layer l on one token: dh (dL/dh after the block) becomes dL/dh before.
  void MoeBackward(int l, const TokenCache& tc, std::vector<double>& dh) {
    const LayerCache& lc = tc.layers[l];
    std::vector<double> da(Dm, 0.0);
    const std::vector<double> dw = ExpertsBackward(l, lc, dh, da);
    const std::vector<double> du = RouterLogitsBackward(l, tc, dw);
    const double* wr = P(LayerName(l, L, "router"));
    double* dwr = Gr(LayerName(l, L, "router"));
    for (int i = 0; i < Dm; ++i) {
      for (int e = 0; e < E; ++e) {
        dwr[i * E + e] += lc.a[i] * du[e];
        da[i] += wr[i * E + e] * du[e];
      }
    }
    const std::vector<double> dh_norm =
        RmsNormBackward(lc.h_in, P(LayerName(l, L, "norm")), lc.r, da, Gr(LayerName(l, L, "norm")));
    for (int i = 0; i < Dm; ++i) dh[i] += dh_norm[i];  // residual + norm branch
  }

  // The selected experts of layer l (h_out = h_in + sum_k w_k y_k): adds their weight
  // gradients and dL/da into da; returns dL/dw per slot.
  std::vector<double> ExpertsBackward(int l, const LayerCache& lc, const std::vector<double>& dh,
                                      std::vector<double>& da) {
    std::vector<double> dw(K, 0.0);
    for (int k = 0; k < K; ++k) {
      const int e = lc.experts[k];
      const double* wg = P(ExpertName(l, L, e, "wg"));
      const double* wu = P(ExpertName(l, L, e, "wu"));
      const double* wd = P(ExpertName(l, L, e, "wd"));
      double* dwg = Gr(ExpertName(l, L, e, "wg"));
      double* dwu = Gr(ExpertName(l, L, e, "wu"));
      double* dwd = Gr(ExpertName(l, L, e, "wd"));
      std::vector<double> dy(Dm);
      for (int i = 0; i < Dm; ++i) {
        dw[k] += dh[i] * lc.y[k][i];
        dy[i] = lc.w[k] * dh[i];
      }
      for (int j = 0; j < H; ++j) {
        const double s = Silu(lc.g[k][j]) * lc.v[k][j];
        double ds = 0;
        for (int i = 0; i < Dm; ++i) {
          dwd[j * Dm + i] += s * dy[i];
          ds += wd[j * Dm + i] * dy[i];
        }
        const double dgate = ds * lc.v[k][j] * SiluGrad(lc.g[k][j]);
        const double dup = ds * Silu(lc.g[k][j]);
        for (int i = 0; i < Dm; ++i) {
          dwg[i * H + j] += lc.a[i] * dgate;
          dwu[i * H + j] += lc.a[i] * dup;
          da[i] += wg[i * H + j] * dgate + wu[i * H + j] * dup;
        }
      }
    }
    return dw;
  }

  // Gate weights -> scores -> router logits of layer l, with the balancing loss (§5) on
  // the scores and the z-loss (§4) on the logits: returns dL/du from dL/dw.
  std::vector<double> RouterLogitsBackward(int l, const TokenCache& tc,
                                           const std::vector<double>& dw) const {
    const LayerCache& lc = tc.layers[l];
    std::vector<double> dp(E, 0.0);
    double sel = 0;
    for (int e : lc.experts) sel += lc.p[e];
    if (c_.norm_topk_prob) {
      // w_k = scale * p_k / S, S = sum of the selected p.
      double dot = 0;
      for (int k = 0; k < K; ++k) dot += dw[k] * lc.p[lc.experts[k]];
      for (int k = 0; k < K; ++k) {
        dp[lc.experts[k]] += c_.router_scale * (dw[k] / sel - dot / (sel * sel));
      }
    } else {
      for (int k = 0; k < K; ++k) dp[lc.experts[k]] += c_.router_scale * dw[k];
    }
    // Balancing loss (§5): counts are detached constants.
    const double n_lm = routed_per_micro_[tc.micro];
    for (int e = 0; e < E; ++e) {
      dp[e] += c_.alpha_b / G * E * result_.expert_counts[l][tc.micro][e] / (n_lm * K) / n_lm;
    }
    // Softmax (or sigmoid) backward, plus the z-loss (§4) on the logits directly; its
    // d lse / du is the softmax of u whatever the scores.
    double pdp = 0;
    for (int e = 0; e < E; ++e) pdp += lc.p[e] * dp[e];
    const double lse = LogSumExp(lc.u);
    std::vector<double> du(E);
    for (int e = 0; e < E; ++e) {
      const double softmax = std::exp(lc.u[e] - lse);
      du[e] = (c_.sigmoid_scores ? lc.p[e] * (1.0 - lc.p[e]) * dp[e] : lc.p[e] * (dp[e] - pdp)) +
              c_.alpha_z * 2.0 * lse * softmax / Ntok;
    }
    return du;
  }

  // The attention block of layer l: dh (dL/dh after the block, for every token of the
  // sequence) becomes dL/dh before it.
  void AttentionBackward(int l, const SequenceCache& sc, Rows& dh) {
    const AttentionCache& ac = sc.attn[l];
    const int S = sc.len;
    const double* wo = P(LayerName(l, L, "wo"));
    double* dwo = Gr(LayerName(l, L, "wo"));
    Rows d_o(S, std::vector<double>(Dm, 0.0));
    Rows dq(S, std::vector<double>(Hq * hd, 0.0));
    Rows dk(S, std::vector<double>(Hk * hd, 0.0));
    Rows dv(S, std::vector<double>(Hk * hd, 0.0));
    for (int t = 0; t < S; ++t) {
      if (sc.doc_start[t] < 0) continue;
      for (int i = 0; i < Dm; ++i) {
        for (int j = 0; j < Dm; ++j) {
          dwo[i * Dm + j] += ac.o[t][i] * dh[t][j];
          d_o[t][i] += wo[i * Dm + j] * dh[t][j];
        }
      }
    }
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    for (int t = 0; t < S; ++t) {
      if (sc.doc_start[t] < 0) continue;
      for (int hh = 0; hh < Hq; ++hh) {
        const int j = hh / (Hq / Hk);
        const std::vector<double>& p = ac.p[t][hh];
        std::vector<double> dp(p.size(), 0.0);
        double pdp = 0;
        for (size_t x = 0; x < p.size(); ++x) {
          const int s = sc.doc_start[t] + static_cast<int>(x);
          for (int i = 0; i < hd; ++i) {
            dp[x] += d_o[t][hh * hd + i] * ac.v[s][j * hd + i];
            dv[s][j * hd + i] += p[x] * d_o[t][hh * hd + i];
          }
          pdp += p[x] * dp[x];
        }
        for (size_t x = 0; x < p.size(); ++x) {
          const int s = sc.doc_start[t] + static_cast<int>(x);
          const double ds = p[x] * (dp[x] - pdp) * scale;
          for (int i = 0; i < hd; ++i) {
            dq[t][hh * hd + i] += ds * ac.k[s][j * hd + i];
            dk[s][j * hd + i] += ds * ac.q[t][hh * hd + i];
          }
        }
      }
    }
    QkvBackward(l, sc, dq, dk, dv, dh);
  }

  // Attention's projections and norm of layer l: dq, dk (after RoPE) and dv of every token
  // into the weight gradients, and dL/dh before the block added into dh.
  void QkvBackward(int l, const SequenceCache& sc, Rows& dq, Rows& dk, const Rows& dv, Rows& dh) {
    const AttentionCache& ac = sc.attn[l];
    const double* wq = P(LayerName(l, L, "wq"));
    const double* wk = P(LayerName(l, L, "wk"));
    const double* wv = P(LayerName(l, L, "wv"));
    double* dwq = Gr(LayerName(l, L, "wq"));
    double* dwk = Gr(LayerName(l, L, "wk"));
    double* dwv = Gr(LayerName(l, L, "wv"));
    for (int t = 0; t < sc.len; ++t) {
      if (sc.doc_start[t] < 0) continue;
      const int pos = t - sc.doc_start[t];
      for (int hh = 0; hh < Hq; ++hh) Rope(dq[t].data() + hh * hd, pos, -1.0);
      for (int hh = 0; hh < Hk; ++hh) Rope(dk[t].data() + hh * hd, pos, -1.0);
      std::vector<double> db(Dm, 0.0);
      for (int i = 0; i < Dm; ++i) {
        for (int j = 0; j < Hq * hd; ++j) {
          dwq[i * Hq * hd + j] += ac.b[t][i] * dq[t][j];
          db[i] += wq[i * Hq * hd + j] * dq[t][j];
        }
        for (int j = 0; j < Hk * hd; ++j) {
          dwk[i * Hk * hd + j] += ac.b[t][i] * dk[t][j];
          dwv[i * Hk * hd + j] += ac.b[t][i] * dv[t][j];
          db[i] += wk[i * Hk * hd + j] * dk[t][j] + wv[i * Hk * hd + j] * dv[t][j];
        }
      }
      const std::vector<double> dh_norm =
          RmsNormBackward(ac.h_in[t], P(LayerName(l, L, "attn_norm")), ac.r[t], db,
                          Gr(LayerName(l, L, "attn_norm")));
      for (int i = 0; i < Dm; ++i) dh[t][i] += dh_norm[i];
    }
  }

  const ReferenceConfig& c_;
  const NamedTensors& params_;
  const std::vector<std::vector<ReferenceMicroBatch>>& batch_;
  const int V, Dm, L, E, K, H, G, KM;
  const int Hq, Hk, hd;     // attention heads (query, key-value) and head dimension; 0 without
  bool by_sample_ = false;  // sample or square mode: w_t depends on n_s
  // n_s: valid tokens per sample, a sample being (m, r, sample id); per MTP depth
  // (j, m, r, id) of depth j's valid labels.
  std::map<std::tuple<int, size_t, int64_t>, double> sample_size_;
  std::map<std::tuple<int, int, size_t, int64_t>, double> mtp_sample_size_;
  std::vector<double> routed_per_micro_;  // [G]
  double Dce = 0, Ntok = 0;               // D (§3) and N (§4)
  // Each MTP depth's input tokens and labels, [m][r][j - 1][t].
  std::vector<std::vector<std::vector<std::vector<int>>>> mtp_tok_, mtp_lab_;
  std::vector<TokenCache> cache_;  // every token of the batch, in batch order
  std::vector<SequenceCache> sequences_;
  ReferenceResult result_;
};

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> ReferenceParamShapes(
    const ReferenceConfig& c) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  shapes.push_back({"emb", {c.vocab, c.dim}});
  const int64_t kv_dim = c.attention ? c.n_kv_heads * (c.dim / c.n_heads) : 0;
  auto add_layer = [&](int l) {
    if (c.attention) {
      shapes.push_back({LayerName(l, c.layers, "attn_norm"), {c.dim}});
      shapes.push_back({LayerName(l, c.layers, "wq"), {c.dim, c.dim}});
      shapes.push_back({LayerName(l, c.layers, "wk"), {c.dim, kv_dim}});
      shapes.push_back({LayerName(l, c.layers, "wv"), {c.dim, kv_dim}});
      shapes.push_back({LayerName(l, c.layers, "wo"), {c.dim, c.dim}});
    }
    shapes.push_back({LayerName(l, c.layers, "norm"), {c.dim}});
    shapes.push_back({LayerName(l, c.layers, "router"), {c.dim, c.experts}});
    for (int e = 0; e < c.experts; ++e) {
      shapes.push_back({ExpertName(l, c.layers, e, "wg"), {c.dim, c.expert_dim}});
      shapes.push_back({ExpertName(l, c.layers, e, "wu"), {c.dim, c.expert_dim}});
      shapes.push_back({ExpertName(l, c.layers, e, "wd"), {c.expert_dim, c.dim}});
    }
  };
  for (int l = 0; l < c.layers; ++l) add_layer(l);
  shapes.push_back({"final_norm", {c.dim}});
  shapes.push_back({"out", {c.dim, c.vocab}});
  // MTP depth j (§15.1): its two norms, the [2D, D] projection's two halves, its layer.
  for (int j = 1; j <= c.mtp_depth; ++j) {
    const std::string mtp = absl::StrCat("mtp.", j, ".");
    shapes.push_back({mtp + "hnorm", {c.dim}});
    shapes.push_back({mtp + "enorm", {c.dim}});
    shapes.push_back({mtp + "proj_h", {c.dim, c.dim}});
    shapes.push_back({mtp + "proj_e", {c.dim, c.dim}});
    add_layer(c.layers + j - 1);
  }
  return shapes;
}

absl::StatusOr<ReferenceResult> ReferenceLossAndGrads(
    const ReferenceConfig& c, const NamedTensors& params,
    const std::vector<std::vector<ReferenceMicroBatch>>& global_batch) {
  GRADSUM_RETURN_IF_ERROR(CheckConfig(c));  // before ReferenceModel divides by its sizes
  return ReferenceModel(c, params, global_batch).Run();
}

}  // namespace gradsum::testing
