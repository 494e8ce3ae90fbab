#include "torch/ops.h"

#include <ATen/Parallel.h>
#include <cblas.h>
#include <torch/csrc/autograd/custom_function.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/tensor.h"
#include "losses/cross_entropy.h"
#include "losses/linear_cross_entropy.h"
#include "losses/policy_loss.h"
#include "losses/router_losses.h"
#include "losses/step_stats.h"
#include "losses/token_weights.h"
#include "torch/large_buffers.h"

namespace gradsum::torch_ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

[[noreturn]] void Fail(absl::string_view op, absl::string_view message) {
  throw StatusError(absl::InvalidArgumentError(absl::StrCat(op, ": ", message)));
}

void ThrowIfError(const absl::Status& s) {
  if (!s.ok()) throw StatusError(s);
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> s) {
  ThrowIfError(s.status());
  return *std::move(s);
}

std::string Describe(const at::Tensor& t) {
  return absl::StrCat(std::string(c10::toString(t.scalar_type())), c10::str(t.sizes()), "@",
                      c10::str(t.device()));
}

void CheckCpu(const at::Tensor& t, absl::string_view op, absl::string_view what) {
  if (!t.defined()) Fail(op, absl::StrCat(what, " is an undefined tensor"));
  if (t.device().type() != at::kCPU) {
    Fail(op, absl::StrCat(what, " must be a CPU tensor, got ", Describe(t),
                          " (Debian's torch is built without CUDA; only CPU kernels are bound)"));
  }
  // The kernels read a strided tensor's memory; a sparse or mkldnn tensor has none to read
  // (torch then fails inside the op with its own RuntimeError, naming no argument).
  if (t.layout() != at::kStrided) {
    Fail(op, absl::StrCat(what, " must be a dense (strided) tensor, got a ", c10::str(t.layout()),
                          " tensor ", Describe(t), " (convert it with .to_dense())"));
  }
}

void CheckFloat(const at::Tensor& t, absl::string_view op, absl::string_view what) {
  CheckCpu(t, op, what);
  if (t.scalar_type() != at::kFloat && t.scalar_type() != at::kBFloat16) {
    Fail(op, absl::StrCat(what, " must be float32 or bfloat16, got ", Describe(t)));
  }
}

// `t` as a contiguous tensor of `type` with shape `shape` (1-D: [numel]); an integer
// tensor is required. Not differentiable (labels, ids, masks).
at::Tensor IntegerInput(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType type,
                        absl::string_view op, absl::string_view what, absl::string_view shape_of) {
  CheckCpu(t, op, what);
  if (!at::isIntegralType(t.scalar_type(), /*includeBool=*/true)) {
    Fail(op, absl::StrCat(what, " must be an integer or bool tensor, got ", Describe(t)));
  }
  if (t.sizes() != shape) {
    Fail(op, absl::StrCat(what, " has shape ", c10::str(t.sizes()), ", expected ", c10::str(shape),
                          " (", shape_of, ")"));
  }
  return t.detach().to(type).contiguous().view({-1});
}

TensorView View(const at::Tensor& t) {
  DType dtype = DType::kF32;
  switch (t.scalar_type()) {
    case at::kFloat:
      dtype = DType::kF32;
      break;
    case at::kBFloat16:
      dtype = DType::kBF16;
      break;
    case at::kLong:
      dtype = DType::kI64;
      break;
    default:
      throw StatusError(absl::InternalError(absl::StrCat("no TensorView for ", Describe(t))));
  }
  const at::IntArrayRef sizes = t.sizes();
  return ValueOrThrow(TensorView::Create(t.data_ptr(), dtype,
                                         absl::Span<const int64_t>(sizes.data(), sizes.size())));
}

using OptTensor = c10::optional<at::Tensor>;

template <typename T>
absl::Span<const T> Span(const at::Tensor& t) {
  if (!t.defined()) return {};
  return absl::Span<const T>(t.data_ptr<T>(), static_cast<size_t>(t.numel()));
}

template <typename T>
absl::Span<const T> Span(const OptTensor& t) {
  return t.has_value() ? Span<T>(*t) : absl::Span<const T>();
}

