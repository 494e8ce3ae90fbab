#include "losses/policy_loss.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/half.h"
#include "core/status.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "losses/cross_entropy.h"
#include "losses/cross_entropy_kernel.h"
#include "losses/display.h"
#include "losses/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum::losses {
namespace {

using ::gradsum::testing::RunRanks;
using ::testing::HasSubstr;

// ---- A global batch of packed sequences and its detached statistics. ----

struct Problem {
  int64_t n = 0, v = 0;
  std::vector<float> logits;  // [n, v]
  std::vector<int64_t> labels;
  std::vector<float> old_logprob, advantages, is_weights, ref_logprob;
  std::vector<uint8_t> mask;
  std::vector<int64_t> seq_of_row;  // sequence id of each row
  std::vector<int64_t> seq_valid;   // n_s per row (the whole sequence's valid count)
  double valid_tokens = 0;          // N
  double sequences = 0;             // S

  bool Valid(int64_t r) const { return labels[r] != -100 && (mask.empty() || mask[r] != 0); }
};

// Straightforward fp64 log-softmax of one row.
double RefLogp(const Problem& p, int64_t r, std::vector<double>* softmax = nullptr) {
  const float* z = p.logits.data() + r * p.v;
  double mx = -INFINITY;
  for (int64_t j = 0; j < p.v; ++j) mx = std::max(mx, static_cast<double>(z[j]));
  double sum = 0.0;
  for (int64_t j = 0; j < p.v; ++j) sum += std::exp(static_cast<double>(z[j]) - mx);
  const double lse = mx + std::log(sum);
  if (softmax != nullptr) {
    softmax->resize(p.v);
    for (int64_t j = 0; j < p.v; ++j) (*softmax)[j] = std::exp(static_cast<double>(z[j]) - lse);
  }
  return static_cast<double>(z[p.labels[r]]) - lse;
}

// Fills the detached counts: N, n_s per row, S.
void Recount(Problem* p) {
  p->valid_tokens = 0;
  int64_t num_seqs = 0;
  for (int64_t s : p->seq_of_row) num_seqs = std::max(num_seqs, s + 1);
  std::vector<int64_t> per_seq(num_seqs, 0);
  for (int64_t r = 0; r < p->n; ++r) {
    if (!p->Valid(r)) continue;
    p->valid_tokens += 1;
    ++per_seq[p->seq_of_row[r]];
  }
  p->sequences = 0;
  for (int64_t c : per_seq) p->sequences += c > 0 ? 1 : 0;
  p->seq_valid.assign(p->n, 0);
  for (int64_t r = 0; r < p->n; ++r) p->seq_valid[r] = per_seq[p->seq_of_row[r]];
}

// `seqs` sequences of `len` tokens. The old log-probs are set from the true log-probs minus
// chosen log-ratios, so every branch (both clips, the dual clip, the +-20 clamp, ratios in
// the clip range) is exercised, and no ratio lies near a kink (0.8, 1.2, 3) where a finite
// difference would straddle it.
Problem MakeProblem(int64_t seqs, int64_t len, int64_t v, uint32_t seed) {
  Problem p;
  p.n = seqs * len;
  p.v = v;
  p.logits = RandomNormal(static_cast<size_t>(p.n * v), seed, 1.5f);
  std::mt19937 rng(seed + 1);
  std::uniform_int_distribution<int64_t> cls(0, v - 1);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const double kDeltas[] = {-0.5, -0.1, 0.05, 0.5, 1.5, 25.0, -25.0, 0.1};
  for (int64_t r = 0; r < p.n; ++r) {
    p.seq_of_row.push_back(r / len);
    p.labels.push_back(cls(rng));
    // Advantages away from 0, both signs.
    const float a = (0.3f + u(rng)) * (r % 3 == 1 ? -1.0f : 1.0f);
    p.advantages.push_back(a);
    p.is_weights.push_back(0.5f + 2.0f * u(rng));  // some above the default cap of 2
    p.ref_logprob.push_back(-3.0f - 2.0f * u(rng));
    p.mask.push_back(1);
  }
  for (int64_t r = 0; r < p.n; ++r) {
    const double delta = kDeltas[(r * 5 + seed) % 8];
    p.old_logprob.push_back(static_cast<float>(RefLogp(p, r) - delta));
  }
  // Uneven valid counts: some ignored labels and masked tokens, in a seed-dependent pattern.
  for (int64_t r = 0; r < p.n; ++r) {
    if ((r * 7 + seed) % 11 == 3) p.labels[r] = -100;
    if ((r * 3 + seed) % 13 == 5) p.mask[r] = 0;
  }
  Recount(&p);
  return p;
}

// ---- The fp64 reference, written independently of the code under test: the formulas as
// a PyTorch implementation writes them (torch.maximum / torch.minimum / torch.clamp), and
// their gradients by the chain rule through those ops. ----

struct RefResult {
  double loss = 0, kl_loss = 0, kl_sum = 0, ratio_sum = 0;
  double ratio_max = -INFINITY, ratio_min = INFINITY;
  int64_t clip = 0, dual = 0, valid = 0;
  std::vector<double> grad;  // [n, v]
};

RefResult Reference(const Problem& p, const PolicyLossOptions& o, bool use_iw, bool use_ref) {
  RefResult out;
  out.grad.assign(static_cast<size_t>(p.n * p.v), 0.0);
  for (int64_t r = 0; r < p.n; ++r) {
    if (!p.Valid(r)) continue;
    ++out.valid;
    std::vector<double> sm;
    const double logp = RefLogp(p, r, &sm);
    const double a = p.advantages[r];
    const double log_ratio_raw = logp - p.old_logprob[r];
    const double log_ratio = std::min(std::max(log_ratio_raw, -20.0), 20.0);
    const double d_log_ratio = (log_ratio_raw >= -20.0 && log_ratio_raw <= 20.0) ? 1.0 : 0.0;
    const double ratio = std::exp(log_ratio);
    const double d_ratio = ratio * d_log_ratio;  // d ratio / d logp
    const double lo = 1.0 - o.eps_low, hi = 1.0 + o.eps_high;
    const double clipped = std::min(std::max(ratio, lo), hi);
    const double d_clipped = (ratio >= lo && ratio <= hi) ? d_ratio : 0.0;
    const double pg_losses1 = -a * ratio, d1 = -a * d_ratio;
    const double pg_losses2 = -a * clipped, d2 = -a * d_clipped;
    double clip_pg = std::max(pg_losses1, pg_losses2);
    double d_clip_pg = pg_losses1 >= pg_losses2 ? d1 : d2;
    if (pg_losses2 > pg_losses1) ++out.clip;
    double pg = clip_pg, d_pg = d_clip_pg;
    if (a < 0 && o.dual_clip_c > 0) {
      const double pg_losses3 = -a * o.dual_clip_c;
      pg = std::min(pg_losses3, clip_pg);
      d_pg = clip_pg <= pg_losses3 ? d_clip_pg : 0.0;
      if (clip_pg > pg_losses3) ++out.dual;
    }
    if (use_iw) {
      const double w = std::min(static_cast<double>(p.is_weights[r]), o.is_cap);
      pg *= w;
      d_pg *= w;
    }
    double kl = 0, d_kl = 0;
    if (use_ref) {
      const double ref = p.ref_logprob[r];
      if (o.kl_estimator == KlEstimator::kK1) {
        kl = logp - ref;
        d_kl = 1.0;
      } else if (o.kl_estimator == KlEstimator::kK2) {
        kl = 0.5 * (logp - ref) * (logp - ref);
        d_kl = logp - ref;
      } else {
        const double raw = std::exp(ref - logp) - (ref - logp) - 1.0;
        kl = std::min(std::max(raw, -10.0), 10.0);
        d_kl = (raw >= -10.0 && raw <= 10.0) ? (-std::exp(ref - logp) + 1.0) : 0.0;
      }
    }
    const double c = o.aggregation == PolicyLossAggregation::kTokenMean
                         ? 1.0 / p.valid_tokens
                         : 1.0 / (static_cast<double>(p.seq_valid[r]) * p.sequences);
    out.loss += c * (pg + o.kl_coef * kl);
    out.kl_loss += c * o.kl_coef * kl;
    out.kl_sum += kl;
    out.ratio_sum += ratio;
    out.ratio_max = std::max(out.ratio_max, ratio);
    out.ratio_min = std::min(out.ratio_min, ratio);
    // dL/dz_j = c * dterm/dlogp * (onehot_j - softmax_j).
    const double g = c * (d_pg + o.kl_coef * d_kl);
    for (int64_t j = 0; j < p.v; ++j) {
      out.grad[r * p.v + j] = g * ((j == p.labels[r] ? 1.0 : 0.0) - sm[j]);
    }
  }
  return out;
}

// ---- Calls of the code under test on a range of rows. ----

struct Outcome {
  PolicyLossResult result;
  std::vector<float> grad;
};

PolicyLossInputs InputsFor(const Problem& p, int64_t begin, int64_t end, bool use_iw,
                           bool use_ref) {
  auto sub = [&](const auto& v) { return absl::MakeConstSpan(v).subspan(begin, end - begin); };
  PolicyLossInputs in;
  in.labels = sub(p.labels);
  in.old_logprob = sub(p.old_logprob);
  in.advantages = sub(p.advantages);
  in.mask = sub(p.mask);
  if (use_iw) in.is_weights = sub(p.is_weights);
  if (use_ref) in.ref_logprob = sub(p.ref_logprob);
  return in;
}

PolicyLossNormalizer NormFor(const Problem& p, int64_t begin, int64_t end) {
  PolicyLossNormalizer norm;
  norm.global_valid_tokens = p.valid_tokens;
  norm.global_sequences = p.sequences;
  norm.sequence_valid_tokens = absl::MakeConstSpan(p.seq_valid).subspan(begin, end - begin);
  return norm;
}

absl::StatusOr<Outcome> RunRows(const Problem& p, int64_t begin, int64_t end,
                                const PolicyLossOptions& o, bool use_iw, bool use_ref) {
  Outcome run;
  std::vector<float> z(p.logits.begin() + begin * p.v, p.logits.begin() + end * p.v);
  run.grad.assign(z.size(), std::nanf(""));  // every element must be overwritten
  absl::StatusOr<PolicyLossResult> r = PolicyLossForwardBackward(
      F32Matrix(z.data(), end - begin, p.v), InputsFor(p, begin, end, use_iw, use_ref),
      NormFor(p, begin, end), F32Matrix(run.grad.data(), end - begin, p.v), o);
  if (!r.ok()) return r.status();
  run.result = *r;
  return run;
}

double MaxAbs(const std::vector<double>& x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::fabs(e));
  return m;
}

