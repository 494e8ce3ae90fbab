// Vocab-parallel CE (SEMANTICS.md §3.1) on the in-process thread backend: group sizes 1-4
// with uneven shards against the unsharded CE kernel and the unsharded fused linear CE,
// label smoothing and the z-loss against an fp64 reference written here (and finite
// differences), ignore_index rows, and errors on one rank reaching every rank.
#include "losses/vocab_parallel_ce.h"

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
#include "absl/strings/str_cat.h"
#include "collectives/communicator.h"
#include "collectives/thread_backend.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "losses/cross_entropy.h"
#include "losses/linear_cross_entropy.h"
#include "losses/test_util.h"
#include "testing/run_ranks.h"
#include "testing/status_testing.h"

namespace gradsum::losses {
namespace {

using ::gradsum::testing::RunRanks;
using ::gradsum::testing::RunRanksPerRank;
using ::testing::HasSubstr;

constexpr int64_t kIgnore = -100;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A short timeout, so a test that hangs fails in seconds rather than the test's limit.
ThreadBackendOptions Quick() { return {.timeout = absl::Seconds(10)}; }

// Uneven shard boundaries of [0, v) for a group of p: p + 1 increasing cut points.
std::vector<int64_t> Bounds(int p, int64_t v) {
  switch (p) {
    case 1:
      return {0, v};
    case 2:
      return {0, v * 383 / 1000, v};
    case 3:
      return {0, v * 150 / 1000, v * 601 / 1000, v};
    default: {
      std::vector<int64_t> b = {0, v * 97 / 1000, v / 2, v / 2 + 12, v};
      return b;
    }
  }
}

struct Problem {
  int64_t n = 0, v = 0;
  std::vector<float> z;  // [n, v]
  std::vector<int64_t> labels;
  std::vector<float> weights;  // empty: token mode
  double d = 0.0;
};

Problem MakeProblem(int64_t n, int64_t v, uint32_t seed, bool weighted) {
  Problem p;
  p.n = n;
  p.v = v;
  p.z = RandomNormal(static_cast<size_t>(n * v), seed, 2.0f);
  std::mt19937 rng(seed + 7);
  std::uniform_int_distribution<int64_t> cls(0, v - 1);
  std::uniform_real_distribution<float> wd(0.2f, 1.5f);
  double local = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    const bool ignored = t % 5 == 3;
    p.labels.push_back(ignored ? kIgnore : cls(rng));
    if (weighted) p.weights.push_back(wd(rng));
    if (!ignored) local += weighted ? p.weights.back() : 1.0;
  }
  p.d = local * 1.5;  // other ranks and micro-batches of the step hold the rest
  return p;
}

// Columns [c0, c1) of the [n, v] matrix.
std::vector<float> Columns(const std::vector<float>& m, int64_t n, int64_t v, int64_t c0,
                           int64_t c1) {
  std::vector<float> out;
  for (int64_t t = 0; t < n; ++t) {
    out.insert(out.end(), m.begin() + t * v + c0, m.begin() + t * v + c1);
  }
  return out;
}

struct Sharded {
  std::vector<VocabParallelCrossEntropyResult> results;  // per rank
  std::vector<float> grad;                               // [n, v], assembled from the shards
};

// Runs the plain variant on `p` over a group of `world` ranks with shards `bounds`.
absl::StatusOr<Sharded> RunSharded(const Problem& p, int world, const std::vector<int64_t>& bounds,
                                   const VocabParallelCrossEntropyOptions& options,
                                   bool in_place = false, bool forward_only = false) {
  Sharded out;
  out.results.resize(world);
  out.grad.assign(p.z.size(), std::nanf(""));
  std::mutex mu;
  absl::Status s = RunRanks(
      world,
      [&](Communicator& comm) -> absl::Status {
        const int r = comm.rank();
        const int64_t c0 = bounds[r], c1 = bounds[r + 1], vr = c1 - c0;
        std::vector<float> shard = Columns(p.z, p.n, p.v, c0, c1);
        std::vector<float> grad(shard.size(), std::nanf(""));
        TensorView z = F32Matrix(shard.data(), p.n, vr);
        TensorView g = in_place ? z : F32Matrix(grad.data(), p.n, vr);
        absl::StatusOr<VocabParallelCrossEntropyResult> res =
            forward_only
                ? VocabParallelCrossEntropyForward(comm, z, p.labels, c0, p.v, p.weights, p.d,
                                                   options)
                : VocabParallelCrossEntropy(comm, z, p.labels, c0, p.v, p.weights, p.d, g, options);
        if (!res.ok()) return res.status();
        std::lock_guard<std::mutex> lock(mu);
        out.results[r] = *res;
        const std::vector<float>& written = in_place ? shard : grad;
        for (int64_t t = 0; t < p.n; ++t) {
          for (int64_t j = 0; j < vr; ++j) out.grad[t * p.v + c0 + j] = written[t * vr + j];
        }
        return absl::OkStatus();
      },
      Quick());
  if (!s.ok()) return s;
  return out;
}

// The fp64 reference of §3.1 for one problem: loss and gradient over the whole vocabulary.
struct Reference {
  double loss = 0.0;
  std::vector<double> grad;
};

Reference Fp64Reference(const Problem& p, double eps, double alpha) {
  Reference ref;
  ref.grad.assign(p.z.size(), 0.0);
  for (int64_t t = 0; t < p.n; ++t) {
    const int64_t y = p.labels[t];
    if (y == kIgnore) continue;
    const double w = p.weights.empty() ? 1.0 : p.weights[t];
    const float* z = p.z.data() + t * p.v;
    double m = -INFINITY;
    for (int64_t j = 0; j < p.v; ++j) m = std::max(m, double{z[j]});
    double s = 0.0, u = 0.0;
    for (int64_t j = 0; j < p.v; ++j) {
      s += std::exp(z[j] - m);
      u += z[j];
    }
    const double lse = m + std::log(s);
    const double ce = lse - (1.0 - eps) * z[y] - eps * u / static_cast<double>(p.v);
    ref.loss += w * (ce + alpha * lse * lse) / p.d;
    for (int64_t j = 0; j < p.v; ++j) {
      const double pj = std::exp(z[j] - lse);
      ref.grad[t * p.v + j] = w / p.d *
                              ((1.0 + 2.0 * alpha * lse) * pj - (1.0 - eps) * (j == y) -
                               eps / static_cast<double>(p.v));
    }
  }
  return ref;
}

template <typename A, typename B>
double MaxAbsDiff(const std::vector<A>& a, const std::vector<B>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  return worst;
}

class GroupSizeTest : public ::testing::TestWithParam<int> {};

// The sharded loss and gradient equal the unsharded CE kernel's (token and weighted
// modes, ignore_index rows) to 1e-6, on every rank, at every group size.
TEST_P(GroupSizeTest, MatchesUnshardedKernel) {
  const int world = GetParam();
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(absl::StrCat("weighted ", weighted));
    Problem p = MakeProblem(/*n=*/23, /*v=*/1000, /*seed=*/11 + world, weighted);
    std::vector<float> ref_grad(p.z.size());
    std::vector<float> z = p.z;
    absl::StatusOr<CrossEntropyResult> ref =
        CrossEntropyForwardBackward(F32Matrix(z.data(), p.n, p.v), p.labels, p.weights, p.d,
                                    F32Matrix(ref_grad.data(), p.n, p.v));
    GRADSUM_ASSERT_OK(ref.status());
    absl::StatusOr<Sharded> got = RunSharded(p, world, Bounds(world, p.v), {});
    GRADSUM_ASSERT_OK(got.status());
    for (int r = 0; r < world; ++r) {
      const VocabParallelCrossEntropyResult& res = got->results[r];
      EXPECT_NEAR(res.local_loss, ref->local_loss, 1e-6 * std::max(1.0, ref->local_loss));
      EXPECT_NEAR(res.local_weight_sum, ref->local_weight_sum, 1e-9);
      EXPECT_EQ(res.local_valid_tokens, ref->local_valid_tokens);
      EXPECT_EQ(res.local_z_loss, 0.0);
      EXPECT_EQ(res.collectives, 2);  // 23 rows of a <= 617-column shard: one exchange
      // Every rank computed every token's term: the same value on every rank, exactly.
      EXPECT_EQ(res.local_loss, got->results[0].local_loss);
    }
    EXPECT_LE(MaxAbsDiff(got->grad, ref_grad), 1e-6);
    for (int64_t t = 0; t < p.n; ++t) {
      if (p.labels[t] != kIgnore) continue;
      for (int64_t j = 0; j < p.v; ++j) ASSERT_EQ(got->grad[t * p.v + j], 0.0f) << t;
    }
  }
}