absl::Span<const uint8_t> MaskSpan(const OptTensor& t) { return Span<uint8_t>(t); }

losses::CeWeightMode ParseMode(const std::string& mode, absl::string_view op) {
  if (mode == "token") return losses::CeWeightMode::kToken;
  if (mode == "sample") return losses::CeWeightMode::kSample;
  if (mode == "square") return losses::CeWeightMode::kSquare;
  Fail(op, absl::StrCat("unknown CE weight mode '", mode, "' (token, sample or square)"));
}

at::Tensor FromVector(const std::vector<float>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kFloat);
  std::copy(v.begin(), v.end(), t.data_ptr<float>());
  return t;
}

// losses::ComputeTokenWeights as a contiguous f32 [N] tensor. Without sample ids (sample or
// square mode) the library reports what the mode needs.
at::Tensor LibraryTokenWeights(const at::Tensor& labels_flat,
                               const c10::optional<at::Tensor>& sample_ids,
                               at::IntArrayRef label_shape, losses::CeWeightMode mode,
                               int64_t ignore_index, absl::string_view op) {
  at::Tensor ids;
  if (sample_ids.has_value() && mode != losses::CeWeightMode::kToken) {
    ids = IntegerInput(*sample_ids, label_shape, at::kLong, op, "sample_ids", "the labels' shape");
  }
  return FromVector(ValueOrThrow(losses::ComputeTokenWeights(
      Span<int64_t>(labels_flat), Span<int64_t>(ids), mode, ignore_index)));
}

// w_t of §3 as a contiguous f32 [N] tensor, or undefined for token mode (the kernels' w_t = 1).
OptTensor ResolveWeights(const CeWeights& w, const at::Tensor& labels_flat,
                         at::IntArrayRef label_shape, absl::string_view op) {
  const losses::CeWeightMode mode = ParseMode(w.mode, op);
  if (w.token_weights.has_value()) {
    if (mode != losses::CeWeightMode::kToken || w.sample_ids.has_value()) {
      Fail(op, "token_weights are explicit w_t: give them without a mode or sample_ids");
    }
    const at::Tensor& tw = *w.token_weights;
    CheckCpu(tw, op, "token_weights");
    if (!at::isFloatingType(tw.scalar_type())) {
      Fail(op, absl::StrCat("token_weights must be floating, got ", Describe(tw)));
    }
    if (tw.sizes() != label_shape) {
      Fail(op, absl::StrCat("token_weights has shape ", c10::str(tw.sizes()), ", expected ",
                            c10::str(label_shape), " (the labels' shape)"));
    }
    return tw.detach().to(at::kFloat).contiguous().view({-1});
  }
  if (mode == losses::CeWeightMode::kToken) return c10::nullopt;
  return LibraryTokenWeights(labels_flat, w.sample_ids, label_shape, mode, w.ignore_index, op);
}

// A router mask as uint8. The library takes 0 or 1 only and names any other value; checked
// here on the caller's integers, since a cast to uint8 first would wrap 256 to 0 and
// silently drop the row.
OptTensor OptionalMask(const OptTensor& mask, int64_t rows, absl::string_view op) {
  if (!mask.has_value()) return c10::nullopt;
  const at::Tensor m =
      IntegerInput(*mask, {rows}, at::kLong, op, "input_mask", "one entry per router row");
  const int64_t* v = m.data_ptr<int64_t>();
  for (int64_t t = 0; t < m.numel(); ++t) {
    if (v[t] != 0 && v[t] != 1) {
      Fail(op, absl::StrCat("input_mask[", t, "] = ", v[t], " must be 0 or 1"));
    }
  }
  return m.to(at::kByte);
}

// The gradient of a scalar loss times `grad_output`, the gradient flowing into that loss.
// Exactly 1 (loss.backward()) hands the saved gradient over unchanged; bf16 is scaled in
// fp32 and rounded once more.
at::Tensor Scale(const at::Tensor& saved, const at::Tensor& grad_output) {
  if (!saved.defined()) return at::Tensor();
  const double s = grad_output.item<double>();
  if (s == 1.0) return saved;
  if (saved.scalar_type() == at::kFloat) return saved * s;
  return (saved.to(at::kFloat) * s).to(saved.scalar_type());
}