PolicyLossOptions FullOptions(KlEstimator kl, PolicyLossAggregation agg) {
  PolicyLossOptions o;
  o.eps_low = 0.2;
  o.eps_high = 0.28;
  o.dual_clip_c = 3.0;
  o.kl_coef = 0.05;
  o.kl_estimator = kl;
  o.aggregation = agg;
  o.is_cap = 2.0;
  return o;
}

// ---- Tests. ----

TEST(PolicyLossTest, MatchesTheFp64ReferenceInEveryModeAndBranch) {
  const Problem p = MakeProblem(/*seqs=*/6, /*len=*/8, /*v=*/1100, /*seed=*/3);  // 2 tiles
  for (KlEstimator kl : {KlEstimator::kK1, KlEstimator::kK2, KlEstimator::kK3}) {
    for (PolicyLossAggregation agg :
         {PolicyLossAggregation::kTokenMean, PolicyLossAggregation::kSeqMeanTokenMean}) {
      for (int variant = 0; variant < 3; ++variant) {
        const bool use_iw = variant != 1, use_ref = variant != 2;
        PolicyLossOptions o = FullOptions(kl, agg);
        if (!use_ref) o.kl_coef = 0.0;
        SCOPED_TRACE(::testing::Message() << "kl " << static_cast<int>(kl) << " agg "
                                          << static_cast<int>(agg) << " variant " << variant);
        const RefResult want = Reference(p, o, use_iw, use_ref);
        absl::StatusOr<Outcome> got = RunRows(p, 0, p.n, o, use_iw, use_ref);
        ASSERT_TRUE(got.ok()) << got.status();
        const double gmax = MaxAbs(want.grad);
        ASSERT_GT(gmax, 1e-4);
        for (size_t i = 0; i < want.grad.size(); ++i) {
          ASSERT_NEAR(got->grad[i], want.grad[i], 1e-5 * gmax) << "element " << i;
        }
        EXPECT_NEAR(got->result.local_loss, want.loss, 1e-6 * std::max(1.0, std::fabs(want.loss)));
        EXPECT_NEAR(got->result.local_kl_loss, want.kl_loss, 1e-6);
        EXPECT_NEAR(got->result.local_kl_sum, want.kl_sum, 1e-4);
        EXPECT_EQ(got->result.clip_count, want.clip);
        EXPECT_EQ(got->result.dual_clip_count, want.dual);
        EXPECT_EQ(got->result.local_valid_tokens, want.valid);
        EXPECT_NEAR(got->result.ratio_sum, want.ratio_sum, 1e-6 * want.ratio_sum);
        EXPECT_NEAR(got->result.ratio_max, want.ratio_max, 1e-6 * want.ratio_max);
        EXPECT_NEAR(got->result.ratio_min, want.ratio_min, 1e-6 * want.ratio_min);
      }
    }
  }
  // The data exercises what it claims to: both clips and masked tokens occur.
  const RefResult r =
      Reference(p, FullOptions(KlEstimator::kK3, PolicyLossAggregation::kTokenMean), true, true);
  EXPECT_GT(r.clip, 0);
  EXPECT_GT(r.dual, 0);
  EXPECT_LT(r.valid, p.n);
  EXPECT_EQ(r.ratio_max, std::exp(20.0));  // the clamp
}

