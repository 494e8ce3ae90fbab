// The Python extension `gradsum_torch._C`: torch/ops.h's autograd operations for Debian's
// python3-torch. The package gradsum_torch (python/__init__.py) re-exports them; its
// docstrings below are what `help(gradsum_torch.cross_entropy)` shows.
//
// The GIL is released while a kernel runs. A StatusError (the library's absl::Status) becomes
// ValueError for argument errors (InvalidArgument, FailedPrecondition, OutOfRange) and
// RuntimeError otherwise, with the status text as the message; nothing aborts the interpreter.

#include <torch/csrc/utils/pybind.h>

#include <exception>
#include <string>
#include <tuple>

#include "absl/status/status.h"
#include "torch/ops.h"

namespace gradsum::torch_ops {
namespace {

namespace py = pybind11;

bool IsArgumentError(absl::StatusCode code) {
  return code == absl::StatusCode::kInvalidArgument ||
         code == absl::StatusCode::kFailedPrecondition || code == absl::StatusCode::kOutOfRange;
}

CeWeights MakeCeWeights(const std::string& mode, const c10::optional<at::Tensor>& sample_ids,
                        const c10::optional<at::Tensor>& token_weights, int64_t ignore_index) {
  CeWeights w;
  w.mode = mode;
  w.sample_ids = sample_ids;
  w.token_weights = token_weights;
  w.ignore_index = ignore_index;
  return w;
}

constexpr const char* kCrossEntropyDoc = R"doc(
Rank-local cross-entropy component L_ce[r, m] of SEMANTICS.md §3, as an autograd op:

    sum over tokens t of w_t * (logsumexp(z_t) - z_t[y_t]) / D

logits: [..., V] float32 or bfloat16 CPU tensor; labels: integer tensor [...] (ignore_index
or a class in [0, V)); global_weight_sum: D, the sum of w_t over ALL ranks and micro-batches
of the step (gradsum_torch.dist.step_stats), a detached constant; mode: "token" (w_t = 1),
"sample" (1 / n_s) or "square" (1 / sqrt(n_s)), which need sample_ids shaped like labels;
token_weights: explicit w_t instead of a mode. Returns a 0-dim float32 tensor. Backward
returns the fused kernel's gradient (computed in fp32 and stored in the logits' dtype).
D == 0 gives 0 and a zero gradient. Raises ValueError with the library's message for a
label outside [0, V), mismatched shapes, non-finite logits in a weighted row, or a D
smaller than this call's own weight sum.

The CE options of SEMANTICS.md §3.2, keyword-only, 0 = off (the defaults, the same results
as without them): label_smoothing eps in [0, 1) (F.cross_entropy's label_smoothing: the
target (1 - eps) onehot + eps / V over the whole vocabulary); logit_softcap c >= 0 (the
loss sees c * tanh(z / c), Gemma 2's cap, with its gradient); alpha_lse >= 0 (PaLM's output
z-loss: alpha_lse * logsumexp(z_t)^2 per token, with the CE's weights and D). Out-of-range
values raise ValueError naming them.
)doc";

constexpr const char* kLinearCrossEntropyDoc = R"doc(
The cross-entropy of logits = hidden @ weight.T without ever holding the [N, V] logits
(chunks of rows through the fused kernel; SEMANTICS.md §3). hidden: [..., Dm]; weight:
[V, Dm], the layout of torch.nn.Linear(Dm, V, bias=False).weight; labels: [...]; other
arguments as cross_entropy. float32 (bfloat16 inputs are widened to float32 copies).
chunk_rows: rows per chunk, 0 = automatic (4 MiB of logits, at least 32 rows). Forward
computes both gradients; backward only scales them. label_smoothing, logit_softcap and
alpha_lse: as cross_entropy.
)doc";

constexpr const char* kZLossDoc = R"doc(
Router z-loss component of one MoE layer (SEMANTICS.md §4):

    alpha * sum over routed t of logsumexp(u_t)^2 / N

router_logits: [T, E] float32 (or bfloat16, widened); global_routed_tokens: N, routed tokens
of the whole step over all ranks and micro-batches (StepStats.global_routed_tokens);
input_mask: [T] of 0/1 (bool or integer), None = every row routed. Returns 0-dim float32.
)doc";

