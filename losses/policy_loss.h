#ifndef GRADSUM_LOSSES_POLICY_LOSS_H_
#define GRADSUM_LOSSES_POLICY_LOSS_H_

// Fused token-level RL policy loss forward + backward on the CPU (SEMANTICS.md §13).
//
// One call computes this rank's local component of the clipped policy-gradient loss
// (PPO / GRPO style, with dual clip, truncated rollout importance weights and a KL term
// against a reference policy) of one micro-batch,
//
//   L_pg[r, m] = sum over valid tokens t of  c_t * (min(iw_t, is_cap) * pg_t + kl_coef * kl_t),
//
// with c_t = 1 / N (token-mean) or 1 / (n_s S) (seq-mean-token-mean), N, n_s and S GLOBAL
// detached counts of the optimizer step; and its gradient with respect to the logits,
// dL/dz_t = c_t g_t (onehot(y_t) - softmax(z_t)), g_t = dterm_t / dlogp_t. As for CE (§3),
// each rank back-propagates only its own component, and after a SUM gradient reduction the
// gradient is the global batch's, whatever the mesh or the number of micro-batches.
//
//   PolicyLossInputs in;
//   in.labels = labels;  in.old_logprob = old;  in.advantages = adv;  // per token
//   in.ref_logprob = ref;                                            // optional (KL)
//   PolicyLossOptions opt;  opt.kl_coef = 0.001;
//   PolicyLossNormalizer norm;  norm.global_valid_tokens = N;        // world SUM, detached
//   absl::StatusOr<PolicyLossResult> r =
//       PolicyLossForwardBackward(logits, in, norm, grad_logits, opt);
//   // r->local_loss is L_pg[r, m]; AddPolicyLossToDisplay(display, *r) logs it (§8).
//
// Implementation: the fused CE row kernel (losses/cross_entropy_rows.h) reads each row
// once and gives logp_t = -CE_t; its per-row gradient scale hook (RowScaleHook) turns the
// row's softmax-minus-onehot gradient into this loss's, -(c_t g_t) (softmax - onehot), so
// there is no second softmax and the cost is CE's plus O(1) fp64 work per row. The per-token
// policy arithmetic is fp64. Results do not depend on the thread count.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/tensor.h"
#include "data/streams.h"
#include "losses/display.h"