// Central differences of the loss of the code under test at a few logit elements, on rows
// of every branch; and the same for the reference (so the reference's gradient is checked
// against its own loss, not only against the code).
TEST(PolicyLossTest, GradientMatchesFiniteDifferences) {
  // Seed 23 gives rows of every branch, the dual clip included (checked at the end).
  const Problem base = MakeProblem(/*seqs=*/2, /*len=*/8, /*v=*/23, /*seed=*/23);
  const PolicyLossOptions o = FullOptions(KlEstimator::kK3, PolicyLossAggregation::kTokenMean);
  absl::StatusOr<Outcome> at = RunRows(base, 0, base.n, o, true, true);
  ASSERT_TRUE(at.ok()) << at.status();
  const RefResult ref_at = Reference(base, o, true, true);
  int checked = 0;
  for (int64_t r = 0; r < base.n; ++r) {
    if (!base.Valid(r)) continue;
    for (int64_t j : {base.labels[r], (base.labels[r] + 7) % base.v}) {
      const float h = 5e-3f;
      Problem plus = base, minus = base;
      plus.logits[r * base.v + j] += h;
      minus.logits[r * base.v + j] -= h;
      const double step = static_cast<double>(plus.logits[r * base.v + j]) -
                          static_cast<double>(minus.logits[r * base.v + j]);
      absl::StatusOr<Outcome> lp = RunRows(plus, 0, base.n, o, true, true);
      absl::StatusOr<Outcome> lm = RunRows(minus, 0, base.n, o, true, true);
      ASSERT_TRUE(lp.ok() && lm.ok());
      const double fd = (lp->result.local_loss - lm->result.local_loss) / step;
      const double analytic = at->grad[r * base.v + j];
      EXPECT_NEAR(analytic, fd, 5e-5 + 5e-3 * std::fabs(fd)) << "row " << r << " col " << j;
      const double ref_fd =
          (Reference(plus, o, true, true).loss - Reference(minus, o, true, true).loss) / step;
      EXPECT_NEAR(ref_at.grad[r * base.v + j], ref_fd, 1e-7 + 1e-3 * std::fabs(ref_fd))
          << "reference, row " << r << " col " << j;
      ++checked;
    }
  }
  EXPECT_GT(checked, 20);
  EXPECT_GT(ref_at.clip, 0);
  EXPECT_GT(ref_at.dual, 0);
  EXPECT_LT(ref_at.clip + ref_at.dual, ref_at.valid);  // and unclipped rows
}