// Label smoothing and the output z-loss against the fp64 reference (whole-vocabulary mean
// of log p, not the shard's), with the forward-only variant giving the same loss.
TEST_P(GroupSizeTest, LabelSmoothingAndZLossMatchFp64Reference) {
  const int world = GetParam();
  Problem p = MakeProblem(/*n=*/17, /*v=*/1000, /*seed=*/31 + world, /*weighted=*/true);
  VocabParallelCrossEntropyOptions options;
  options.label_smoothing = 0.1;
  options.alpha_lse = 0.01;
  const Reference ref = Fp64Reference(p, 0.1, 0.01);
  absl::StatusOr<Sharded> got = RunSharded(p, world, Bounds(world, p.v), options);
  GRADSUM_ASSERT_OK(got.status());
  absl::StatusOr<Sharded> fwd =
      RunSharded(p, world, Bounds(world, p.v), options, false, /*forward_only=*/true);
  GRADSUM_ASSERT_OK(fwd.status());
  for (int r = 0; r < world; ++r) {
    EXPECT_NEAR(got->results[r].local_loss, ref.loss, 1e-6 * std::abs(ref.loss));
    EXPECT_NEAR(got->results[r].local_ce_loss + got->results[r].local_z_loss,
                got->results[r].local_loss, 1e-12);
    EXPECT_GT(got->results[r].local_z_loss, 0.0);
    EXPECT_EQ(fwd->results[r].local_loss, got->results[r].local_loss);
  }
  EXPECT_LE(MaxAbsDiff(got->grad, ref.grad), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Groups, GroupSizeTest, ::testing::Values(1, 2, 3, 4));

// Central differences of the forward-only loss at a few elements (targets and others, in
// different shards) agree with the gradient, with both options on.
TEST(VocabParallelCeTest, FiniteDifferences) {
  Problem p = MakeProblem(/*n=*/4, /*v=*/50, /*seed=*/5, /*weighted=*/true);
  VocabParallelCrossEntropyOptions options;
  options.label_smoothing = 0.2;
  options.alpha_lse = 0.05;
  const std::vector<int64_t> bounds = {0, 7, 31, 50};
  absl::StatusOr<Sharded> got = RunSharded(p, 3, bounds, options);
  GRADSUM_ASSERT_OK(got.status());
  std::vector<std::pair<int64_t, int64_t>> at = {{0, 3}, {1, 20}, {2, 45}, {0, 40}};
  for (int64_t t : {0, 1, 2}) at.push_back({t, p.labels[t]});  // the targets
  const float h = 1e-2f;
  for (const auto& [t, j] : at) {
    ASSERT_NE(p.labels[t], kIgnore);
    double loss[2];
    for (int side = 0; side < 2; ++side) {
      Problem q = p;
      q.z[t * p.v + j] += side == 0 ? h : -h;
      absl::StatusOr<Sharded> f = RunSharded(q, 3, bounds, options, false, true);
      GRADSUM_ASSERT_OK(f.status());
      loss[side] = f->results[0].local_loss;
    }
    const double fd = (loss[0] - loss[1]) / (2.0 * h);
    EXPECT_NEAR(got->grad[t * p.v + j], fd, 2e-4 + 1e-3 * std::abs(fd))
        << "row " << t << " column " << j;
  }
}

// The fused linear variant: each rank's head slice and its part of dhidden, against the
// unsharded fused linear CE on the whole head; the parts summed over the group (what the
// tensor-parallel layer's all-reduce does) give dhidden.
TEST(VocabParallelCeTest, LinearMatchesUnshardedLinearCe) {
  for (int world : {1, 2, 3, 4}) {
    SCOPED_TRACE(absl::StrCat("world ", world));
    const int64_t n = 37, h = 16, v = 1000;
    Problem p = MakeProblem(n, v, /*seed=*/41, /*weighted=*/true);
    std::vector<float> hidden = RandomNormal(static_cast<size_t>(n * h), 42, 1.0f);
    std::vector<float> head = RandomNormal(static_cast<size_t>(v * h), 43, 0.3f);  // [V, H]
    std::vector<float> ref_gh(n * h), ref_gw(v * h, 0.0f);
    LinearCrossEntropyOptions lo;
    lo.head_transposed = true;
    lo.chunk_rows = 8;
    absl::StatusOr<LinearCrossEntropyResult> ref = LinearCrossEntropyForwardBackward(
        F32Matrix(hidden.data(), n, h), F32Matrix(head.data(), v, h), p.labels, p.weights, p.d,
        F32Matrix(ref_gh.data(), n, h), F32Matrix(ref_gw.data(), v, h), lo);
    GRADSUM_ASSERT_OK(ref.status());

    const std::vector<int64_t> bounds = Bounds(world, v);
    std::vector<double> gh_sum(n * h, 0.0);
    std::vector<float> gw(v * h, std::nanf(""));
    std::vector<VocabParallelLinearCrossEntropyResult> results(world);
    std::mutex mu;
    GRADSUM_ASSERT_OK(RunRanks(
        world,
        [&](Communicator& comm) -> absl::Status {
          const int r = comm.rank();
          const int64_t c0 = bounds[r], vr = bounds[r + 1] - c0;
          std::vector<float> hid = hidden;
          std::vector<float> wr(head.begin() + c0 * h, head.begin() + (c0 + vr) * h);
          std::vector<float> gh(n * h), gwr(vr * h, 0.0f);
          VocabParallelLinearCrossEntropyOptions o;
          o.chunk_rows = 8;
          absl::StatusOr<VocabParallelLinearCrossEntropyResult> res =
              VocabParallelLinearCrossEntropy(
                  comm, F32Matrix(hid.data(), n, h), F32Matrix(wr.data(), vr, h), p.labels, c0, v,
                  p.weights, p.d, F32Matrix(gh.data(), n, h), F32Matrix(gwr.data(), vr, h), o);
          if (!res.ok()) return res.status();
          std::lock_guard<std::mutex> lock(mu);
          results[r] = *res;
          for (int64_t i = 0; i < n * h; ++i) gh_sum[i] += gh[i];
          std::copy(gwr.begin(), gwr.end(), gw.begin() + c0 * h);
          return absl::OkStatus();
        },
        Quick()));
    for (int r = 0; r < world; ++r) {
      EXPECT_NEAR(results[r].ce.local_loss, ref->ce.local_loss, 1e-6 * ref->ce.local_loss);
      EXPECT_EQ(results[r].ce.local_valid_tokens, ref->ce.local_valid_tokens);
      EXPECT_EQ(results[r].chunk_rows, 8);
      EXPECT_EQ(results[r].ce.collectives, 2 * 5);  // 37 rows in chunks of 8
    }
    EXPECT_LE(MaxAbsDiff(gw, ref_gw), 1e-6);
    EXPECT_LE(MaxAbsDiff(gh_sum, ref_gh), 1e-6);
  }
}

// Exchanges of any size, in place, give the same bits; the collective count is 2 per
// exchange; an empty shard and a shard with no mass in a row are fine.
TEST(VocabParallelCeTest, ExchangesInPlaceAndEmptyShards) {
  Problem p = MakeProblem(/*n=*/10, /*v=*/300, /*seed=*/9, /*weighted=*/false);
  for (int64_t j = 0; j < 120; ++j) p.z[2 * p.v + j] = kNegInf;  // row 2: none in shard 0
  const std::vector<int64_t> bounds = {0, 120, 120, 300};        // rank 1's shard is empty
  p.labels[2] = 200;
  VocabParallelCrossEntropyOptions one_exchange;
  one_exchange.rows_per_exchange = 10;
  absl::StatusOr<Sharded> base = RunSharded(p, 3, bounds, one_exchange);
  GRADSUM_ASSERT_OK(base.status());
  EXPECT_EQ(base->results[0].collectives, 2);
  for (int64_t rows : {1, 3, 0}) {
    VocabParallelCrossEntropyOptions o;
    o.rows_per_exchange = rows;
    for (bool in_place : {false, true}) {
      absl::StatusOr<Sharded> got = RunSharded(p, 3, bounds, o, in_place);
      GRADSUM_ASSERT_OK(got.status());
      EXPECT_EQ(got->results[1].local_loss, base->results[1].local_loss);
      EXPECT_EQ(got->grad, base->grad);
      const int64_t per = rows == 0 ? 10 : rows;  // auto: 2 MiB of a 100-column shard
      EXPECT_EQ(got->results[2].collectives, 2 * ((10 + per - 1) / per));
    }
  }
  std::vector<float> ref_grad(p.z.size());
  std::vector<float> z = p.z;
  absl::StatusOr<CrossEntropyResult> ref = CrossEntropyForwardBackward(
      F32Matrix(z.data(), p.n, p.v), p.labels, {}, p.d, F32Matrix(ref_grad.data(), p.n, p.v));
  GRADSUM_ASSERT_OK(ref.status());
  EXPECT_NEAR(base->results[0].local_loss, ref->local_loss, 1e-6 * ref->local_loss);
  EXPECT_LE(MaxAbsDiff(base->grad, ref_grad), 1e-6);
}

TEST(VocabParallelCeTest, ZeroDGivesZeroLossAndGradient) {
  Problem p = MakeProblem(/*n=*/6, /*v=*/100, /*seed=*/3, /*weighted=*/false);
  for (int64_t& y : p.labels) y = kIgnore;
  p.d = 0.0;
  absl::StatusOr<Sharded> got = RunSharded(p, 2, {0, 40, 100}, {});
  GRADSUM_ASSERT_OK(got.status());
  EXPECT_EQ(got->results[0].local_loss, 0.0);
  for (float g : got->grad) ASSERT_EQ(g, 0.0f);
}

TEST(VocabParallelCeTest, NoRowsStillExchangesOnce) {
  Problem p;
  p.v = 64;
  absl::StatusOr<Sharded> got = RunSharded(p, 2, {0, 20, 64}, {});
  GRADSUM_ASSERT_OK(got.status());
  EXPECT_EQ(got->results[1].local_loss, 0.0);
  EXPECT_EQ(got->results[1].collectives, 2);  // so a rank with rows never waits alone
}

// ---- Errors: every rank returns one, nobody waits for the timeout. ----

// Runs `fn(comm, problem shard views...)` per rank and returns every rank's status.
struct ErrorCase {
  Problem p;
  std::vector<int64_t> bounds;
  VocabParallelCrossEntropyOptions options;
};

std::vector<absl::Status> RunPerRank(
    int world, const std::function<absl::Status(Communicator&, ErrorCase&)>& change,
    ErrorCase base) {
  absl::StatusOr<std::vector<absl::Status>> out = RunRanksPerRank(
      world,
      [&](Communicator& comm) -> absl::Status {
        ErrorCase e = base;
        absl::Status s = change(comm, e);  // the rank's deviation from the good call
        if (!s.ok()) return s;
        const int r = comm.rank();
        const int64_t c0 = e.bounds[r], vr = e.bounds[r + 1] - c0;
        std::vector<float> shard = Columns(e.p.z, e.p.n, e.p.v, c0, e.bounds[r + 1]);
        std::vector<float> grad(shard.size());
        const int64_t rows = static_cast<int64_t>(e.p.labels.size());
        return VocabParallelCrossEntropy(comm, F32Matrix(shard.data(), rows, vr), e.p.labels, c0,
                                         e.p.v, e.p.weights, e.p.d,
                                         F32Matrix(grad.data(), rows, vr), e.options)
            .status();
      },
      Quick());
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : std::vector<absl::Status>(world, absl::UnknownError("no run"));
}

ErrorCase GoodCase() {
  ErrorCase e;
  e.p = MakeProblem(/*n=*/5, /*v=*/90, /*seed=*/21, /*weighted=*/true);
  e.bounds = {0, 30, 50, 90};
  return e;
}

void ExpectAll(const std::vector<absl::Status>& statuses, absl::StatusCode code,
               const std::string& text) {
  ASSERT_EQ(statuses.size(), 3u);
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_EQ(statuses[r].code(), code) << "rank " << r << ": " << statuses[r];
    EXPECT_THAT(std::string(statuses[r].message()), HasSubstr(text)) << "rank " << r;
  }
}

