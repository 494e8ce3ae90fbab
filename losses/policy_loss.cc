#include "losses/policy_loss.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "losses/cross_entropy_kernel.h"

namespace gradsum::losses {
namespace {

constexpr char kWhat[] = "policy loss";

// Row flags recorded by the hook.
enum RowFlag : uint8_t { kClipped = 1, kDualClipped = 2 };

// What the row hook reads (the detached per-token inputs) and writes (per-row values, one
// slot per row, so the kernel's threads never share a slot).
struct PolicyRowCtx {
  const PolicyLossInputs* in = nullptr;
  const PolicyLossOptions* opt = nullptr;
  const double* coef = nullptr;  // c_t per row
  double* term = nullptr;        // term_t (undivided, KL included)
  double* kl = nullptr;          // kl_t
  double* ratio = nullptr;       // r_t
  uint8_t* flags = nullptr;
};

// The per-token math of SEMANTICS.md §13, fp64. Returns the row's gradient scale for the
// CE kernel's (softmax - onehot): dL/dz = c g (onehot - softmax) = -(c g) (softmax - onehot).
float PolicyRowHook(void* ctx_ptr, int64_t row, double ce) {
  const PolicyRowCtx& ctx = *static_cast<const PolicyRowCtx*>(ctx_ptr);
  const PolicyLossInputs& in = *ctx.in;
  const PolicyLossOptions& opt = *ctx.opt;
  const double logp = -ce;
  const double a = in.advantages[row];
  const double delta = logp - static_cast<double>(in.old_logprob[row]);
  // The clamp only guards exp; outside it the ratio is a constant (no gradient).
  const bool in_clamp = delta >= -20.0 && delta <= 20.0;
  const double r = std::exp(std::clamp(delta, -20.0, 20.0));
  const double pg1 = -r * a;
  const double pg2 = -std::clamp(r, 1.0 - opt.eps_low, 1.0 + opt.eps_high) * a;
  uint8_t flags = 0;
  double pg, g_pg;
  if (pg2 > pg1) {
    // The clipped branch wins only with r outside the clip range, where clip() is flat.
    pg = pg2;
    g_pg = 0.0;
    flags |= kClipped;
  } else {
    pg = pg1;
    g_pg = in_clamp ? -a * r : 0.0;
  }
  if (a < 0.0 && opt.dual_clip_c > 0.0 && pg > -opt.dual_clip_c * a) {
    pg = -opt.dual_clip_c * a;  // a constant: no gradient
    g_pg = 0.0;
    flags |= kDualClipped;
  }
  if (!in.is_weights.empty()) {
    const double iw = std::min(static_cast<double>(in.is_weights[row]), opt.is_cap);
    pg *= iw;
    g_pg *= iw;
  }
  double kl = 0.0, g_kl = 0.0;
  if (!in.ref_logprob.empty()) {
    const double d = logp - static_cast<double>(in.ref_logprob[row]);
    switch (opt.kl_estimator) {
      case KlEstimator::kK1:
        kl = d;
        g_kl = 1.0;
        break;
      case KlEstimator::kK2:
        kl = 0.5 * d * d;
        g_kl = d;
        break;
      case KlEstimator::kK3: {
        // x = ref - logp; k3 = e^x - x - 1 >= 0. A huge x overflows e^x to +inf, which the
        // clamp turns into 10 with no gradient, as it would any value above 10.
        const double x = -d;
        const double e = std::exp(x);
        const double k3 = e - x - 1.0;
        if (k3 > 10.0) {
          kl = 10.0;
        } else if (k3 < -10.0) {
          kl = -10.0;
        } else {
          kl = k3;
          g_kl = 1.0 - e;
        }
        break;
      }
    }
  }
  const double coef = ctx.coef[row];
  ctx.term[row] = pg + opt.kl_coef * kl;
  ctx.kl[row] = kl;
  ctx.ratio[row] = r;
  ctx.flags[row] = flags;
  const double g = g_pg + opt.kl_coef * g_kl;
  return static_cast<float>(-(coef * g));
}

absl::Status CheckOptions(const PolicyLossOptions& o, bool has_ref) {
  auto bad = [](absl::string_view name, double v, absl::string_view want) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": option ", name, " = ", v, " must be ", want));
  };
  if (!std::isfinite(o.eps_low) || o.eps_low < 0.0)
    return bad("eps_low", o.eps_low, "finite, >= 0");
  if (!std::isfinite(o.eps_high) || o.eps_high < 0.0) {
    return bad("eps_high", o.eps_high, "finite, >= 0");
  }
  if (!std::isfinite(o.dual_clip_c) || !(o.dual_clip_c == 0.0 || o.dual_clip_c > 1.0)) {
    return bad("dual_clip_c", o.dual_clip_c, "0 (off) or finite and > 1");
  }
  if (!std::isfinite(o.kl_coef) || o.kl_coef < 0.0)
    return bad("kl_coef", o.kl_coef, "finite, >= 0");
  if (std::isnan(o.is_cap) || !(o.is_cap > 0.0))
    return bad("is_cap", o.is_cap, "> 0 (+inf: no cap)");
  if (o.kl_coef > 0.0 && !has_ref) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": kl_coef = ", o.kl_coef, " > 0 needs ref_logprob (none was given)"));
  }
  switch (o.kl_estimator) {
    case KlEstimator::kK1:
    case KlEstimator::kK2:
    case KlEstimator::kK3:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          kWhat, ": kl_estimator ", static_cast<int>(o.kl_estimator), " is not k1, k2 or k3"));
  }
  if (o.aggregation != PolicyLossAggregation::kTokenMean &&
      o.aggregation != PolicyLossAggregation::kSeqMeanTokenMean) {
    return absl::InvalidArgumentError(absl::StrCat(
        kWhat, ": aggregation ", static_cast<int>(o.aggregation), " is not a known mode"));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status CheckLength(absl::string_view name, absl::Span<const T> s, int64_t rows,
                         bool optional) {
  if (optional && s.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(s.size()) != rows) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": ", s.size(), " ", name, " for ", rows,
                                                   " rows of logits",
                                                   optional ? " (give N, or none)" : ""));
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(absl::string_view name, absl::Span<const float> s, int64_t row) {
  if (s.empty() || std::isfinite(s[row])) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(kWhat, ": ", name, " ", s[row], " at row ", row, " must be finite"));
}