// SEMANTICS §2 / §13: the global batch split over W ranks and G micro-batches, each call
// given the GLOBAL normalisers, sums to the single-call reference: the loss, each row's
// gradient, and the gradient of a parameter shared by all ranks (a linear head below the
// logits, its gradient SUM-reduced over the shards).
TEST(PolicyLossTest, MeshIndependentAtWorld124AndMicroBatches12) {
  const int64_t kSeqs = 8, kLen = 6, kV = 300, kD = 4;
  Problem p = MakeProblem(kSeqs, kLen, kV, /*seed=*/7);
  // A shared parameter: each row's hidden vector h_t, logits = h_t @ W (the gradient of W
  // is sum_t h_t^T dz_t, a sum over shards).
  const std::vector<float> hidden = RandomNormal(static_cast<size_t>(p.n * kD), 11, 1.0f);
  for (PolicyLossAggregation agg :
       {PolicyLossAggregation::kTokenMean, PolicyLossAggregation::kSeqMeanTokenMean}) {
    const PolicyLossOptions o = FullOptions(KlEstimator::kK3, agg);
    const RefResult want = Reference(p, o, true, true);
    std::vector<double> want_w(kD * kV, 0.0);
    for (int64_t t = 0; t < p.n; ++t)
      for (int64_t d = 0; d < kD; ++d)
        for (int64_t j = 0; j < kV; ++j)
          want_w[d * kV + j] += hidden[t * kD + d] * want.grad[t * kV + j];
    const double gmax = MaxAbs(want.grad), wmax = MaxAbs(want_w);
    ASSERT_GT(gmax, 0.0);
    for (int world : {1, 2, 4}) {
      for (int micro : {1, 2}) {
        SCOPED_TRACE(::testing::Message()
                     << "agg " << static_cast<int>(agg) << " W " << world << " G " << micro);
        // §11: row j of micro-batch m on rank r is sequence (m W + r) * per + j.
        const int64_t per = kSeqs / (world * micro);
        double loss = 0.0;
        std::vector<double> grad_w(kD * kV, 0.0);
        std::vector<double> grad(p.n * kV, 0.0);
        int64_t valid = 0;
        for (int r = 0; r < world; ++r) {
          for (int m = 0; m < micro; ++m) {
            const int64_t begin = (m * world + r) * per * kLen, end = begin + per * kLen;
            absl::StatusOr<Outcome> got = RunRows(p, begin, end, o, true, true);
            ASSERT_TRUE(got.ok()) << got.status();
            loss += got->result.local_loss;
            valid += got->result.local_valid_tokens;
            for (int64_t t = begin; t < end; ++t) {
              for (int64_t j = 0; j < kV; ++j) {
                const double g = got->grad[(t - begin) * kV + j];
                grad[t * kV + j] += g;
                for (int64_t d = 0; d < kD; ++d) grad_w[d * kV + j] += hidden[t * kD + d] * g;
              }
            }
          }
        }
        EXPECT_EQ(valid, static_cast<int64_t>(p.valid_tokens));
        EXPECT_NEAR(loss, want.loss, 1e-5 * std::max(1.0, std::fabs(want.loss)));
        for (size_t i = 0; i < grad.size(); ++i) {
          ASSERT_NEAR(grad[i], want.grad[i], 1e-5 * gmax) << "logit " << i;
        }
        for (size_t i = 0; i < grad_w.size(); ++i) {
          ASSERT_NEAR(grad_w[i], want_w[i], 1e-5 * wmax) << "head " << i;
        }
      }
    }
  }
}