constexpr const char* kBalancingLossDoc = R"doc(
Load-balancing loss component of one MoE layer and micro-batch (SEMANTICS.md §5):

    alpha / G * E * sum_e (c_e / (N K)) * (sum over routed t of p_t[e]) / N,  N = sum_e c_e / K

router_logits: [T, E] router logits (p = their full softmax, computed here), or with
probs=True the probabilities p themselves (the gradient then flows through your softmax);
global_expert_counts: the E (token, slot) counts of this layer and micro-step summed over
all ranks (gradsum_torch.dist.expert_counts), detached; top_k: K; num_micro_batches: G.
A micro-step with N == 0 contributes 0. Returns 0-dim float32.
)doc";

constexpr const char* kPolicyLossDoc = R"doc(
The token-level policy loss of SEMANTICS.md §13 (gradsum_torch.policy_loss wraps this and
returns the metrics as a dict): (loss, kl, kl_sum, valid_tokens, clip_count,
dual_clip_count, ratio_sum, ratio_max, ratio_min).
)doc";

// gradsum_torch.policy_loss's kernel call: the loss and the metrics as a flat tuple.
using PolicyLossTuple =
    std::tuple<at::Tensor, double, double, int64_t, int64_t, int64_t, double, double, double>;

PolicyLossTuple PolicyLossBinding(
    const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& old_logprob,
    const at::Tensor& advantages, c10::optional<double> global_valid_tokens,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& is_weights,
    const c10::optional<at::Tensor>& ref_logprob, double eps_low, double eps_high,
    double dual_clip_c, double kl_coef, const std::string& kl_estimator, double is_cap,
    const std::string& aggregation, c10::optional<double> global_sequences,
    const c10::optional<at::Tensor>& sequence_valid_tokens, int64_t ignore_index) {
  PolicyLossArgs a;
  a.mask = mask;
  a.is_weights = is_weights;
  a.ref_logprob = ref_logprob;
  a.eps_low = eps_low;
  a.eps_high = eps_high;
  a.dual_clip_c = dual_clip_c;
  a.kl_coef = kl_coef;
  a.kl_estimator = kl_estimator;
  a.is_cap = is_cap;
  a.aggregation = aggregation;
  a.global_valid_tokens = global_valid_tokens;
  a.global_sequences = global_sequences;
  a.sequence_valid_tokens = sequence_valid_tokens;
  a.ignore_index = ignore_index;
  const PolicyLossOutput out = PolicyLoss(logits, labels, old_logprob, advantages, a);
  const losses::PolicyLossResult& r = out.metrics;
  return {out.loss,          r.local_kl_loss, r.local_kl_sum, r.local_valid_tokens, r.clip_count,
          r.dual_clip_count, r.ratio_sum,     r.ratio_max,    r.ratio_min};
}

}  // namespace
}  // namespace gradsum::torch_ops

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  namespace ops = gradsum::torch_ops;
  m.doc() = "gradsum's loss kernels as torch autograd operations (see the gradsum_torch package)";

  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ops::StatusError& e) {
      PyErr_SetString(
          ops::IsArgumentError(e.status().code()) ? PyExc_ValueError : PyExc_RuntimeError,
          e.what());
    }
  });

  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def(
      "cross_entropy",
      [](const at::Tensor& logits, const at::Tensor& labels, double global_weight_sum,
         const std::string& mode, const c10::optional<at::Tensor>& sample_ids,
         const c10::optional<at::Tensor>& token_weights, int64_t ignore_index,
         double label_smoothing, double logit_softcap, double alpha_lse) {
        return ops::CrossEntropy(logits, labels, global_weight_sum,
                                 ops::MakeCeWeights(mode, sample_ids, token_weights, ignore_index),
                                 {label_smoothing, logit_softcap, alpha_lse});
      },
      py::arg("logits"), py::arg("labels"), py::arg("global_weight_sum"), py::arg("mode") = "token",
      py::kw_only(), py::arg("sample_ids") = py::none(), py::arg("token_weights") = py::none(),
      py::arg("ignore_index") = -100, py::arg("label_smoothing") = 0.0,
      py::arg("logit_softcap") = 0.0, py::arg("alpha_lse") = 0.0, release, ops::kCrossEntropyDoc);
  m.def(
      "linear_cross_entropy",
      [](const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
         double global_weight_sum, const std::string& mode,
         const c10::optional<at::Tensor>& sample_ids,
         const c10::optional<at::Tensor>& token_weights, int64_t ignore_index, int64_t chunk_rows,
         double label_smoothing, double logit_softcap, double alpha_lse) {
        return ops::LinearCrossEntropy(
            hidden, weight, labels, global_weight_sum,
            ops::MakeCeWeights(mode, sample_ids, token_weights, ignore_index), chunk_rows,
            {label_smoothing, logit_softcap, alpha_lse});
      },
      py::arg("hidden"), py::arg("weight"), py::arg("labels"), py::arg("global_weight_sum"),
      py::arg("mode") = "token", py::kw_only(), py::arg("sample_ids") = py::none(),
      py::arg("token_weights") = py::none(), py::arg("ignore_index") = -100,
      py::arg("chunk_rows") = 0, py::arg("label_smoothing") = 0.0, py::arg("logit_softcap") = 0.0,
      py::arg("alpha_lse") = 0.0, release, ops::kLinearCrossEntropyDoc);
  m.def("z_loss", &ops::RouterZLoss, py::arg("router_logits"), py::arg("global_routed_tokens"),
        py::arg("alpha") = 0.001, py::kw_only(), py::arg("input_mask") = py::none(), release,
        ops::kZLossDoc);
  m.def(
      "balancing_loss",
      [](const at::Tensor& router_logits, const at::Tensor& global_expert_counts, int64_t top_k,
         int64_t num_micro_batches, double alpha, const c10::optional<at::Tensor>& input_mask,
         bool probs) {
        return ops::LoadBalancingLoss(router_logits, global_expert_counts, top_k, num_micro_batches,
                                      alpha, input_mask, probs);
      },
      py::arg("router_logits"), py::arg("global_expert_counts"), py::arg("top_k"),
      py::arg("num_micro_batches") = 1, py::arg("alpha") = 0.001, py::kw_only(),
      py::arg("input_mask") = py::none(), py::arg("probs") = false, release,
      ops::kBalancingLossDoc);
  m.def("_policy_loss", &ops::PolicyLossBinding, py::arg("logits"), py::arg("labels"),
        py::arg("old_logprob"), py::arg("advantages"), py::arg("global_valid_tokens"),
        py::arg("mask"), py::arg("is_weights"), py::arg("ref_logprob"), py::arg("eps_low"),
        py::arg("eps_high"), py::arg("dual_clip_c"), py::arg("kl_coef"), py::arg("kl_estimator"),
        py::arg("is_cap"), py::arg("aggregation"), py::arg("global_sequences"),
        py::arg("sequence_valid_tokens"), py::arg("ignore_index"), release, ops::kPolicyLossDoc);
  m.def("token_weights", &ops::TokenWeights, py::arg("labels"), py::arg("sample_ids") = py::none(),
        py::arg("mode") = "token", py::arg("ignore_index") = -100, release,
        "The per-token CE weights w_t of SEMANTICS.md §3 (float32, shaped like labels), "
        "computed by the library (sample/square modes need sample_ids).");
  m.def("count_expert_assignments", &ops::CountExpertAssignments, py::arg("topk_indices"),
        py::arg("num_experts"), py::arg("input_mask") = py::none(), release,
        "This rank's (token, slot) assignments per expert for one layer and micro-batch: "
        "int64 [num_experts] from the [T, K] top-k expert ids (padding rows not counted).");
  m.def("empty_cache", &ops::EmptyCache,
        "Unmaps the large gradient buffer (32 MiB or more) that the ops keep for reuse between "
        "calls, as torch.cuda.empty_cache() does for CUDA's cache; returns its bytes.");
  m.def("_cross_entropy_kernel_seconds_per_call", &ops::CrossEntropyKernelSecondsPerCall,
        py::arg("logits"), py::arg("labels"), py::arg("global_weight_sum"), py::arg("iters"),
        release, "Benchmark helper: the C++ kernel called directly in a loop.");
}
