#ifndef GRADSUM_TESTING_REFERENCE_MOE_LM_H_
#define GRADSUM_TESTING_REFERENCE_MOE_LM_H_

// The single-process reference for moe_lm: SEMANTICS.md §10's model, forward and
// backward on the whole global batch, with the global loss L = L_ce + L_z + L_bal of
// §3-6 computed from global counts directly. Plain loops in double precision, written
// for reading, not speed: it is what every parity test compares the distributed
// trainer's SUM-reduced gradients against (§2).
//
//   ReferenceConfig config{.vocab = 256, .dim = 8, ...};
//   NamedTensors params = ...;  // names from ReferenceParamShapes(config)
//   std::vector<std::vector<ReferenceMicroBatch>> batch(G);  // batch[m][r]
//   absl::StatusOr<ReferenceResult> ref = ReferenceLossAndGrads(config, params, batch);
//   ref->grads["layers.0.router"]  // dL/dWr_0, [D, E] row-major
//
// With config.attention, each layer starts with the attention block of §10 (GQA, RoPE at
// positions counted from each document's start, attention restricted to the token's own
// document and earlier tokens); each micro-batch is then seq_len-token sequences whose
// documents doc_start gives.
//
// CE weights w_t follow config.ce_mode (§3): token (1 for valid tokens), sample (1 / n_s)
// or square (1 / sqrt(n_s)), n_s = the valid tokens of sample s, a sample being the tokens
// of one [m][r] micro-batch with equal sample id. Parameter names and shapes
// are those of the training binary's dumps: `emb` [V,D], `layers.{l}.norm` [D],
// `layers.{l}.router` [D,E], `layers.{l}.experts.{e}.wg` [D,H], `.wu` [D,H], `.wd` [H,D],
// `final_norm` [D], `out` [D,V].

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "losses/ce_options.h"

namespace gradsum::testing {

// SEMANTICS.md §10 sizes and §4-5 loss weights.
struct ReferenceConfig {
  int vocab = 256;     // V
  int dim = 8;         // D
  int layers = 1;      // L
  int experts = 4;     // E
  int top_k = 2;       // K
  int expert_dim = 8;  // H
  bool norm_topk_prob = true;
  double router_scale = 1.0;
  double alpha_b = 0.001;
  double alpha_z = 0.001;
  // The CE options of §3.2 (losses/ce_options.h; 0 = off): label smoothing eps, logit
  // softcap c, output z-loss.
  losses::CeOptions ce;
  // §10's attention block.
  bool attention = false;
  int n_heads = 2;
  int n_kv_heads = 1;
  double rope_theta = 10000.0;
  int ignore_index = -100;
  std::string ce_mode = "token";  // token | sample | square (§3)
  // §5.1: sigmoid router scores instead of softmax (alpha_b must then be 0), and the
  // expert bias b[l][e] added to the scores for the top-K selection only (empty: none).
  bool sigmoid_scores = false;
  std::vector<std::vector<double>> expert_bias;
  // Multi-token prediction (SEMANTICS.md §15.1): k depths (0 = off) and the loss weight.
  // Depth j's input token and label at t are token[t + j] and label[t + j] when t + j is a
  // routed token of t's sequence and document (equal doc_start), else 0 and ignore_index;
  // its block, layer L + j - 1 and the shared final norm and head give its CE, weighted by
  // mtp_scale / k over its own D_j. Needs every micro-batch's seq_len and doc_start (also
  // without attention), and no expert bias.
  int mtp_depth = 0;
  double mtp_scale = 0.1;
};

// Row-major tensors by parameter name.
using NamedTensors = std::map<std::string, std::vector<double>>;

// Every parameter's name and shape, in forward order.
std::vector<std::pair<std::string, std::vector<int64_t>>> ReferenceParamShapes(
    const ReferenceConfig& config);

// The tokens of one rank's micro-batch, flattened (sequence boundaries do not matter
// for a per-token model; samples are named by sample_ids). Equal lengths.
struct ReferenceMicroBatch {
  std::vector<int32_t> tokens;      // in [0, V)
  std::vector<int32_t> labels;      // in [0, V) or ignore_index
  std::vector<int32_t> mask;        // 1 routed, 0 padding (whose label must be ignore_index)
  std::vector<int64_t> sample_ids;  // sample / square mode: one per token; else may be empty
  // Attention only: tokens per sequence (the micro-batch is tokens.size() / seq_len of
  // them), and per token the index within its sequence of its document's first token, -1
  // for padding.
  int seq_len = 0;
  std::vector<int32_t> doc_start;
};

struct ReferenceResult {
  // Global values of each term (§3, §4, §5) and their sum (§6).
  // ce is §3.2's CE (smoothed, of the capped logits) WITHOUT the output z-loss, which is
  // z_out = alpha_lse * sum_t w_t lse_t^2 / D (0 unless alpha_lse > 0): the two display
  // terms of moe_lm. An MTP depth's term holds its own head's output z-loss.
  double ce = 0, z = 0, bal = 0, z_out = 0;
  std::vector<double> mtp;  // per MTP depth: mtp_scale / k * L_j (§15.1)
  double total() const {
    double t = ce + z + bal + z_out;
    for (double v : mtp) t += v;
    return t;
  }
  std::vector<double> mtp_weight_sum;  // per MTP depth: D_j
  double valid_tokens = 0;             // tokens with a label (D of §3 in token mode)
  double ce_weight_sum = 0;            // D of §3: the sum of w_t
  double routed_tokens = 0;            // N of §4
  // c[l][m][e] of §5 (l < L + mtp_depth: the MTP depths' layers after the main ones): (token, slot)
  // assignments to expert e at micro-step m, all ranks.
  std::vector<std::vector<std::vector<int64_t>>> expert_counts;
  // dL/dtheta for every parameter of ReferenceParamShapes.
  NamedTensors grads;
};

// Runs forward and backward on `global_batch[m][r]` (G micro-steps, any number of ranks).
// InvalidArgument if a parameter is missing or mis-sized, a config size is
// non-positive, top_k > experts, a token is outside [0, V), a label is neither in
// [0, V) nor ignore_index, a padding token has a real label, a micro-batch's vectors
// differ in length (sample_ids too, outside token mode), or ce_mode is unknown; with
// attention, heads that do not divide, or sequences and document starts that do not fit.
absl::StatusOr<ReferenceResult> ReferenceLossAndGrads(
    const ReferenceConfig& config, const NamedTensors& params,
    const std::vector<std::vector<ReferenceMicroBatch>>& global_batch);

}  // namespace gradsum::testing

#endif  // GRADSUM_TESTING_REFERENCE_MOE_LM_H_