TEST(VocabParallelCeErrors, GoodCaseRuns) {
  for (const absl::Status& s : RunPerRank(
           3, [](Communicator&, ErrorCase&) { return absl::OkStatus(); }, GoodCase())) {
    GRADSUM_EXPECT_OK(s);
  }
}

TEST(VocabParallelCeErrors, BadLabelOnOneRank) {
  ExpectAll(RunPerRank(
                3,
                [](Communicator& c, ErrorCase& e) {
                  if (c.rank() == 1) e.p.labels[2] = 5000;
                  return absl::OkStatus();
                },
                GoodCase()),
            absl::StatusCode::kInvalidArgument, "label 5000 at row 2 is outside [0, 90)");
}

TEST(VocabParallelCeErrors, BadOptionOnOneRank) {
  ExpectAll(RunPerRank(
                3,
                [](Communicator& c, ErrorCase& e) {
                  if (c.rank() == 2) e.options.label_smoothing = 1.5;
                  return absl::OkStatus();
                },
                GoodCase()),
            absl::StatusCode::kInvalidArgument, "label_smoothing 1.5 must be in [0, 1)");
}

TEST(VocabParallelCeErrors, BadShapeOnOneRank) {
  // Rank 2 says V = 80: its shard [50, 90) reaches past it.
  ExpectAll(RunPerRank(
                3,
                [](Communicator& c, ErrorCase& e) {
                  if (c.rank() == 2) e.p.v = 80;
                  return absl::OkStatus();
                },
                GoodCase()),
            absl::StatusCode::kInvalidArgument, "the shard [50, 90)");
}

