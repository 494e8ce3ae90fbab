// End-to-end checks of SEMANTICS.md §2 on the thread backend: local components summed
// over ranks and micro-batches equal the single-process global loss, and SUM-reduced
// gradients equal the single-process gradient. Every reference here is a plain
// double-precision implementation of the global formula over all tokens at once.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collectives/communicator.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "losses/cross_entropy.h"
#include "losses/display.h"
#include "losses/linear_cross_entropy.h"
#include "losses/router_losses.h"
#include "losses/step_stats.h"
#include "losses/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum::losses {
namespace {

using ::gradsum::testing::RunRanks;

constexpr int64_t kVocab = 37;
constexpr int64_t kDim = 6;

// One rank's micro-batch: tokens with their hidden state (and logits = hidden @ head).
struct Batch {
  int64_t tokens = 0;
  std::vector<float> hidden;  // [T, kDim]
  std::vector<int64_t> labels, sample_ids;
  std::vector<uint8_t> mask;
};

// batches[r][m]: uneven sizes; rank 1 has no valid token; odd ranks end with padding.
std::vector<std::vector<Batch>> MakeWorld(int world, int g, uint32_t seed) {
  std::vector<std::vector<Batch>> out(world);
  for (int r = 0; r < world; ++r) {
    for (int m = 0; m < g; ++m) {
      std::mt19937 rng(seed + 1000 * r + m);
      std::normal_distribution<float> dist(0.0f, 1.0f);
      std::bernoulli_distribution ignore(0.25);
      std::uniform_int_distribution<int64_t> cls(0, kVocab - 1);
      Batch b;
      b.tokens = 2 + 7 * ((r + 2 * m) % 3) + r;
      for (int64_t i = 0; i < b.tokens; ++i) {
        const bool padding = r % 2 == 1 && i >= b.tokens - 2;
        b.mask.push_back(padding ? 0 : 1);
        b.labels.push_back(padding || (world > 1 && r == 1) || ignore(rng) ? -100 : cls(rng));
        b.sample_ids.push_back(i / 5);
        for (int64_t k = 0; k < kDim; ++k) b.hidden.push_back(dist(rng));
      }
      out[r].push_back(std::move(b));
    }
  }
  return out;
}

std::vector<float> MakeHead(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.7f);
  std::vector<float> w(kDim * kVocab);
  for (float& e : w) e = dist(rng);
  return w;
}

std::vector<float> Logits(const Batch& b, const std::vector<float>& head) {
  std::vector<float> z(b.tokens * kVocab);
  for (int64_t t = 0; t < b.tokens; ++t)
    for (int64_t j = 0; j < kVocab; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < kDim; ++k)
        acc += double{b.hidden[t * kDim + k]} * head[k * kVocab + j];
      z[t * kVocab + j] = static_cast<float>(acc);
    }
  return z;
}

// w_t straight from SEMANTICS §3 (n_s counted within the micro-batch).
std::vector<double> ReferenceWeights(const Batch& b, CeWeightMode mode) {
  std::map<int64_t, int> n_s;
  for (int64_t t = 0; t < b.tokens; ++t) n_s[b.sample_ids[t]] += b.labels[t] != -100;
  std::vector<double> w(b.tokens, 0.0);
  for (int64_t t = 0; t < b.tokens; ++t) {
    if (b.labels[t] == -100) continue;
    const double n = n_s[b.sample_ids[t]];
    w[t] = mode == CeWeightMode::kToken    ? 1.0
           : mode == CeWeightMode::kSample ? 1.0 / n
                                           : 1.0 / std::sqrt(n);
  }
  return w;
}

// The global CE of §3 over every token of the step and its gradient w.r.t. the head.
struct GlobalCe {
  double loss = 0.0;
  std::vector<double> grad_head;
};

GlobalCe ReferenceGlobalCe(const std::vector<std::vector<Batch>>& world_batches,
                           const std::vector<float>& head, CeWeightMode mode) {
  double d = 0.0;
  for (const auto& rb : world_batches)
    for (const Batch& b : rb)
      for (double w : ReferenceWeights(b, mode)) d += w;
  GlobalCe ref;
  ref.grad_head.assign(kDim * kVocab, 0.0);
  if (d == 0.0) return ref;
  for (const auto& rb : world_batches)
    for (const Batch& b : rb) {
      const std::vector<double> w = ReferenceWeights(b, mode);
      for (int64_t t = 0; t < b.tokens; ++t) {
        if (w[t] == 0.0) continue;
        std::vector<double> z(kVocab, 0.0);
        for (int64_t j = 0; j < kVocab; ++j)
          for (int64_t k = 0; k < kDim; ++k)
            z[j] += double{b.hidden[t * kDim + k]} * head[k * kVocab + j];
        const double mx = *std::max_element(z.begin(), z.end());
        double s = 0;
        for (double x : z) s += std::exp(x - mx);
        const double lse = mx + std::log(s);
        ref.loss += w[t] * (lse - z[b.labels[t]]) / d;
        for (int64_t j = 0; j < kVocab; ++j) {
          const double dz = w[t] / d * (std::exp(z[j] - lse) - (j == b.labels[t] ? 1.0 : 0.0));
          for (int64_t k = 0; k < kDim; ++k)
            ref.grad_head[k * kVocab + j] += b.hidden[t * kDim + k] * dz;
        }
      }
    }
  return ref;
}