// A rank whose tokens are all masked: its gradient is exactly 0 and its loss 0, and the
// other ranks' results are bit for bit those of the same step without that rank's tokens
// (masked tokens do not count in N, S or n_s); uneven valid counts on the other ranks.
TEST(PolicyLossTest, AllMaskedRankGivesExactZerosAndLeavesOthersUnchanged) {
  const int64_t kSeqs = 8, kLen = 6, kV = 257, world = 4, per = kSeqs / world;
  Problem p = MakeProblem(kSeqs, kLen, kV, /*seed=*/9);
  const int64_t masked_begin = 3 * per * kLen;  // rank 3's rows
  for (int64_t r = masked_begin; r < p.n; ++r) p.mask[r] = 0;
  Recount(&p);
  // The same step without rank 3 (a world of 3 over its first 6 sequences).
  Problem without = p;
  without.n = masked_begin;
  without.logits.resize(masked_begin * kV);
  for (auto* v :
       {&without.old_logprob, &without.advantages, &without.is_weights, &without.ref_logprob}) {
    v->resize(masked_begin);
  }
  without.labels.resize(masked_begin);
  without.mask.resize(masked_begin);
  without.seq_of_row.resize(masked_begin);
  Recount(&without);
  ASSERT_EQ(without.valid_tokens, p.valid_tokens);
  ASSERT_EQ(without.sequences, p.sequences);
  for (PolicyLossAggregation agg :
       {PolicyLossAggregation::kTokenMean, PolicyLossAggregation::kSeqMeanTokenMean}) {
    const PolicyLossOptions o = FullOptions(KlEstimator::kK2, agg);
    std::vector<int64_t> valid_per_rank;
    double loss = 0.0;
    for (int r = 0; r < world; ++r) {
      const int64_t begin = r * per * kLen, end = begin + per * kLen;
      absl::StatusOr<Outcome> got = RunRows(p, begin, end, o, true, true);
      ASSERT_TRUE(got.ok()) << got.status();
      valid_per_rank.push_back(got->result.local_valid_tokens);
      loss += got->result.local_loss;
      if (r == 3) {
        EXPECT_EQ(got->result.local_valid_tokens, 0);
        EXPECT_EQ(got->result.local_loss, 0.0);
        for (float g : got->grad) ASSERT_EQ(g, 0.0f);
        continue;
      }
      absl::StatusOr<Outcome> alone = RunRows(without, begin, end, o, true, true);
      ASSERT_TRUE(alone.ok()) << alone.status();
      EXPECT_EQ(got->result.local_loss, alone->result.local_loss);
      EXPECT_EQ(got->grad, alone->grad) << "rank " << r;
      // A non-trivial gradient: the comparison above can fail.
      EXPECT_GT(*std::max_element(got->grad.begin(), got->grad.end()), 0.0f);
    }
    // Uneven counts on the unmasked ranks, and the sum still the reference.
    EXPECT_FALSE(valid_per_rank[0] == valid_per_rank[1] && valid_per_rank[1] == valid_per_rank[2]);
    const RefResult want = Reference(p, o, true, true);
    EXPECT_NEAR(loss, want.loss, 1e-5 * std::max(1.0, std::fabs(want.loss)));
  }
}

TEST(PolicyLossTest, NoValidTokenGivesZeroLossAndExactlyZeroGradients) {
  Problem p = MakeProblem(2, 5, 64, 13);
  for (int64_t r = 0; r < p.n; ++r) p.mask[r] = r % 2;      // half masked...
  for (int64_t r = 1; r < p.n; r += 2) p.labels[r] = -100;  // ...the rest ignored
  Recount(&p);
  ASSERT_EQ(p.valid_tokens, 0.0);
  for (PolicyLossAggregation agg :
       {PolicyLossAggregation::kTokenMean, PolicyLossAggregation::kSeqMeanTokenMean}) {
    absl::StatusOr<Outcome> got =
        RunRows(p, 0, p.n, FullOptions(KlEstimator::kK3, agg), true, true);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->result.local_loss, 0.0);
    EXPECT_EQ(got->result.local_kl_loss, 0.0);
    EXPECT_EQ(got->result.local_valid_tokens, 0);
    EXPECT_EQ(got->result.ratio_sum, 0.0);
    for (float g : got->grad) {
      ASSERT_EQ(g, 0.0f);
      ASSERT_FALSE(std::signbit(g));
    }
  }
}

TEST(PolicyLossTest, InPlaceThreadsAndBf16) {
  const Problem p = MakeProblem(16, 16, 2048, 17);  // two row blocks, over two threads
  const PolicyLossOptions o = FullOptions(KlEstimator::kK3, PolicyLossAggregation::kTokenMean);
  PolicyLossOptions one_thread = o;
  one_thread.num_threads = 1;
  absl::StatusOr<Outcome> two = RunRows(p, 0, p.n, o, true, true);
  absl::StatusOr<Outcome> one = RunRows(p, 0, p.n, one_thread, true, true);
  ASSERT_TRUE(two.ok() && one.ok());
  EXPECT_EQ(two->grad, one->grad);  // the thread count changes nothing
  EXPECT_EQ(two->result.local_loss, one->result.local_loss);

  // In place: the logits overwritten by their gradient.
  std::vector<float> z = p.logits;
  const TensorView zv = F32Matrix(z.data(), p.n, p.v);
  absl::StatusOr<PolicyLossResult> in_place =
      PolicyLossForwardBackward(zv, InputsFor(p, 0, p.n, true, true), NormFor(p, 0, p.n), zv, o);
  ASSERT_TRUE(in_place.ok()) << in_place.status();
  EXPECT_EQ(z, two->grad);
  EXPECT_EQ(in_place->local_loss, two->result.local_loss);

  // bf16 logits and gradient: against the reference on the bf16-rounded logits.
  Problem pb = p;
  std::vector<BF16> zb(p.logits.size()), gb(p.logits.size());
  for (size_t i = 0; i < zb.size(); ++i) {
    zb[i] = BF16::FromFloat(p.logits[i]);
    pb.logits[i] = zb[i].ToFloat();
  }
  const RefResult want = Reference(pb, o, true, true);
  absl::StatusOr<PolicyLossResult> got = PolicyLossForwardBackward(
      *TensorView::Create(zb.data(), DType::kBF16, {p.n, p.v}), InputsFor(p, 0, p.n, true, true),
      NormFor(p, 0, p.n), *TensorView::Create(gb.data(), DType::kBF16, {p.n, p.v}), o);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_NEAR(got->local_loss, want.loss, 1e-5 * std::max(1.0, std::fabs(want.loss)));
  const double gmax = MaxAbs(want.grad);
  for (size_t i = 0; i < gb.size(); ++i) {
    // bf16 keeps 8 bits: 2^-8 of the element, plus the fp32 arithmetic's share.
    ASSERT_NEAR(gb[i].ToFloat(), want.grad[i], std::fabs(want.grad[i]) / 128.0 + 1e-6 * gmax) << i;
  }
}