TEST(VocabParallelCeErrors, NaNInOneShard) {
  ExpectAll(RunPerRank(
                3,
                [](Communicator& c, ErrorCase& e) {
                  if (c.rank() == 1) e.p.z[2 * e.p.v + 40] = std::nanf("");
                  return absl::OkStatus();
                },
                GoodCase()),
            absl::StatusCode::kInvalidArgument, "contains NaN in the shard [30, 50) of rank 1");
}

TEST(VocabParallelCeErrors, LocalDIsFailedPreconditionEverywhere) {
  ErrorCase e = GoodCase();
  e.p.d = 0.5;
  ExpectAll(RunPerRank(
                3, [](Communicator&, ErrorCase&) { return absl::OkStatus(); }, e),
            absl::StatusCode::kFailedPrecondition, "D must be summed over all ranks");
}

TEST(VocabParallelCeErrors, DisagreeOnD) {
  ExpectAll(RunPerRank(
                3,
                [](Communicator& c, ErrorCase& e) {
                  if (c.rank() == 1) e.p.d += 1.0;
                  return absl::OkStatus();
                },
                GoodCase()),
            absl::StatusCode::kInvalidArgument,
            "the ranks of the group disagree on the global weight sum D");
}

TEST(VocabParallelCeErrors, DisagreeOnLabels) {
  ExpectAll(RunPerRank(
                3,
                [](Communicator& c, ErrorCase& e) {
                  if (c.rank() == 0) e.p.labels[0] = (e.p.labels[0] + 1) % e.p.v;
                  return absl::OkStatus();
                },
                GoodCase()),
            absl::StatusCode::kInvalidArgument, "disagree on the labels and weights");
}