absl::Status CheckNormalizer(absl::string_view name, double v) {
  if (std::isfinite(v) && v >= 0.0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(kWhat, ": ", name, " = ", v, " must be finite and >= 0"));
}

// Every check of the arguments that needs no row's values: the views, the options, the
// spans' lengths and the normalizers.
absl::Status CheckArguments(const TensorView& logits, const PolicyLossInputs& in,
                            const PolicyLossNormalizer& norm, const TensorView& grad_logits,
                            const PolicyLossOptions& options) {
  absl::Status s = internal::CheckLogitsView(logits, "policy loss: logits");
  if (!s.ok()) return s;
  s = internal::CheckLogitsView(grad_logits, "policy loss: grad_logits");
  if (!s.ok()) return s;
  if (grad_logits.dtype() != logits.dtype() || grad_logits.shape() != logits.shape()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": grad_logits ", grad_logits.DebugString(),
                     " must have the dtype and shape of logits ", logits.DebugString()));
  }
  const int64_t rows = logits.dim(0);
  const int64_t vocab = logits.dim(1);
  if (vocab < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": vocabulary size ", vocab, " must be >= 1"));
  }
  const bool seq_mean = options.aggregation == PolicyLossAggregation::kSeqMeanTokenMean;
  if (!(s = CheckOptions(options, !in.ref_logprob.empty())).ok()) return s;
  if (!(s = CheckLength("labels", in.labels, rows, false)).ok()) return s;
  if (!(s = CheckLength("old_logprob values", in.old_logprob, rows, false)).ok()) return s;
  if (!(s = CheckLength("advantages", in.advantages, rows, false)).ok()) return s;
  if (!(s = CheckLength("mask values", in.mask, rows, true)).ok()) return s;
  if (!(s = CheckLength("importance weights", in.is_weights, rows, true)).ok()) return s;
  if (!(s = CheckLength("ref_logprob values", in.ref_logprob, rows, true)).ok()) return s;
  if (seq_mean) {
    if (!(s = CheckLength("sequence valid-token counts", norm.sequence_valid_tokens, rows, false))
             .ok()) {
      return s;
    }
    if (!(s = CheckNormalizer("global sequence count S", norm.global_sequences)).ok()) return s;
  } else {
    if (!(s = CheckNormalizer("global valid-token count N", norm.global_valid_tokens)).ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// Per-row validity: row_weight[r] = 1 for a valid token (0 otherwise), whose values are
// checked; returns the valid tokens. Values of invalid tokens are never read (they may hold
// anything, as padding often does).
absl::StatusOr<int64_t> MarkValidRows(const PolicyLossInputs& in, const PolicyLossNormalizer& norm,
                                      const PolicyLossOptions& options, int64_t vocab,
                                      bool seq_mean, std::vector<float>& row_weight) {
  absl::Status s;
  int64_t valid = 0;
  for (int64_t r = 0; r < static_cast<int64_t>(row_weight.size()); ++r) {
    const int64_t y = in.labels[r];
    if (y == options.ignore_index || (!in.mask.empty() && in.mask[r] == 0)) continue;
    if (y < 0 || y >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat(kWhat, ": label ", y, " at row ", r, " is outside [0, ", vocab,
                       ") and is not ignore_index (", options.ignore_index, ")"));
    }
    if (!(s = CheckFinite("advantage", in.advantages, r)).ok()) return s;
    if (!(s = CheckFinite("old_logprob", in.old_logprob, r)).ok()) return s;
    if (!(s = CheckFinite("ref_logprob", in.ref_logprob, r)).ok()) return s;
    if (!in.is_weights.empty() && !(std::isfinite(in.is_weights[r]) && in.is_weights[r] >= 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(kWhat, ": importance weight ",
                                                     in.is_weights[r], " at row ", r,
                                                     " must be finite and >= 0"));
    }
    if (seq_mean && norm.sequence_valid_tokens[r] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(kWhat, ": sequence valid-token count n_s = ", norm.sequence_valid_tokens[r],
                       " at row ", r, " must be >= 1 for a valid token"));
    }
    row_weight[r] = 1.0f;
    ++valid;
  }
  // A global count cannot be below this call's share; if it is, a local one was passed.
  if (!seq_mean && static_cast<double>(valid) > norm.global_valid_tokens) {
    return absl::FailedPreconditionError(
        absl::StrCat(kWhat, ": global valid-token count N = ", norm.global_valid_tokens,
                     " is smaller than this call's ", valid,
                     " valid tokens; N must be summed over all ranks and micro-batches of the step "
                     "(SEMANTICS.md §13)"));
  }
  if (seq_mean && valid > 0 && !(norm.global_sequences >= 1.0)) {
    return absl::FailedPreconditionError(absl::StrCat(
        kWhat, ": global sequence count S = ", norm.global_sequences, " but this call has ", valid,
        " valid tokens; S must count the sequences of all ranks and micro-batches"));
  }
  return valid;
}