// Metrics through the display pipeline (§8): W = 2, G = 2, with one micro-batch on one
// rank fully masked (its max/min must not count). The global clip fraction, mean ratio,
// max and min equal the single-process values.
TEST(PolicyLossTest, MetricsReduceThroughTheDisplay) {
  const int world = 2, micro = 2, kLen = 6;
  Problem p = MakeProblem(/*seqs=*/8, kLen, /*v=*/128, /*seed=*/19);
  const int64_t per = 8 / (world * micro);
  // Micro-batch 1 of rank 1: rows of slot m W + r = 3.
  for (int64_t t = 3 * per * kLen; t < 4 * per * kLen; ++t) p.mask[t] = 0;
  Recount(&p);
  const PolicyLossOptions o = FullOptions(KlEstimator::kK3, PolicyLossAggregation::kTokenMean);
  const RefResult want = Reference(p, o, true, true);
  std::mutex mu;
  std::vector<StepDisplayValues> got(world);
  absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
    StepDisplay display;
    GRADSUM_RETURN_IF_ERROR(RegisterPolicyLossDisplay(display));
    for (int m = 0; m < micro; ++m) {
      const int64_t begin = (m * world + comm.rank()) * per * kLen, end = begin + per * kLen;
      absl::StatusOr<Outcome> run = RunRows(p, begin, end, o, true, true);
      if (!run.ok()) return run.status();
      GRADSUM_RETURN_IF_ERROR(AddPolicyLossToDisplay(display, run->result));
    }
    GRADSUM_ASSIGN_OR_RETURN(StepDisplayValues v, display.Reduce(comm));
    std::lock_guard<std::mutex> lock(mu);
    got[comm.rank()] = v;
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (const StepDisplayValues& v : got) {
    EXPECT_NEAR(*v.Value("policy"), want.loss, 1e-6);
    EXPECT_NEAR(v.total_loss, want.loss, 1e-6);
    EXPECT_NEAR(*v.Value("policy/kl"), want.kl_loss, 1e-6);
    EXPECT_EQ(*v.Value("policy/valid_tokens"), p.valid_tokens);
    EXPECT_EQ(*v.Value("policy/clip_count"), static_cast<double>(want.clip));
    EXPECT_EQ(*v.Value("policy/dual_clip_count"), static_cast<double>(want.dual));
    EXPECT_NEAR(*PolicyLossClipFraction(v), want.clip / p.valid_tokens, 1e-12);
    EXPECT_NEAR(*PolicyLossMeanRatio(v), want.ratio_sum / p.valid_tokens,
                1e-6 * want.ratio_sum / p.valid_tokens);
    EXPECT_NEAR(*v.Value("policy/ratio_max"), want.ratio_max, 1e-6 * want.ratio_max);
    EXPECT_NEAR(*v.Value("policy/ratio_min"), want.ratio_min, 1e-6 * want.ratio_min);
    EXPECT_GT(want.clip, 0);
  }
}