TEST(VocabParallelCeErrors, DisagreeOnAlpha) {
  ExpectAll(RunPerRank(
                3,
                [](Communicator& c, ErrorCase& e) {
                  if (c.rank() == 2) e.options.alpha_lse = 0.5;
                  return absl::OkStatus();
                },
                GoodCase()),
            absl::StatusCode::kInvalidArgument, "disagree on alpha_lse (min 0, max 0.5)");
}

TEST(VocabParallelCeErrors, ShardsDoNotPartition) {
  // A gap: rank 1 passes vocab_start 35 for its [30, 50) columns' worth.
  absl::StatusOr<std::vector<absl::Status>> out = RunRanksPerRank(
      3,
      [](Communicator& comm) -> absl::Status {
        ErrorCase e = GoodCase();
        const int r = comm.rank();
        const int64_t c0 = e.bounds[r] + (r == 1 ? 5 : 0), vr = e.bounds[r + 1] - e.bounds[r];
        std::vector<float> shard(e.p.n * vr, 0.0f), grad(shard.size());
        e.p.labels.assign(e.p.n, 0);
        e.p.d = 100.0;
        return VocabParallelCrossEntropy(comm, F32Matrix(shard.data(), e.p.n, vr), e.p.labels, c0,
                                         e.p.v, e.p.weights, e.p.d,
                                         F32Matrix(grad.data(), e.p.n, vr))
            .status();
      },
      Quick());
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectAll(*out, absl::StatusCode::kInvalidArgument,
            "the shards do not partition [0, 90): rank 1 starts at 35 where the shard before "
            "ends (30)");
}