// backward's result: `grads` for the first arguments of forward, then undefined gradients
// for the rest (labels, weights, numbers), `num_args` in all.
variable_list Grads(variable_list grads, size_t num_args) {
  grads.resize(num_args);
  return grads;
}

// An uninitialised contiguous tensor shaped like `like`, for a kernel's gradient output.
// 32 MiB and more come from large_buffers.h (huge pages, and the last buffer freed is
// reused: the first touch of a fresh 512 MiB costs more than the CE kernel), the rest from
// torch's allocator.
at::Tensor EmptyOutput(const at::Tensor& like) {
  const size_t bytes = static_cast<size_t>(like.numel()) * like.element_size();
  if (bytes < (size_t{32} << 20)) return at::empty(like.sizes(), like.options());
  const LargeBuffer b = TakeLargeBuffer(bytes);
  if (b.data == nullptr) return at::empty(like.sizes(), like.options());
  return at::from_blob(
      b.data, like.sizes(), [b](void*) { GiveBackLargeBuffer(b); }, like.options());
}

at::Tensor Scalar(double value) { return at::scalar_tensor(value, at::kFloat); }

bool NeedsGrad(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs) {
    if (t->requires_grad()) return true;
  }
  return false;
}

// ---- Cross-entropy (§3). ----

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  // logits: contiguous [N, V]; labels: int64 [N]; weights: f32 [N] or empty (token mode).
  // (Tensors that are never differentiated travel as optionals: autograd's input records
  // need a defined tensor for every tensor argument.)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const OptTensor& labels,
                            const OptTensor& weights, double d, int64_t ignore_index,
                            bool need_grad, double label_smoothing, double logit_softcap,
                            double alpha_lse) {
    losses::CrossEntropyOptions opt;
    opt.ignore_index = ignore_index;
    opt.num_threads = at::get_num_threads();
    opt.ce = {label_smoothing, logit_softcap, alpha_lse};
    if (!need_grad) {
      return Scalar(ValueOrThrow(losses::CrossEntropyForward(View(logits), Span<int64_t>(*labels),
                                                             Span<float>(weights), d, opt))
                        .local_loss);
    }
    at::Tensor grad = EmptyOutput(logits);
    const losses::CrossEntropyResult r = ValueOrThrow(losses::CrossEntropyForwardBackward(
        View(logits), Span<int64_t>(*labels), Span<float>(weights), d, View(grad), opt));
    ctx->save_for_backward({grad});
    return Scalar(r.local_loss);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_output) {
    return Grads({Scale(ctx->get_saved_variables()[0], grad_output[0])}, 9);
  }
};

// ---- Linear cross-entropy (§3 through the LM head). ----

// The library runs OpenBLAS single-threaded (core/gemm.h splits GEMMs over its own pool) and
// switches it to one thread process-wide on first use. Debian's torch calls the same
// libopenblas, so without this its own matmuls would stay single-threaded after the first
// call: the setting is restored when the kernel returns.
class ScopedSingleThreadedBlas {
 public:
  ScopedSingleThreadedBlas() : saved_(openblas_get_num_threads()) { openblas_set_num_threads(1); }
  ~ScopedSingleThreadedBlas() { openblas_set_num_threads(saved_); }
  ScopedSingleThreadedBlas(const ScopedSingleThreadedBlas&) = delete;
  ScopedSingleThreadedBlas& operator=(const ScopedSingleThreadedBlas&) = delete;