// The per-row outputs of the fused rows (PolicyRowCtx's arrays), as vectors.
struct PolicyRows {
  explicit PolicyRows(int64_t rows)
      : row_ce(static_cast<size_t>(rows), 0.0),
        term(static_cast<size_t>(rows), 0.0),
        kl(static_cast<size_t>(rows), 0.0),
        ratio(static_cast<size_t>(rows), 0.0),
        flags(static_cast<size_t>(rows), 0) {}
  std::vector<double> row_ce, term, kl, ratio;
  std::vector<uint8_t> flags;
};

// The result's sums over the valid rows, in row order, so the result does not depend on
// the threads.
PolicyLossResult SumRows(const std::vector<float>& row_weight, const std::vector<double>& coef,
                         const PolicyRows& p, double kl_coef, int64_t valid) {
  PolicyLossResult out;
  out.ratio_max = -std::numeric_limits<double>::infinity();
  out.ratio_min = std::numeric_limits<double>::infinity();
  for (size_t r = 0; r < row_weight.size(); ++r) {
    if (row_weight[r] == 0.0f) continue;
    out.local_loss += coef[r] * p.term[r];
    out.local_kl_loss += coef[r] * kl_coef * p.kl[r];
    out.local_kl_sum += p.kl[r];
    out.clip_count += (p.flags[r] & kClipped) != 0 ? 1 : 0;
    out.dual_clip_count += (p.flags[r] & kDualClipped) != 0 ? 1 : 0;
    out.ratio_sum += p.ratio[r];
    out.ratio_max = std::max(out.ratio_max, p.ratio[r]);
    out.ratio_min = std::min(out.ratio_min, p.ratio[r]);
  }
  out.local_valid_tokens = valid;
  if (valid == 0) out.ratio_max = out.ratio_min = 0.0;
  return out;
}

}  // namespace