TEST(VocabParallelCeErrors, AllNegInfRowAndNegInfTarget) {
  ExpectAll(RunPerRank(
                3,
                [](Communicator&, ErrorCase& e) {
                  for (int64_t j = 0; j < e.p.v; ++j) e.p.z[1 * e.p.v + j] = kNegInf;
                  return absl::OkStatus();
                },
                GoodCase()),
            absl::StatusCode::kInvalidArgument, "is all -inf over the whole vocabulary");
  ExpectAll(RunPerRank(
                3,
                [](Communicator&, ErrorCase& e) {
                  e.p.z[0 * e.p.v + e.p.labels[0]] = kNegInf;
                  return absl::OkStatus();
                },
                GoodCase()),
            absl::StatusCode::kInvalidArgument, "logits row 0");
}

TEST(VocabParallelCeErrors, DifferentRowCountsFailInTheExchange) {
  ExpectAll(RunPerRank(
                3,
                [](Communicator& c, ErrorCase& e) {
                  if (c.rank() == 1) {
                    e.p.labels.push_back(1);
                    if (!e.p.weights.empty()) e.p.weights.push_back(1.0f);
                    e.p.z.resize(e.p.z.size() + e.p.v, 0.0f);
                    e.p.n += 1;
                  }
                  return absl::OkStatus();
                },
                GoodCase()),
            absl::StatusCode::kInvalidArgument, "the MAX all-reduce of the row maxes");
}