 private:
  int saved_;
};

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  // hidden: contiguous f32 [N, Dm]; weight: contiguous f32 [V, Dm]; labels, weights as CE.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const OptTensor& labels,
                            const OptTensor& weights, double d, int64_t ignore_index,
                            int64_t chunk_rows, double label_smoothing, double logit_softcap,
                            double alpha_lse) {
    losses::LinearCrossEntropyOptions opt;
    opt.ignore_index = ignore_index;
    opt.ce = {label_smoothing, logit_softcap, alpha_lse};
    opt.num_threads = at::get_num_threads();
    opt.chunk_rows = chunk_rows;
    opt.head_transposed = true;  // nn.Linear's [V, Dm]
    at::Tensor grad_hidden = EmptyOutput(hidden);
    at::Tensor grad_weight = EmptyOutput(weight).zero_();  // the kernel adds into it
    ScopedSingleThreadedBlas blas_threads;
    const losses::LinearCrossEntropyResult r =
        ValueOrThrow(losses::LinearCrossEntropyForwardBackward(
            View(hidden), View(weight), Span<int64_t>(*labels), Span<float>(weights), d,
            View(grad_hidden), View(grad_weight), opt));
    ctx->save_for_backward({hidden.requires_grad() ? grad_hidden : at::Tensor(),
                            weight.requires_grad() ? grad_weight : at::Tensor()});
    return Scalar(r.ce.local_loss);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_output) {
    const variable_list saved = ctx->get_saved_variables();
    return Grads({Scale(saved[0], grad_output[0]), Scale(saved[1], grad_output[0])}, 10);
  }
};

// ---- Router losses (§4, §5): the kernels ADD their gradient, so it starts at zero. ----

class RouterZLossFunction : public torch::autograd::Function<RouterZLossFunction> {
 public:
  // router_logits: contiguous f32 [T, E]; mask: uint8 [T] or undefined.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& router_logits,
                            const OptTensor& mask, int64_t n, double alpha) {
    at::Tensor grad = at::zeros_like(router_logits);
    const double loss = ValueOrThrow(losses::RouterZLossForwardBackward(
        View(router_logits), MaskSpan(mask), n, alpha, View(grad)));
    ctx->save_for_backward({grad});
    return Scalar(loss);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_output) {
    return Grads({Scale(ctx->get_saved_variables()[0], grad_output[0])}, 4);
  }
};

class LoadBalancingLossFunction : public torch::autograd::Function<LoadBalancingLossFunction> {
 public:
  // router: contiguous f32 [T, E] logits or probabilities; mask: uint8 [T] or undefined;
  // counts: contiguous int64 [E].
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& router, const OptTensor& mask,
                            const OptTensor& counts, int64_t top_k, int64_t g, double alpha,
                            bool inputs_are_probs) {
    at::Tensor grad = at::zeros_like(router);
    const auto kernel = inputs_are_probs ? &losses::LoadBalancingLossFromProbsForwardBackward
                                         : &losses::LoadBalancingLossForwardBackward;
    const double loss =
        ValueOrThrow(kernel(View(router), MaskSpan(mask), Span<int64_t>(*counts),
                            static_cast<int>(top_k), static_cast<int>(g), alpha, View(grad)));
    ctx->save_for_backward({grad});
    return Scalar(loss);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_output) {
    return Grads({Scale(ctx->get_saved_variables()[0], grad_output[0])}, 7);
  }
};

// ---- Token-level policy loss (§13). ----

class PolicyLossFunction : public torch::autograd::Function<PolicyLossFunction> {
 public:
  // logits: contiguous [N, V]; labels: int64 [N]; old_logprob, advantages: f32 [N];
  // mask (uint8), is_weights, ref_logprob (f32), seq_valid (int64 n_s): [N] or absent.
  // `metrics` receives the call's result besides the loss.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const OptTensor& labels,
                            const OptTensor& old_logprob, const OptTensor& advantages,
                            const OptTensor& mask, const OptTensor& is_weights,
                            const OptTensor& ref_logprob, const OptTensor& seq_valid,
                            const losses::PolicyLossOptions* opt, double n, double s,
                            losses::PolicyLossResult* metrics) {
    losses::PolicyLossInputs in;
    in.labels = Span<int64_t>(labels);
    in.old_logprob = Span<float>(old_logprob);
    in.advantages = Span<float>(advantages);
    in.mask = MaskSpan(mask);
    in.is_weights = Span<float>(is_weights);
    in.ref_logprob = Span<float>(ref_logprob);
    losses::PolicyLossNormalizer norm;
    norm.global_valid_tokens = n;
    norm.global_sequences = s;
    norm.sequence_valid_tokens = Span<int64_t>(seq_valid);
    at::Tensor grad = EmptyOutput(logits);  // fully overwritten: invalid rows get zeros
    *metrics =
        ValueOrThrow(losses::PolicyLossForwardBackward(View(logits), in, norm, View(grad), *opt));
    ctx->save_for_backward({grad});
    return Scalar(metrics->local_loss);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_output) {
    return Grads({Scale(ctx->get_saved_variables()[0], grad_output[0])}, 12);
  }
};

