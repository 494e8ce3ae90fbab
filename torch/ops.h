#ifndef GRADSUM_TORCH_OPS_H_
#define GRADSUM_TORCH_OPS_H_

// gradsum's loss kernels as PyTorch autograd operations on CPU tensors (SEMANTICS.md §3-5,
// §13).
// The Python module `gradsum_torch` (module.cc) binds these; C++ code that uses libtorch can
// call them directly.
//
//   // micro-batch m of a step; D from one all_reduce before the step (python/dist.py)
//   at::Tensor ce = gradsum::torch_ops::CrossEntropy(logits, labels, d, {});
//   at::Tensor z = gradsum::torch_ops::RouterZLoss(router_logits, n_routed, 1e-3, {});
//   (ce + z).backward();   // each rank's own component; then a SUM gradient reduction
//
// Each op's forward runs the library's fused forward+backward kernel once and keeps the
// input gradient; backward only scales it by the incoming gradient (returned as is when
// that is exactly 1, as for `loss.backward()`). Under torch.no_grad, or when no input
// requires grad, CE runs its forward-only kernel. The global normalisers (D, N, the expert
// counts) are plain arguments, detached by construction: no op communicates.
//
// Inputs are converted with differentiable torch ops before the kernel sees them, so
// autograd returns gradients in the caller's dtypes and shapes: leading dimensions are
// flattened ([..., V] logits with [...] labels), non-contiguous tensors are copied, bf16
// hidden states and router logits are widened to f32 (the CE kernel reads f32 and bf16
// logits directly). Losses are 0-dim f32 tensors (summed in fp64, rounded once).
//
// Threads: at::get_num_threads(), as for torch's own CPU ops (torch.set_num_threads).
//
// Memory: gradient buffers of 32 MiB and more come from large_buffers.h, which keeps the
// last one freed for reuse (EmptyCache() unmaps it).
//
// Errors are thrown as StatusError carrying the library's absl::Status, before anything is
// computed for argument errors (dtypes, devices, shapes, labels outside [0, V), weights, a
// local D); a non-finite row of non-zero weight is reported by the kernel naming the row.
// The Python module raises ValueError for InvalidArgument, FailedPrecondition and
// OutOfRange, and RuntimeError for any other code.

#include <ATen/ATen.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "absl/status/status.h"
#include "losses/ce_options.h"
#include "losses/policy_loss.h"

namespace gradsum::torch_ops {

// An error of the library (or of these bindings' argument checks), with its status.
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(absl::Status status);
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// Which per-token CE weights w_t the loss uses (SEMANTICS.md §3).
struct CeWeights {
  // "token" (w_t = 1), "sample" (1 / n_s) or "square" (1 / sqrt(n_s)).
  std::string mode = "token";
  // Integer tensor shaped like the labels, equal id = same sample (within this micro-batch);
  // required for sample and square mode, ignored in token mode.
  c10::optional<at::Tensor> sample_ids;
  // Explicit w_t (floating, shaped like the labels, converted to f32), instead of a mode;
  // then `mode` must be "token" and `sample_ids` absent.
  c10::optional<at::Tensor> token_weights;
  // Labels equal to this are not valid: weight 0, zero gradient.
  int64_t ignore_index = -100;
};

// The CE options of SEMANTICS.md §3.2 (losses/cross_entropy.h CrossEntropyOptions), each
// global in scope and 0 = off: label smoothing eps in [0, 1) over the whole vocabulary, the
// logit softcap c * tanh(z / c), and the output z-loss alpha_lse * lse^2 per token (with the
// CE's weights and D). Bad values are the kernel's InvalidArgument, naming them.
using CeOptions = losses::CeOptions;

// L_ce[r, m] of §3 for logits [..., V] (f32 or bf16) and integer labels [...]:
// sum_t w_t * CE_t / D (with `options`, §3.2's CE_t plus alpha_lse lse_t^2).
// global_weight_sum is D, the sum of w_t over all ranks and micro-batches of the step.
// D == 0 gives 0 and a zero gradient.
at::Tensor CrossEntropy(const at::Tensor& logits, const at::Tensor& labels,
                        double global_weight_sum, const CeWeights& weights,
                        const CeOptions& options = {});

// The same loss for logits = hidden @ weight^T, computed chunk by chunk without the full
// logits (losses/linear_cross_entropy.h). hidden: [..., Dm]; weight: [V, Dm], the layout of
// torch.nn.Linear(Dm, V).weight (read in place, no transposed copy); labels: [...].
// f32 or bf16 (bf16 is widened to f32 copies first). chunk_rows: 0 = automatic.
// The kernel always computes both gradients, also when neither is needed.
at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& labels, double global_weight_sum,
                              const CeWeights& weights, int64_t chunk_rows,
                              const CeOptions& options = {});