TEST(VocabParallelCeErrors, LinearBadHeadShapeOnOneRank) {
  const int64_t n = 6, h = 4, v = 40;
  const std::vector<int64_t> bounds = {0, 15, 40};
  Problem p = MakeProblem(n, v, /*seed=*/2, /*weighted=*/false);
  absl::StatusOr<std::vector<absl::Status>> out = RunRanksPerRank(
      2,
      [&](Communicator& comm) -> absl::Status {
        const int r = comm.rank();
        const int64_t vr = bounds[r + 1] - bounds[r];
        const int64_t head_cols = r == 1 ? h + 1 : h;  // rank 1's head slice is [25, 5]
        std::vector<float> hidden(n * h, 0.5f), head(vr * head_cols, 0.1f);
        std::vector<float> gh(n * h), gw(vr * head_cols, 0.0f);
        return VocabParallelLinearCrossEntropy(comm, F32Matrix(hidden.data(), n, h),
                                               F32Matrix(head.data(), vr, head_cols), p.labels,
                                               bounds[r], v, {}, p.d, F32Matrix(gh.data(), n, h),
                                               F32Matrix(gw.data(), vr, head_cols))
            .status();
      },
      Quick());
  ASSERT_TRUE(out.ok()) << out.status();
  for (const absl::Status& s : *out) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("head_shard is")) << s;
  }
}

}  // namespace
}  // namespace gradsum::losses