// G = 1, 2, 3 with uneven token counts and W = 1, 2, 3: the CE components (fused CE on
// materialised logits) add up to the global loss; the fused linear CE's head gradients,
// SUM-reduced, equal the global gradient.
TEST(GlobalLossTest, CeComponentsAndHeadGradientMatchSingleProcess) {
  const std::vector<float> head = MakeHead(3);
  for (int world : {1, 2, 3}) {
    for (int g : {1, 2, 3}) {
      for (CeWeightMode mode :
           {CeWeightMode::kToken, CeWeightMode::kSample, CeWeightMode::kSquare}) {
        const auto batches = MakeWorld(world, g, 11 * world + g);
        const GlobalCe ref = ReferenceGlobalCe(batches, head, mode);
        std::vector<double> display_ce(world), linear_sum(world);
        std::vector<std::vector<float>> grad_head(world);
        absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
          const int r = comm.rank();
          std::vector<MicroBatchTokens> mbs;
          for (const Batch& b : batches[r]) mbs.push_back({b.labels, b.sample_ids, b.mask});
          StepStatsOptions opt;
          opt.mode = mode;
          absl::StatusOr<StepStats> stats = ComputeStepStats(comm, mbs, opt);
          if (!stats.ok()) return stats.status();
          StepDisplay display;
          absl::Status st = display.RegisterTerm("ce");
          if (!st.ok()) return st;
          std::vector<float> gw(kDim * kVocab, 0.0f);
          for (int m = 0; m < g; ++m) {
            Batch b = batches[r][m];
            std::vector<float> z = Logits(b, head);
            absl::StatusOr<CrossEntropyResult> ce = CrossEntropyForwardBackward(
                F32Matrix(z.data(), b.tokens, kVocab), b.labels, stats->token_weights[m],
                stats->global_ce_weight_sum, F32Matrix(z.data(), b.tokens, kVocab));
            if (!ce.ok()) return ce.status();
            if (!(st = display.AddBackwardTerm("ce", ce->local_loss)).ok()) return st;
            std::vector<float> h = b.hidden, gh(b.tokens * kDim);
            std::vector<float> w = head;
            LinearCrossEntropyOptions lopt;
            lopt.chunk_rows = 3;
            absl::StatusOr<LinearCrossEntropyResult> lce = LinearCrossEntropyForwardBackward(
                F32Matrix(h.data(), b.tokens, kDim), F32Matrix(w.data(), kDim, kVocab), b.labels,
                stats->token_weights[m], stats->global_ce_weight_sum,
                F32Matrix(gh.data(), b.tokens, kDim), F32Matrix(gw.data(), kDim, kVocab), lopt);
            if (!lce.ok()) return lce.status();
            linear_sum[r] += lce->ce.local_loss;
          }
          // SEMANTICS §7: dense gradients are summed over the world.
          st = comm.AllReduce(gw.data(), gw.data(), gw.size(), DType::kF32, ReduceOp::kSum);
          if (!st.ok()) return st;
          grad_head[r] = gw;
          absl::StatusOr<StepDisplayValues> v = display.Reduce(comm);
          if (!v.ok()) return v.status();
          display_ce[r] = *v->Value("ce");
          return absl::OkStatus();
        });
        const std::string where = absl::StrCat("W=", world, " G=", g, " ", CeWeightModeName(mode));
        ASSERT_TRUE(s.ok()) << s << " " << where;
        ASSERT_GT(ref.loss, 0.0) << where;
        const double linear_total = std::accumulate(linear_sum.begin(), linear_sum.end(), 0.0);
        EXPECT_NEAR(linear_total, ref.loss, 1e-6 * ref.loss) << where;
        for (int r = 0; r < world; ++r) {
          EXPECT_NEAR(display_ce[r], ref.loss, 1e-6 * ref.loss) << where;
          EXPECT_EQ(display_ce[r], display_ce[0]) << where;
          for (size_t i = 0; i < ref.grad_head.size(); ++i) {
            ASSERT_NEAR(grad_head[r][i], ref.grad_head[i], 1e-6 + 1e-5 * std::abs(ref.grad_head[i]))
                << where << " element " << i;
          }
          EXPECT_EQ(grad_head[r], grad_head[0]) << where;
        }
      }
    }
  }
}