// L_z[r, m] of §4 for one MoE layer: alpha * sum over routed t of logsumexp(u_t)^2 / N.
// router_logits: [T, E] (f32, or bf16 widened to f32); global_routed_tokens: N, routed
// tokens of the whole step over all ranks and micro-batches; input_mask: [T] of 0/1
// (bool or integer), absent = every row routed.
at::Tensor RouterZLoss(const at::Tensor& router_logits, int64_t global_routed_tokens, double alpha,
                       const c10::optional<at::Tensor>& input_mask);

// L_bal[r, m] of §5 for one MoE layer and micro-batch:
// alpha / G * E * sum_e (c_e / (N K)) * (sum over routed t of p_t[e]) / N, N = sum_e c_e / K.
// router_logits: [T, E] router logits (p = their softmax, computed here), or with
// `inputs_are_probs` the probabilities p themselves (e.g. the softmax the model routed
// with; the gradient then flows through the caller's softmax). global_expert_counts: E
// integers, c[l, m, :] summed over all ranks (python/dist.py); top_k: K; num_micro_batches: G.
at::Tensor LoadBalancingLoss(const at::Tensor& router_logits,
                             const at::Tensor& global_expert_counts, int64_t top_k,
                             int64_t num_micro_batches, double alpha,
                             const c10::optional<at::Tensor>& input_mask, bool inputs_are_probs);

// The token-level policy loss of §13 (losses/policy_loss.h): everything but the logits is
// detached. Optional per-token tensors are shaped like the labels.
struct PolicyLossArgs {
  c10::optional<at::Tensor> mask;         // 0 = not a valid token (bool or integer)
  c10::optional<at::Tensor> is_weights;   // rollout importance weights iw_t (floating)
  c10::optional<at::Tensor> ref_logprob;  // for the KL term (floating)
  double eps_low = 0.2;
  double eps_high = 0.2;
  double dual_clip_c = 3.0;  // 0 disables the dual clip
  double kl_coef = 0.0;
  std::string kl_estimator = "k3";         // "k1", "k2" or "k3"
  double is_cap = 2.0;                     // +inf: no truncation
  std::string aggregation = "token_mean";  // or "seq_mean_token_mean"
  // The detached global normalisers: N for token-mean; S and n_s per token (integer,
  // shaped like the labels) for seq-mean-token-mean. The other mode's must be absent.
  c10::optional<double> global_valid_tokens;
  c10::optional<double> global_sequences;
  c10::optional<at::Tensor> sequence_valid_tokens;
  int64_t ignore_index = -100;
};

struct PolicyLossOutput {
  at::Tensor loss;                   // 0-dim f32: L_pg[r, m], the KL part included
  losses::PolicyLossResult metrics;  // this call's detached metrics (§13)
};

// L_pg[r, m] of §13 for logits [..., V] (f32 or bf16), integer labels [...] and float
// old_logprob, advantages [...] (converted to f32). The fused kernel always computes the
// gradient (there is no forward-only policy kernel); backward only scales it. Besides the
// library's own checks, seq-mean-token-mean refuses an S smaller than this call's share of
// sequences, sum over valid t of 1 / n_s (FailedPrecondition, as a local N is).
PolicyLossOutput PolicyLoss(const at::Tensor& logits, const at::Tensor& labels,
                            const at::Tensor& old_logprob, const at::Tensor& advantages,
                            const PolicyLossArgs& args);

// The w_t of §3 for one micro-batch (losses/token_weights.h): f32, shaped like `labels`.
at::Tensor TokenWeights(const at::Tensor& labels, const c10::optional<at::Tensor>& sample_ids,
                        const std::string& mode, int64_t ignore_index);

// This rank's (token, slot) assignments per expert for one layer and micro-batch
// (losses/step_stats.h): int64 [num_experts]. topk_indices: integer [T, K].
at::Tensor CountExpertAssignments(const at::Tensor& topk_indices, int64_t num_experts,
                                  const c10::optional<at::Tensor>& input_mask);

// Unmaps the large gradient buffer kept for reuse (large_buffers.h); returns its bytes.
size_t EmptyCache();

// For the overhead benchmark (bench/torch_losses_bench.py): seconds per call of
// losses::CrossEntropyForwardBackward on these tensors (f32 or bf16 logits [N, V], int64
// labels [N]), called `iters` times in a C++ loop into one preallocated gradient buffer
// (allocated as the op allocates it, and touched by one untimed call first), with
// at::get_num_threads() threads.
double CrossEntropyKernelSecondsPerCall(const at::Tensor& logits, const at::Tensor& labels,
                                        double global_weight_sum, int64_t iters);

}  // namespace gradsum::torch_ops

#endif  // GRADSUM_TORCH_OPS_H_
