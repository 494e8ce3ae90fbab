#include "optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum {
namespace {

absl::Status ValidateOptions(const AdamWOptions& o) {
  if (!(o.lr >= 0.0) || !std::isfinite(o.lr)) {
    return absl::InvalidArgumentError(absl::StrCat("AdamW lr must be >= 0, got ", o.lr));
  }
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("AdamW beta1 must be in [0, 1), got ", o.beta1));
  }
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("AdamW beta2 must be in [0, 1), got ", o.beta2));
  }
  if (!(o.eps > 0.0) || !std::isfinite(o.eps)) {
    return absl::InvalidArgumentError(absl::StrCat("AdamW eps must be > 0, got ", o.eps));
  }
  if (!(o.weight_decay >= 0.0) || !std::isfinite(o.weight_decay)) {
    return absl::InvalidArgumentError(
        absl::StrCat("AdamW weight_decay must be >= 0, got ", o.weight_decay));
  }
  return absl::OkStatus();
}

struct AdamWScalars {
  float decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_sqrt_bc2, eps;
};

// The elementwise update. Distinct arrays (__restrict) let the compiler vectorize it; each
// lane does the same IEEE operations in the same order, so results do not depend on it.
void AdamWKernel(float* __restrict p, const float* __restrict g, float* __restrict m,
                 float* __restrict v, size_t n, const AdamWScalars& c) {
  for (size_t i = 0; i < n; ++i) {
    const float gr = g[i];
    const float mi = c.beta1 * m[i] + c.one_minus_beta1 * gr;
    const float vi = c.beta2 * v[i] + c.one_minus_beta2 * gr * gr;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * c.decay - c.step_size * mi / (std::sqrt(vi) * c.inv_sqrt_bc2 + c.eps);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardedAdamW>> ShardedAdamW::Create(std::vector<FlatParam*> groups,
                                                                   AdamWOptions options) {
  GRADSUM_RETURN_IF_ERROR(ValidateOptions(options));
  std::unique_ptr<ShardedAdamW> opt(new ShardedAdamW());
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("ShardedAdamW: group ", i, " is null"));
    }
    opt->exp_avg_.emplace_back(groups[i]->master().size(), 0.0f);
    opt->exp_avg_sq_.emplace_back(groups[i]->master().size(), 0.0f);
  }
  opt->groups_ = std::move(groups);
  opt->options_ = options;
  return opt;
}

absl::Status ShardedAdamW::set_lr(double lr) {
  AdamWOptions o = options_;
  o.lr = lr;
  GRADSUM_RETURN_IF_ERROR(ValidateOptions(o));
  options_ = o;
  return absl::OkStatus();
}

absl::Status ShardedAdamW::set_step(int64_t step) {
  if (step < 0)
    return absl::InvalidArgumentError(absl::StrCat("AdamW step must be >= 0, got ", step));
  step_ = step;
  return absl::OkStatus();
}

absl::Status ShardedAdamW::Step() {
  for (const FlatParam* g : groups_) {
    if (g->grad_reduce_in_flight()) {
      return absl::FailedPreconditionError(
          absl::StrCat("AdamW step: gradient reduction of group \"", g->name(), "\" in flight"));
    }
    if (g->unshard_in_flight()) {
      return absl::FailedPreconditionError(
          absl::StrCat("AdamW step: all-gather of group \"", g->name(), "\" in flight"));
    }
  }
  const int64_t t = step_ + 1;
  const AdamWOptions& o = options_;
  // Scalars in fp64, rounded once to fp32 for the elementwise loop.
  const float decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  const float beta1 = static_cast<float>(o.beta1);
  const float beta2 = static_cast<float>(o.beta2);
  const float one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
  const float one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  const float step_size =
      static_cast<float>(o.lr / (1.0 - std::pow(o.beta1, static_cast<double>(t))));
  const float inv_sqrt_bc2 =
      static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(o.beta2, static_cast<double>(t))));
  const float eps = static_cast<float>(o.eps);
  const AdamWScalars c{decay,           beta1,     beta2,        one_minus_beta1,
                       one_minus_beta2, step_size, inv_sqrt_bc2, eps};
  AdamWScalars no_decay = c;
  no_decay.decay = 1.0f;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    FlatParam* g = groups_[gi];
    absl::Span<float> p = g->master();
    absl::Span<const float> grad = g->master_grad();
    float* m = exp_avg_[gi].data();
    float* v = exp_avg_sq_[gi].data();
    if (o.decay_vectors || o.weight_decay == 0.0) {
      AdamWKernel(p.data(), grad.data(), m, v, p.size(), c);
    } else {
      // master() holds flat elements [first, first + size): each parameter's part of it
      // with its own factor (padding, after the last parameter, decays with nothing to do).
      const int64_t first = g->master_offset(), end = first + static_cast<int64_t>(p.size());
      int64_t done = first;
      for (const FlatParamEntry& e : g->entries()) {
        const int64_t lo = std::max(e.offset, first), hi = std::min(e.offset + e.numel, end);
        if (lo >= hi) continue;
        if (lo > done) {  // not part of a parameter (none today; kept exact if it appears)
          AdamWKernel(p.data() + (done - first), grad.data() + (done - first), m + (done - first),
                      v + (done - first), lo - done, c);
        }
        const AdamWScalars& k = e.shape.size() >= 2 ? c : no_decay;
        AdamWKernel(p.data() + (lo - first), grad.data() + (lo - first), m + (lo - first),
                    v + (lo - first), hi - lo, k);
        done = hi;
      }
      if (done < end) {
        AdamWKernel(p.data() + (done - first), grad.data() + (done - first), m + (done - first),
                    v + (done - first), end - done, c);
      }
    }
    GRADSUM_RETURN_IF_ERROR(g->MasterUpdated());
  }
  step_ = t;
  return absl::OkStatus();
}

}  // namespace gradsum