// A detached per-token float input shaped like the labels, as a contiguous f32 [N] tensor.
at::Tensor FloatInput(const at::Tensor& t, at::IntArrayRef shape, absl::string_view op,
                      absl::string_view what) {
  CheckCpu(t, op, what);
  if (!at::isFloatingType(t.scalar_type())) {
    Fail(op, absl::StrCat(what, " must be floating, got ", Describe(t)));
  }
  if (t.sizes() != shape) {
    Fail(op, absl::StrCat(what, " has shape ", c10::str(t.sizes()), ", expected ", c10::str(shape),
                          " (the labels' shape)"));
  }
  return t.detach().to(at::kFloat).contiguous().view({-1});
}

OptTensor OptionalFloatInput(const OptTensor& t, at::IntArrayRef shape, absl::string_view op,
                             absl::string_view what) {
  if (!t.has_value()) return c10::nullopt;
  return FloatInput(*t, shape, op, what);
}

losses::KlEstimator ParseKlEstimator(const std::string& name, absl::string_view op) {
  if (name == "k1") return losses::KlEstimator::kK1;
  if (name == "k2") return losses::KlEstimator::kK2;
  if (name == "k3") return losses::KlEstimator::kK3;
  Fail(op, absl::StrCat("unknown kl_estimator '", name, "' (k1, k2 or k3)"));
}

losses::PolicyLossAggregation ParseAggregation(const std::string& name, absl::string_view op) {
  if (name == "token_mean") return losses::PolicyLossAggregation::kTokenMean;
  if (name == "seq_mean_token_mean") return losses::PolicyLossAggregation::kSeqMeanTokenMean;
  Fail(op, absl::StrCat("unknown aggregation '", name, "' (token_mean or seq_mean_token_mean)"));
}

// [T, E] router input as a contiguous f32 tensor (differentiable conversion).
at::Tensor RouterInput(const at::Tensor& t, absl::string_view op, absl::string_view what) {
  CheckFloat(t, op, what);
  if (t.dim() != 2 || t.size(1) < 1) {
    Fail(op, absl::StrCat(what, " must be 2-D [T, E] with E >= 1, got ", Describe(t)));
  }
  return t.to(at::kFloat).contiguous();
}

int32_t NarrowInt(int64_t v, absl::string_view op, absl::string_view what) {
  if (v < INT32_MIN || v > INT32_MAX) {
    Fail(op, absl::StrCat(what, " ", v, " is outside the 32-bit range"));
  }
  return static_cast<int32_t>(v);
}

}  // namespace

namespace {

// Float logits [..., V] with V >= 1 (else the op's error naming them); the shape of their rows
// (without the last dimension), which every per-row input has.
at::IntArrayRef LogitsRowShape(const at::Tensor& logits, absl::string_view op) {
  CheckFloat(logits, op, "logits");
  if (logits.dim() < 1 || logits.size(-1) < 1) {
    Fail(op, absl::StrCat("logits must be [..., V] with V >= 1, got ", Describe(logits)));
  }
  return logits.sizes().slice(0, logits.dim() - 1);
}

// One int64 label per logits row.
at::Tensor RowLabels(const at::Tensor& labels, at::IntArrayRef row_shape, absl::string_view op) {
  return IntegerInput(labels, row_shape, at::kLong, op, "labels",
                      "the logits' shape without its last dimension");
}

}  // namespace

StatusError::StatusError(absl::Status status)
    : std::runtime_error(status.ToString()), status_(std::move(status)) {}