namespace gradsum::losses {

enum class KlEstimator {
  kK1 = 0,  // d = logp - ref
  kK2 = 1,  // 0.5 d^2
  kK3 = 2,  // exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]
};

enum class PolicyLossAggregation {
  kTokenMean = 0,         // c_t = 1 / N
  kSeqMeanTokenMean = 1,  // c_t = 1 / (n_s S)
};

struct PolicyLossOptions {
  // Clip range of the ratio: [1 - eps_low, 1 + eps_high]. Finite, >= 0.
  double eps_low = 0.2;
  double eps_high = 0.2;
  // Dual clip for A < 0: the term is capped at -c A. 0 disables it; else c > 1.
  double dual_clip_c = 3.0;
  // Weight of the KL term (its weight in the loss is kl_coef * c_t). Finite, >= 0; > 0
  // needs ref_logprob.
  double kl_coef = 0.0;
  KlEstimator kl_estimator = KlEstimator::kK3;
  PolicyLossAggregation aggregation = PolicyLossAggregation::kTokenMean;
  // Truncation cap of the importance weights: min(iw_t, is_cap). > 0; +inf: no truncation.
  double is_cap = 2.0;
  // Labels equal to this are not valid (as a mask of 0).
  int64_t ignore_index = data::kIgnoreIndex;
  // Threads for the row blocks (the caller's thread included). <= 1: single-threaded.
  int num_threads = 2;
};

// Per-token inputs of one call (N tokens = rows of the logits). All are detached.
struct PolicyLossInputs {
  absl::Span<const int64_t> labels;     // N: the sampled token, or ignore_index
  absl::Span<const float> old_logprob;  // N: log-prob under the sampling policy
  absl::Span<const float> advantages;   // N
  absl::Span<const uint8_t> mask;       // N, or empty (all 1): 0 = not a valid token
  absl::Span<const float> is_weights;   // N, or empty (all 1): rollout importance weights
  absl::Span<const float> ref_logprob;  // N, or empty (no KL term)
};

// The detached global normalisers of the optimizer step (SEMANTICS.md §13).
struct PolicyLossNormalizer {
  // Token-mean: N, the world SUM of valid tokens over all micro-batches of the step.
  double global_valid_tokens = 0.0;
  // Seq-mean-token-mean: S, the world SUM of the sequences with a valid token, and per
  // token n_s, the valid-token count of its whole sequence (global across SP ranks).
  double global_sequences = 0.0;
  absl::Span<const int64_t> sequence_valid_tokens;  // N entries; read for valid tokens only
};

struct PolicyLossResult {
  // sum_t c_t * term_t over this call's valid tokens: the local component L_pg[r, m],
  // the KL part included.
  double local_loss = 0.0;
  // The KL part of local_loss: sum_t c_t * kl_coef * kl_t.
  double local_kl_loss = 0.0;
  // sum_t kl_t, undivided (0 without ref_logprob).
  double local_kl_sum = 0.0;
  // Tokens where the PPO clip is active (pg2 > pg1), and where the dual clip caps the term.
  int64_t clip_count = 0;
  int64_t dual_clip_count = 0;
  // sum, max and min of the ratio r_t over the valid tokens (max/min are 0 when there are
  // none; AddPolicyLossToDisplay then adds no value to the max/min metrics).
  double ratio_sum = 0.0;
  double ratio_max = 0.0;
  double ratio_min = 0.0;
  int64_t local_valid_tokens = 0;
};

// Computes the local policy-loss component and writes dL/dlogits into `grad_logits`.
//
// logits:      [N, V] f32 or bf16 on the CPU, V >= 1.
// grad_logits: [N, V], same dtype; may be the same memory as `logits` (in place). Fully
//              overwritten on success: invalid tokens get zero rows.
// A token is valid when its label is not ignore_index and its mask (if given) is not 0.
// N = 0 (no valid token in the step) gives loss 0 and an exactly zero gradient.
//
// Errors (checked before anything is written), each naming the value:
// - InvalidArgument: bad shapes, dtypes or span lengths; a valid token's label outside
//   [0, V); a valid token's non-finite advantage, old_logprob or ref_logprob; a negative or
//   non-finite importance weight; an option out of range or NaN (eps < 0, c in (0, 1],
//   kl_coef < 0, is_cap <= 0, kl_coef > 0 without ref_logprob); a negative or non-finite
//   normaliser; n_s < 1 for a valid token.
// - FailedPrecondition: N (or S) smaller than this call's own count (a local count passed
//   where the global one belongs).
// - InvalidArgument naming the first offending row: a valid row whose logits contain NaN
//   or +inf, are all -inf, or whose target logit is -inf. `grad_logits` is then partly
//   written and must not be used.
absl::StatusOr<PolicyLossResult> PolicyLossForwardBackward(const TensorView& logits,
                                                           const PolicyLossInputs& inputs,
                                                           const PolicyLossNormalizer& normalizer,
                                                           const TensorView& grad_logits,
                                                           const PolicyLossOptions& options = {});

// Display registration (SEMANTICS.md §8, §13): `<prefix>` (kLoss: L_pg, KL included) and
// the metrics `<prefix>/kl` (the KL part of the loss), `<prefix>/kl_sum`,
// `<prefix>/valid_tokens`, `<prefix>/clip_count`, `<prefix>/dual_clip_count`,
// `<prefix>/ratio_sum` (SUM), `<prefix>/ratio_max` (MAX), `<prefix>/ratio_min` (MIN). After
// Reduce, clip fraction = clip_count / valid_tokens and mean ratio = ratio_sum /
// valid_tokens (PolicyLossClipFraction, PolicyLossMeanRatio).
absl::Status RegisterPolicyLossDisplay(StepDisplay& display, absl::string_view prefix = "policy");
// Adds one call's (micro-batch's) result; the max/min only when it had valid tokens.
absl::Status AddPolicyLossToDisplay(StepDisplay& display, const PolicyLossResult& result,
                                    absl::string_view prefix = "policy");
// The global clip fraction and mean ratio from reduced values (0 when no token was valid).
absl::StatusOr<double> PolicyLossClipFraction(const StepDisplayValues& values,
                                              absl::string_view prefix = "policy");
absl::StatusOr<double> PolicyLossMeanRatio(const StepDisplayValues& values,
                                           absl::string_view prefix = "policy");

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_POLICY_LOSS_H_