// Every bad argument is InvalidArgument (or FailedPrecondition for a local count) naming
// the value, and nothing is written.
TEST(PolicyLossTest, BadInputsAreErrorsNamingTheValue) {
  Problem p = MakeProblem(2, 4, 16, 23);
  for (int64_t r = 0; r < p.n; ++r) {  // every token valid, so each edit below is read
    p.mask[r] = 1;
    if (p.labels[r] == -100) p.labels[r] = r;
  }
  Recount(&p);
  struct Case {
    std::string name;
    std::function<void(Problem&, PolicyLossOptions&, PolicyLossNormalizer&, int64_t& rows)> edit;
    absl::StatusCode code;
    std::string message;
  };
  const double nan = std::nan("");
  const std::vector<Case> cases = {
      {"label",
       [](Problem& q, PolicyLossOptions&, PolicyLossNormalizer&, int64_t&) {
         q.labels[2] = 16;
         q.mask[2] = 1;
       },
       absl::StatusCode::kInvalidArgument, "label 16 at row 2 is outside [0, 16)"},
      {"negative label",
       [](Problem& q, PolicyLossOptions&, PolicyLossNormalizer&, int64_t&) {
         q.labels[1] = -5;
         q.mask[1] = 1;
       },
       absl::StatusCode::kInvalidArgument, "label -5 at row 1"},
      {"advantage",
       [](Problem& q, PolicyLossOptions&, PolicyLossNormalizer&, int64_t&) {
         q.advantages[0] = INFINITY;
       },
       absl::StatusCode::kInvalidArgument, "advantage inf at row 0 must be finite"},
      {"old_logprob",
       [](Problem& q, PolicyLossOptions&, PolicyLossNormalizer&, int64_t&) {
         q.old_logprob[4] = std::nanf("");
       },
       absl::StatusCode::kInvalidArgument, "old_logprob nan at row 4 must be finite"},
      {"ref_logprob",
       [](Problem& q, PolicyLossOptions&, PolicyLossNormalizer&, int64_t&) {
         q.ref_logprob[5] = -INFINITY;
       },
       absl::StatusCode::kInvalidArgument, "ref_logprob -inf at row 5"},
      {"is weight",
       [](Problem& q, PolicyLossOptions&, PolicyLossNormalizer&, int64_t&) {
         q.is_weights[6] = -1.0f;
       },
       absl::StatusCode::kInvalidArgument, "importance weight -1 at row 6"},
      {"eps_low",
       [](Problem&, PolicyLossOptions& o, PolicyLossNormalizer&, int64_t&) { o.eps_low = -0.1; },
       absl::StatusCode::kInvalidArgument, "eps_low = -0.1"},
      {"eps_high nan",
       [nan](Problem&, PolicyLossOptions& o, PolicyLossNormalizer&, int64_t&) { o.eps_high = nan; },
       absl::StatusCode::kInvalidArgument, "eps_high = nan"},
      {"dual clip",
       [](Problem&, PolicyLossOptions& o, PolicyLossNormalizer&, int64_t&) { o.dual_clip_c = 0.5; },
       absl::StatusCode::kInvalidArgument, "dual_clip_c = 0.5"},
      {"kl_coef nan",
       [nan](Problem&, PolicyLossOptions& o, PolicyLossNormalizer&, int64_t&) { o.kl_coef = nan; },
       absl::StatusCode::kInvalidArgument, "kl_coef = nan"},
      {"is_cap",
       [](Problem&, PolicyLossOptions& o, PolicyLossNormalizer&, int64_t&) { o.is_cap = 0.0; },
       absl::StatusCode::kInvalidArgument, "is_cap = 0"},
      {"kl without ref",
       [](Problem& q, PolicyLossOptions&, PolicyLossNormalizer&, int64_t&) {
         q.ref_logprob.clear();
       },
       absl::StatusCode::kInvalidArgument, "needs ref_logprob"},
      {"N < 0",
       [](Problem&, PolicyLossOptions&, PolicyLossNormalizer& n, int64_t&) {
         n.global_valid_tokens = -1.0;
       },
       absl::StatusCode::kInvalidArgument, "global valid-token count N = -1"},
      {"N nan",
       [nan](Problem&, PolicyLossOptions&, PolicyLossNormalizer& n, int64_t&) {
         n.global_valid_tokens = nan;
       },
       absl::StatusCode::kInvalidArgument, "N = nan"},
      {"local N",
       [](Problem&, PolicyLossOptions&, PolicyLossNormalizer& n, int64_t&) {
         n.global_valid_tokens = 2.0;
       },
       absl::StatusCode::kFailedPrecondition, "N = 2 is smaller than this call's"},
      {"S < 0",
       [](Problem&, PolicyLossOptions& o, PolicyLossNormalizer& n, int64_t&) {
         o.aggregation = PolicyLossAggregation::kSeqMeanTokenMean;
         n.global_sequences = -2.0;
       },
       absl::StatusCode::kInvalidArgument, "global sequence count S = -2"},
      {"n_s",
       [](Problem& q, PolicyLossOptions& o, PolicyLossNormalizer&, int64_t&) {
         o.aggregation = PolicyLossAggregation::kSeqMeanTokenMean;
         q.seq_valid[0] = 0;
         q.mask[0] = 1;
         q.labels[0] = 3;
       },
       absl::StatusCode::kInvalidArgument, "n_s = 0 at row 0"},
      {"advantages length",
       [](Problem& q, PolicyLossOptions&, PolicyLossNormalizer&, int64_t&) {
         q.advantages.pop_back();
       },
       absl::StatusCode::kInvalidArgument, "7 advantages for 8 rows"},
      {"mask length",
       [](Problem& q, PolicyLossOptions&, PolicyLossNormalizer&, int64_t&) { q.mask.push_back(1); },
       absl::StatusCode::kInvalidArgument, "9 mask values for 8 rows"},
      {"grad shape",
       [](Problem&, PolicyLossOptions&, PolicyLossNormalizer&, int64_t& rows) { rows = 7; },
       absl::StatusCode::kInvalidArgument, "must have the dtype and shape of logits"},
      {"nan logits",
       [](Problem& q, PolicyLossOptions&, PolicyLossNormalizer&, int64_t&) {
         q.logits[3 * 16 + 5] = std::nanf("");
         q.mask[3] = 1;
         q.labels[3] = 2;
       },
       absl::StatusCode::kInvalidArgument, "logits row 3 (label 2) contains NaN"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Problem q = p;
    PolicyLossOptions o = FullOptions(KlEstimator::kK3, PolicyLossAggregation::kTokenMean);
    int64_t grad_rows = q.n;
    PolicyLossNormalizer n;
    n.global_valid_tokens = 100;
    n.global_sequences = 10;
    c.edit(q, o, n, grad_rows);
    if (o.aggregation == PolicyLossAggregation::kSeqMeanTokenMean) {
      n.sequence_valid_tokens = q.seq_valid;
    }
    PolicyLossInputs in;
    in.labels = q.labels;
    in.old_logprob = q.old_logprob;
    in.advantages = q.advantages;
    in.mask = q.mask;
    in.is_weights = q.is_weights;
    in.ref_logprob = q.ref_logprob;
    std::vector<float> grad(static_cast<size_t>(grad_rows * q.v), 42.0f);
    absl::StatusOr<PolicyLossResult> r = PolicyLossForwardBackward(
        F32Matrix(q.logits.data(), q.n, q.v), in, n, F32Matrix(grad.data(), grad_rows, q.v), o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.message));
    if (c.name != "nan logits") {
      for (float g : grad) ASSERT_EQ(g, 42.0f);  // checked before anything was written
    }
  }
  // Values of invalid tokens are never read: garbage there is fine.
  Problem q = p;
  q.mask[0] = 0;
  q.advantages[0] = std::nanf("");
  q.old_logprob[0] = INFINITY;
  q.labels[0] = 12345;
  Recount(&q);
  absl::StatusOr<Outcome> ok = RunRows(
      q, 0, q.n, FullOptions(KlEstimator::kK1, PolicyLossAggregation::kTokenMean), true, true);
  ASSERT_TRUE(ok.ok()) << ok.status();
  for (int64_t j = 0; j < q.v; ++j) EXPECT_EQ(ok->grad[j], 0.0f);
}