// A step in which every label is ignored: D == 0 everywhere, CE is 0 with exactly zero
// gradients on every rank, never NaN.
TEST(GlobalLossTest, AllIgnoredStepIsZeroEverywhere) {
  auto batches = MakeWorld(2, 2, 5);
  for (auto& rb : batches)
    for (Batch& b : rb) std::fill(b.labels.begin(), b.labels.end(), -100);
  const std::vector<float> head = MakeHead(4);
  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    std::vector<MicroBatchTokens> mbs;
    for (const Batch& b : batches[comm.rank()]) mbs.push_back({b.labels, b.sample_ids, b.mask});
    absl::StatusOr<StepStats> stats = ComputeStepStats(comm, mbs);
    if (!stats.ok()) return stats.status();
    EXPECT_EQ(stats->global_ce_weight_sum, 0.0);
    for (int m = 0; m < 2; ++m) {
      const Batch& b = batches[comm.rank()][m];
      std::vector<float> z = Logits(b, head);
      absl::StatusOr<CrossEntropyResult> ce = CrossEntropyForwardBackward(
          F32Matrix(z.data(), b.tokens, kVocab), b.labels, stats->token_weights[m], 0.0,
          F32Matrix(z.data(), b.tokens, kVocab));
      if (!ce.ok()) return ce.status();
      EXPECT_EQ(ce->local_loss, 0.0);
      for (float x : z) EXPECT_EQ(x, 0.0f);
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

// ---- Router losses across ranks with the real expert-count all-reduce. ----

constexpr int64_t kExperts = 4;
constexpr int kTopK = 2;

std::vector<double> RouterLogits(const Batch& b, const std::vector<double>& wr) {
  std::vector<double> u(b.tokens * kExperts, 0.0);
  for (int64_t t = 0; t < b.tokens; ++t)
    for (int64_t e = 0; e < kExperts; ++e)
      for (int64_t k = 0; k < kDim; ++k)
        u[t * kExperts + e] += double{b.hidden[t * kDim + k]} * wr[k * kExperts + e];
  return u;
}

template <typename T>
std::vector<int32_t> TopK(const T* u) {
  std::vector<int32_t> idx(kExperts);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return u[a] > u[b]; });
  idx.resize(kTopK);
  return idx;
}

// Global L_z + L_bal (§4, §5) over all tokens, as a function of the router weights, with
// the detached counts c[m] given.
double ReferenceRouterLoss(const std::vector<std::vector<Batch>>& batches,
                           const std::vector<double>& wr,
                           const std::vector<std::vector<int64_t>>& c, int g, double alpha_z,
                           double alpha_b) {
  double n_step = 0;
  for (const auto& rb : batches)
    for (const Batch& b : rb)
      for (uint8_t x : b.mask) n_step += x;
  double loss = 0;
  for (int m = 0; m < g; ++m) {
    const double n_m = std::accumulate(c[m].begin(), c[m].end(), 0.0) / kTopK;
    std::vector<double> sum_p(kExperts, 0.0);
    for (const auto& rb : batches) {
      const Batch& b = rb[m];
      const std::vector<double> u = RouterLogits(b, wr);
      for (int64_t t = 0; t < b.tokens; ++t) {
        if (!b.mask[t]) continue;
        const double* ut = &u[t * kExperts];
        const double mx = *std::max_element(ut, ut + kExperts);
        double s = 0;
        for (int64_t e = 0; e < kExperts; ++e) s += std::exp(ut[e] - mx);
        const double lse = mx + std::log(s);
        loss += alpha_z * lse * lse / n_step;
        for (int64_t e = 0; e < kExperts; ++e) sum_p[e] += std::exp(ut[e] - lse);
      }
    }
    if (n_m == 0) continue;
    double l = 0;
    for (int64_t e = 0; e < kExperts; ++e) l += c[m][e] / (n_m * kTopK) * sum_p[e] / n_m;
    loss += alpha_b / g * kExperts * l;
  }
  return loss;
}