at::Tensor CrossEntropy(const at::Tensor& logits, const at::Tensor& labels,
                        double global_weight_sum, const CeWeights& weights,
                        const CeOptions& options) {
  constexpr absl::string_view kOp = "cross_entropy";
  const at::IntArrayRef label_shape = LogitsRowShape(logits, kOp);
  const at::Tensor y = RowLabels(labels, label_shape, kOp);
  const OptTensor w = ResolveWeights(weights, y, label_shape, kOp);
  const at::Tensor z = logits.reshape({-1, logits.size(-1)}).contiguous();
  return CrossEntropyFunction::apply(z, OptTensor(y), w, global_weight_sum, weights.ignore_index,
                                     NeedsGrad({&logits}), options.label_smoothing,
                                     options.logit_softcap, options.alpha_lse);
}

at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& labels, double global_weight_sum,
                              const CeWeights& weights, int64_t chunk_rows,
                              const CeOptions& options) {
  constexpr absl::string_view kOp = "linear_cross_entropy";
  CheckFloat(hidden, kOp, "hidden");
  CheckFloat(weight, kOp, "weight");
  if (hidden.dim() < 1 || weight.dim() != 2 || weight.size(1) != hidden.size(-1) ||
      weight.size(0) < 1 || hidden.size(-1) < 1) {
    Fail(kOp, absl::StrCat("hidden must be [..., Dm] and weight [V, Dm] (nn.Linear(Dm, V)'s "
                           "layout) with V >= 1 and Dm >= 1, got hidden ",
                           Describe(hidden), " and weight ", Describe(weight)));
  }
  const at::IntArrayRef label_shape = hidden.sizes().slice(0, hidden.dim() - 1);
  const at::Tensor y = IntegerInput(labels, label_shape, at::kLong, kOp, "labels",
                                    "the hidden states' shape without its last dimension");
  const OptTensor w = ResolveWeights(weights, y, label_shape, kOp);
  const at::Tensor h = hidden.reshape({-1, hidden.size(-1)}).to(at::kFloat).contiguous();
  const at::Tensor head = weight.to(at::kFloat).contiguous();
  return LinearCrossEntropyFunction::apply(
      h, head, OptTensor(y), w, global_weight_sum, weights.ignore_index, chunk_rows,
      options.label_smoothing, options.logit_softcap, options.alpha_lse);
}

at::Tensor RouterZLoss(const at::Tensor& router_logits, int64_t global_routed_tokens, double alpha,
                       const c10::optional<at::Tensor>& input_mask) {
  constexpr absl::string_view kOp = "z_loss";
  const at::Tensor u = RouterInput(router_logits, kOp, "router_logits");
  const OptTensor mask = OptionalMask(input_mask, u.size(0), kOp);
  return RouterZLossFunction::apply(u, mask, global_routed_tokens, alpha);
}

at::Tensor LoadBalancingLoss(const at::Tensor& router_logits,
                             const at::Tensor& global_expert_counts, int64_t top_k,
                             int64_t num_micro_batches, double alpha,
                             const c10::optional<at::Tensor>& input_mask, bool inputs_are_probs) {
  constexpr absl::string_view kOp = "balancing_loss";
  const at::Tensor u =
      RouterInput(router_logits, kOp, inputs_are_probs ? "router probabilities" : "router_logits");
  if (inputs_are_probs && u.numel() > 0 && !u.ge(0).logical_and(u.le(1)).all().item<bool>()) {
    // §5's p_t is a probability: a value outside [0, 1] (or NaN) is no softmax's output, and
    // the loss of such values means nothing.
    Fail(kOp, absl::StrCat("router probabilities (probs=True) must lie in [0, 1], got values in [",
                           u.min().item<double>(), ", ", u.max().item<double>(), "] in ",
                           Describe(router_logits)));
  }
  const OptTensor mask = OptionalMask(input_mask, u.size(0), kOp);
  const at::Tensor counts = IntegerInput(global_expert_counts, {u.size(1)}, at::kLong, kOp,
                                         "global_expert_counts", "one count per expert");
  return LoadBalancingLossFunction::apply(
      u, mask, OptTensor(counts), NarrowInt(top_k, kOp, "top_k"),
      NarrowInt(num_micro_batches, kOp, "num_micro_batches"), alpha, inputs_are_probs);
}