// The hook path is the CE row code: with a hook that returns CE's own scale 1 / D, the
// scaled rows give CrossEntropyForwardBackward's gradient and row losses bit for bit (f32
// and bf16, two row blocks over two threads). So the policy loss's softmax is CE's.
float ConstantScale(void* ctx, int64_t /*row*/, double /*ce*/) {
  return *static_cast<const float*>(ctx);
}

TEST(PolicyLossTest, ScaledRowsWithTheCeScaleAreCeBitForBit) {
  const int64_t n = 160, v = 3000;  // rows_per_block = 87: two blocks
  std::vector<float> z = RandomNormal(static_cast<size_t>(n * v), 29, 2.0f);
  std::vector<int64_t> y(n);
  for (int64_t r = 0; r < n; ++r) y[r] = (r * 37) % v;
  y[5] = -100;
  const double d = 1000.0;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    std::vector<float> zf = z;
    std::vector<BF16> zb(z.size());
    for (size_t i = 0; i < z.size(); ++i) zb[i] = BF16::FromFloat(z[i]);
    const bool f32 = dtype == DType::kF32;
    void* logits = f32 ? static_cast<void*>(zf.data()) : static_cast<void*>(zb.data());
    std::vector<float> ce_f(z.size()), hook_f(z.size());
    std::vector<BF16> ce_b(z.size()), hook_b(z.size());
    void* ce_grad = f32 ? static_cast<void*>(ce_f.data()) : static_cast<void*>(ce_b.data());
    void* hook_grad = f32 ? static_cast<void*>(hook_f.data()) : static_cast<void*>(hook_b.data());
    absl::StatusOr<CrossEntropyResult> ce =
        CrossEntropyForwardBackward(*TensorView::Create(logits, dtype, {n, v}), y, {}, d,
                                    *TensorView::Create(ce_grad, dtype, {n, v}));
    ASSERT_TRUE(ce.ok()) << ce.status();
    std::vector<float> weight(n, 1.0f);
    weight[5] = 0.0f;
    std::vector<double> row_loss(n, 0.0);
    float scale = static_cast<float>(1.0 / d);
    const internal::GlobalRowScaleHook hook{&ConstantScale, &scale};
    absl::Status s =
        internal::ScaledRowsKernel(logits, hook_grad, dtype, n, v, y, weight, hook,
                                   /*num_threads=*/2, "test", absl::MakeSpan(row_loss));
    ASSERT_TRUE(s.ok()) << s;
    double sum = 0.0;
    for (double l : row_loss) sum += l;
    EXPECT_EQ(sum, ce->local_weighted_ce_sum);
    if (f32) {
      EXPECT_EQ(hook_f, ce_f);
      EXPECT_NE(ce_f[0], 0.0f);
    } else {
      for (size_t i = 0; i < z.size(); ++i) ASSERT_EQ(hook_b[i].bits, ce_b[i].bits) << i;
    }
  }
}

}  // namespace
}  // namespace gradsum::losses