absl::StatusOr<PolicyLossResult> PolicyLossForwardBackward(const TensorView& logits,
                                                           const PolicyLossInputs& in,
                                                           const PolicyLossNormalizer& norm,
                                                           const TensorView& grad_logits,
                                                           const PolicyLossOptions& options) {
  // ---- Every check first: nothing is written on a bad argument. ----
  absl::Status s = CheckArguments(logits, in, norm, grad_logits, options);
  if (!s.ok()) return s;
  const int64_t rows = logits.dim(0);
  const int64_t vocab = logits.dim(1);
  const bool seq_mean = options.aggregation == PolicyLossAggregation::kSeqMeanTokenMean;
  std::vector<float> row_weight(static_cast<size_t>(rows), 0.0f);
  absl::StatusOr<int64_t> valid_or = MarkValidRows(in, norm, options, vocab, seq_mean, row_weight);
  if (!valid_or.ok()) return valid_or.status();
  const int64_t valid = *valid_or;
  // c_t per valid row.
  std::vector<double> coef(static_cast<size_t>(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    if (row_weight[r] == 0.0f) continue;
    coef[r] =
        seq_mean
            ? 1.0 / (static_cast<double>(norm.sequence_valid_tokens[r]) * norm.global_sequences)
            : 1.0 / norm.global_valid_tokens;
  }

  // ---- The fused rows: logp from the CE kernel, the gradient scaled by the hook. ----
  PolicyRows p(rows);
  PolicyRowCtx ctx{.in = &in,
                   .opt = &options,
                   .coef = coef.data(),
                   .term = p.term.data(),
                   .kl = p.kl.data(),
                   .ratio = p.ratio.data(),
                   .flags = p.flags.data()};
  const internal::GlobalRowScaleHook hook{&PolicyRowHook, &ctx};
  s = internal::ScaledRowsKernel(logits.raw(), grad_logits.raw(), logits.dtype(), rows, vocab,
                                 in.labels, row_weight, hook, options.num_threads, kWhat,
                                 absl::MakeSpan(p.row_ce));
  if (!s.ok()) return s;
  return SumRows(row_weight, coef, p, options.kl_coef, valid);
}

// ---- Display (SEMANTICS.md §8, §13). ----

namespace {

std::string Name(absl::string_view prefix, absl::string_view metric) {
  return absl::StrCat(prefix, "/", metric);
}

}  // namespace

absl::Status RegisterPolicyLossDisplay(StepDisplay& display, absl::string_view prefix) {
  absl::Status s = display.RegisterTerm(prefix, DisplayTermKind::kLoss);
  for (const char* m :
       {"kl", "kl_sum", "valid_tokens", "clip_count", "dual_clip_count", "ratio_sum"}) {
    if (s.ok()) s = display.RegisterTerm(Name(prefix, m), DisplayTermKind::kMetric);
  }
  if (s.ok()) s = display.RegisterTerm(Name(prefix, "ratio_max"), DisplayTermKind::kMetricMax);
  if (s.ok()) s = display.RegisterTerm(Name(prefix, "ratio_min"), DisplayTermKind::kMetricMin);
  return s;
}

absl::Status AddPolicyLossToDisplay(StepDisplay& display, const PolicyLossResult& r,
                                    absl::string_view prefix) {
  absl::Status s = display.AddBackwardTerm(prefix, r.local_loss);
  if (s.ok()) s = display.AddMetric(Name(prefix, "kl"), r.local_kl_loss);
  if (s.ok()) s = display.AddMetric(Name(prefix, "kl_sum"), r.local_kl_sum);
  if (s.ok()) {
    s = display.AddMetric(Name(prefix, "valid_tokens"), static_cast<double>(r.local_valid_tokens));
  }
  if (s.ok()) s = display.AddMetric(Name(prefix, "clip_count"), static_cast<double>(r.clip_count));
  if (s.ok()) {
    s = display.AddMetric(Name(prefix, "dual_clip_count"), static_cast<double>(r.dual_clip_count));
  }
  if (s.ok()) s = display.AddMetric(Name(prefix, "ratio_sum"), r.ratio_sum);
  // A call without valid tokens has no ratio: it must not pull the max down or the min up.
  if (s.ok() && r.local_valid_tokens > 0) {
    s = display.AddMetric(Name(prefix, "ratio_max"), r.ratio_max);
    if (s.ok()) s = display.AddMetric(Name(prefix, "ratio_min"), r.ratio_min);
  }
  return s;
}

namespace {

absl::StatusOr<double> PerValidToken(const StepDisplayValues& v, absl::string_view prefix,
                                     absl::string_view metric) {
  absl::StatusOr<double> num = v.Value(Name(prefix, metric));
  if (!num.ok()) return num.status();
  absl::StatusOr<double> den = v.Value(Name(prefix, "valid_tokens"));
  if (!den.ok()) return den.status();
  return *den > 0.0 ? *num / *den : 0.0;
}

}  // namespace

absl::StatusOr<double> PolicyLossClipFraction(const StepDisplayValues& values,
                                              absl::string_view prefix) {
  return PerValidToken(values, prefix, "clip_count");
}

absl::StatusOr<double> PolicyLossMeanRatio(const StepDisplayValues& values,
                                           absl::string_view prefix) {
  return PerValidToken(values, prefix, "ratio_sum");
}

}  // namespace gradsum::losses