PolicyLossOutput PolicyLoss(const at::Tensor& logits, const at::Tensor& labels,
                            const at::Tensor& old_logprob, const at::Tensor& advantages,
                            const PolicyLossArgs& args) {
  constexpr absl::string_view kOp = "policy_loss";
  const at::IntArrayRef shape = LogitsRowShape(logits, kOp);
  const at::Tensor y = RowLabels(labels, shape, kOp);
  const at::Tensor old = FloatInput(old_logprob, shape, kOp, "old_logprob");
  const at::Tensor adv = FloatInput(advantages, shape, kOp, "advantages");
  const OptTensor iw = OptionalFloatInput(args.is_weights, shape, kOp, "is_weights");
  const OptTensor ref = OptionalFloatInput(args.ref_logprob, shape, kOp, "ref_logprob");
  OptTensor mask;
  if (args.mask.has_value()) {
    // Any non-zero value is valid, as in the library (a cast to uint8 could wrap 256 to 0).
    mask = IntegerInput(*args.mask, shape, at::kLong, kOp, "mask", "the labels' shape")
               .ne(0)
               .to(at::kByte);
  }

  losses::PolicyLossOptions opt;
  opt.eps_low = args.eps_low;
  opt.eps_high = args.eps_high;
  opt.dual_clip_c = args.dual_clip_c;
  opt.kl_coef = args.kl_coef;
  opt.kl_estimator = ParseKlEstimator(args.kl_estimator, kOp);
  opt.is_cap = args.is_cap;
  opt.aggregation = ParseAggregation(args.aggregation, kOp);
  opt.ignore_index = args.ignore_index;
  opt.num_threads = at::get_num_threads();

  // The normalisers of the chosen aggregation, and only those: a value given for the other
  // mode would be silently unused.
  double n = 0.0;
  double s = 0.0;
  OptTensor seq_valid;
  if (opt.aggregation == losses::PolicyLossAggregation::kTokenMean) {
    if (!args.global_valid_tokens.has_value()) {
      Fail(kOp,
           "aggregation token_mean needs global_valid_tokens (N, summed over all ranks and "
           "micro-batches of the step)");
    }
    if (args.global_sequences.has_value() || args.sequence_valid_tokens.has_value()) {
      Fail(kOp,
           "aggregation token_mean takes global_valid_tokens only, not global_sequences or "
           "sequence_valid_tokens (those are for seq_mean_token_mean)");
    }
    n = *args.global_valid_tokens;
  } else {
    if (!args.global_sequences.has_value() || !args.sequence_valid_tokens.has_value()) {
      Fail(kOp,
           "aggregation seq_mean_token_mean needs global_sequences (S) and "
           "sequence_valid_tokens (n_s per token)");
    }
    if (args.global_valid_tokens.has_value()) {
      Fail(kOp,
           "aggregation seq_mean_token_mean takes global_sequences and "
           "sequence_valid_tokens, not global_valid_tokens (that is for token_mean)");
    }
    s = *args.global_sequences;
    seq_valid = IntegerInput(*args.sequence_valid_tokens, shape, at::kLong, kOp,
                             "sequence_valid_tokens", "the labels' shape");
    // This call's share of S: its whole sequences count 1 each, a part of one less. An S
    // below it is a local count where the global one belongs (the library checks S >= 1).
    const int64_t* ns = seq_valid->data_ptr<int64_t>();
    const int64_t* lab = y.data_ptr<int64_t>();
    const uint8_t* m = mask.has_value() ? mask->data_ptr<uint8_t>() : nullptr;
    double share = 0.0;
    for (int64_t t = 0; t < y.numel(); ++t) {
      if (lab[t] == opt.ignore_index || (m != nullptr && m[t] == 0) || ns[t] < 1) continue;
      share += 1.0 / static_cast<double>(ns[t]);
    }
    // (A negative or non-finite S is left to the library, which names it as such.)
    if (std::isfinite(s) && s >= 0.0 && s < share * (1.0 - 1e-9)) {
      throw StatusError(absl::FailedPreconditionError(
          absl::StrCat("policy loss: global sequence count S = ", s,
                       " is smaller than this call's share of "
                       "sequences ",
                       share,
                       " (the sum of 1 / n_s over its valid tokens); S must count the "
                       "sequences of all ranks and micro-batches of the step (SEMANTICS.md §13)")));
    }
  }

  const at::Tensor z = logits.reshape({-1, logits.size(-1)}).contiguous();
  PolicyLossOutput out;
  out.loss = PolicyLossFunction::apply(z, OptTensor(y), OptTensor(old), OptTensor(adv), mask, iw,
                                       ref, seq_valid, &opt, n, s, &out.metrics);
  return out;
}