TEST(GlobalLossTest, RouterGradientsSummedOverRanksMatchGlobalFormula) {
  const double alpha_z = 0.05, alpha_b = 0.3;
  std::mt19937 rng(21);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> wr(kDim * kExperts);
  for (double& e : wr) e = static_cast<float>(dist(rng));  // representable in f32
  for (int world : {2, 3}) {
    for (int g : {1, 2, 3}) {
      const auto batches = MakeWorld(world, g, 31 * world + g);
      // Detached global counts from the (double) top-k of every routed token.
      std::vector<std::vector<int64_t>> c(g, std::vector<int64_t>(kExperts, 0));
      for (int m = 0; m < g; ++m)
        for (const auto& rb : batches) {
          const std::vector<double> u = RouterLogits(rb[m], wr);
          for (int64_t t = 0; t < rb[m].tokens; ++t)
            if (rb[m].mask[t])
              for (int32_t e : TopK(&u[t * kExperts])) ++c[m][e];
        }
      std::vector<std::vector<float>> grad(world);
      std::vector<double> display_total(world);
      absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
        const int r = comm.rank();
        std::vector<MicroBatchTokens> mbs;
        for (const Batch& b : batches[r]) mbs.push_back({b.labels, b.sample_ids, b.mask});
        absl::StatusOr<StepStats> stats = ComputeStepStats(comm, mbs);
        if (!stats.ok()) return stats.status();
        StepDisplay display(1, kExperts);
        absl::Status st = display.RegisterTerm("z_loss");
        if (st.ok()) st = display.RegisterTerm("balance");
        if (!st.ok()) return st;
        std::vector<float> gwr(kDim * kExperts, 0.0f);
        for (int m = 0; m < g; ++m) {
          const Batch& b = batches[r][m];
          const std::vector<double> ud = RouterLogits(b, wr);
          std::vector<float> u(ud.begin(), ud.end()), du(u.size(), 0.0f);
          std::vector<int32_t> topk;
          for (int64_t t = 0; t < b.tokens; ++t) {
            for (int32_t e : TopK(&ud[t * kExperts])) topk.push_back(e);
          }
          absl::StatusOr<std::vector<int64_t>> local =
              CountLocalExpertAssignments(topk, kTopK, b.mask, kExperts);
          if (!local.ok()) return local.status();
          absl::StatusOr<ExpertCountReduction> red =
              ExpertCountReduction::Start(comm, *local, kTopK);
          if (!red.ok()) return red.status();
          absl::StatusOr<double> z = RouterZLossForwardBackward(
              F32Matrix(u.data(), b.tokens, kExperts), b.mask, stats->global_routed_tokens, alpha_z,
              F32Matrix(du.data(), b.tokens, kExperts));
          if (!z.ok()) return z.status();
          absl::StatusOr<absl::Span<const int64_t>> cm = red->Wait();
          if (!cm.ok()) return cm.status();
          EXPECT_EQ(std::vector<int64_t>(cm->begin(), cm->end()), c[m]);
          absl::StatusOr<double> bal = LoadBalancingLossForwardBackward(
              F32Matrix(u.data(), b.tokens, kExperts), b.mask, *cm, kTopK, g, alpha_b,
              F32Matrix(du.data(), b.tokens, kExperts));
          if (!bal.ok()) return bal.status();
          if (!(st = display.AddBackwardTerm("z_loss", *z)).ok()) return st;
          if (!(st = display.AddBackwardTerm("balance", *bal)).ok()) return st;
          if (!(st = display.AddGlobalExpertCounts(0, *cm)).ok()) return st;
          for (int64_t t = 0; t < b.tokens; ++t)
            for (int64_t k = 0; k < kDim; ++k)
              for (int64_t e = 0; e < kExperts; ++e)
                gwr[k * kExperts + e] += b.hidden[t * kDim + k] * du[t * kExperts + e];
        }
        st = comm.AllReduce(gwr.data(), gwr.data(), gwr.size(), DType::kF32, ReduceOp::kSum);
        if (!st.ok()) return st;
        grad[r] = gwr;
        absl::StatusOr<StepDisplayValues> v = display.Reduce(comm);
        if (!v.ok()) return v.status();
        display_total[r] = v->total_loss;
        return absl::OkStatus();
      });
      const std::string where = absl::StrCat("W=", world, " G=", g);
      ASSERT_TRUE(s.ok()) << s << " " << where;
      const double ref = ReferenceRouterLoss(batches, wr, c, g, alpha_z, alpha_b);
      for (int r = 0; r < world; ++r) {
        EXPECT_NEAR(display_total[r], ref, 1e-6 * ref) << where;
        EXPECT_EQ(grad[r], grad[0]) << where;
      }
      for (size_t i = 0; i < wr.size(); ++i) {
        std::vector<double> wp = wr, wm = wr;
        wp[i] += 1e-4;
        wm[i] -= 1e-4;
        const double fd = (ReferenceRouterLoss(batches, wp, c, g, alpha_z, alpha_b) -
                           ReferenceRouterLoss(batches, wm, c, g, alpha_z, alpha_b)) /
                          2e-4;
        EXPECT_NEAR(grad[0][i], fd, 1e-6 + 1e-5 * std::abs(fd)) << where << " weight " << i;
      }
    }
  }
}

}  // namespace
}  // namespace gradsum::losses