at::Tensor TokenWeights(const at::Tensor& labels, const c10::optional<at::Tensor>& sample_ids,
                        const std::string& mode, int64_t ignore_index) {
  constexpr absl::string_view kOp = "token_weights";
  CheckCpu(labels, kOp, "labels");
  const at::Tensor y = IntegerInput(labels, labels.sizes(), at::kLong, kOp, "labels", "");
  return LibraryTokenWeights(y, sample_ids, labels.sizes(), ParseMode(mode, kOp), ignore_index, kOp)
      .view(labels.sizes());
}

at::Tensor CountExpertAssignments(const at::Tensor& topk_indices, int64_t num_experts,
                                  const c10::optional<at::Tensor>& input_mask) {
  constexpr absl::string_view kOp = "count_expert_assignments";
  CheckCpu(topk_indices, kOp, "topk_indices");
  if (topk_indices.dim() != 2 || topk_indices.size(1) < 1) {
    Fail(kOp,
         absl::StrCat("topk_indices must be 2-D [T, K] with K >= 1, got ", Describe(topk_indices)));
  }
  const at::Tensor idx64 =
      IntegerInput(topk_indices, topk_indices.sizes(), at::kLong, kOp, "topk_indices", "");
  std::vector<int32_t> idx(static_cast<size_t>(idx64.numel()));
  const int64_t* src = idx64.data_ptr<int64_t>();
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = NarrowInt(src[i], kOp, "expert id");
  const OptTensor mask = OptionalMask(input_mask, topk_indices.size(0), kOp);
  const std::vector<int64_t> counts = ValueOrThrow(losses::CountLocalExpertAssignments(
      idx, static_cast<int>(topk_indices.size(1)), MaskSpan(mask),
      NarrowInt(num_experts, kOp, "num_experts")));
  at::Tensor out = at::empty({static_cast<int64_t>(counts.size())}, at::kLong);
  std::copy(counts.begin(), counts.end(), out.data_ptr<int64_t>());
  return out;
}

size_t EmptyCache() { return ReleaseCachedLargeBuffer(); }

double CrossEntropyKernelSecondsPerCall(const at::Tensor& logits, const at::Tensor& labels,
                                        double global_weight_sum, int64_t iters) {
  constexpr absl::string_view kOp = "cross_entropy_kernel_seconds_per_call";
  CheckFloat(logits, kOp, "logits");
  if (logits.dim() != 2 || !logits.is_contiguous() || labels.scalar_type() != at::kLong ||
      labels.dim() != 1 || !labels.is_contiguous() || iters < 1) {
    Fail(kOp, "needs contiguous [N, V] logits, contiguous int64 [N] labels and iters >= 1");
  }
  at::Tensor grad = EmptyOutput(logits);  // the op's kind of buffer (huge pages from 32 MiB)
  losses::CrossEntropyOptions opt;
  opt.num_threads = at::get_num_threads();
  const TensorView z = View(logits);
  const TensorView dz = View(grad);
  const absl::Span<const int64_t> y = Span<int64_t>(labels);
  // One untimed call: the gradient buffer's first-touch page faults are not the kernel's.
  ThrowIfError(losses::CrossEntropyForwardBackward(z, y, {}, global_weight_sum, dz, opt).status());
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    ThrowIfError(
        losses::CrossEntropyForwardBackward(z, y, {}, global_weight_sum, dz, opt).status());
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / static_cast<double>(iters);
}

}  // namespace gradsum::torch_ops
