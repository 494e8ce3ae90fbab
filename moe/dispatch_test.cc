// Dispatch/combine over EP groups of the thread backend against the double-precision
// single-process reference (moe/reference.h), with expert gradients SUM-reduced over the
// EDP group as SEMANTICS.md §7 prescribes.
#include "moe/dispatch.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/reference.h"
#include "moe/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum::moe {
namespace {

using ::testing::HasSubstr;

// A global problem: every world rank's tokens, routing and output gradient, and all E experts.
struct Problem {
  int D = 6, H = 5, E = 4, K = 2;
  int world = 1, ep_size = 1;
  std::vector<std::vector<double>> a, cw, dy;  // per world rank: [T, D], [T, K], [T, D]
  std::vector<std::vector<int32_t>> idx;       // per world rank: [T, K], -1 = not routed
  std::vector<double> wg, wu, wd;              // [E, D, H], [E, D, H], [E, H, D]

  int tokens(int r) const { return static_cast<int>(a[r].size()) / D; }
  int local_experts() const { return E / ep_size; }
  reference::LayerConfig ref_config() const {
    reference::LayerConfig c;
    c.d_model = D;
    c.hidden = H;
    c.num_experts = E;
    c.top_k = K;
    return c;
  }
  DispatchConfig config() const {
    return DispatchConfig{.d_model = D, .hidden = H, .num_experts = E, .top_k = K};
  }
  // The stacked weights of EP slot p's experts, in fp32.
  std::vector<float> Slice(const std::vector<double>& w, int p) const {
    const size_t per = static_cast<size_t>(D) * H * local_experts();
    return std::vector<float>(w.begin() + p * per, w.begin() + (p + 1) * per);
  }
  // Reference output of world rank r.
  std::vector<double> ReferenceOutput(int r) const {
    std::vector<double> y(a[r].size(), 0.0);
    for (int t = 0; t < tokens(r); ++t) {
      for (int k = 0; k < K; ++k) {
        const int e = idx[r][t * K + k];
        if (e < 0) continue;
        reference::AddExpert(ref_config(), e, &a[r][t * D], wg, wu, wd, cw[r][t * K + k],
                             &y[t * D]);
      }
    }
    return y;
  }
  // L = sum over ranks and tokens of <dy_t, y_t>.
  double ReferenceLoss() const {
    double loss = 0.0;
    for (int r = 0; r < world; ++r) {
      const std::vector<double> y = ReferenceOutput(r);
      for (size_t i = 0; i < y.size(); ++i) loss += dy[r][i] * y[i];
    }
    return loss;
  }
};

// Random distinct experts per token; tokens listed in `padding` get -1 in every slot.
Problem MakeProblem(int world, int ep_size, int E, int K, const std::vector<int>& tokens_per_rank,
                    uint32_t seed) {
  Problem p;
  p.world = world;
  p.ep_size = ep_size;
  p.E = E;
  p.K = K;
  std::mt19937 gen(seed);
  for (int r = 0; r < world; ++r) {
    const int T = tokens_per_rank[r];
    p.a.push_back(test::RandomFp32Values(T * p.D, 1.0, seed + 10 * r + 1));
    p.dy.push_back(test::RandomFp32Values(T * p.D, 1.0, seed + 10 * r + 2));
    p.cw.push_back(test::RandomFp32Values(T * K, 1.0, seed + 10 * r + 3));
    std::vector<int32_t> idx(T * K);
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> experts(E);
      for (int e = 0; e < E; ++e) experts[e] = e;
      std::shuffle(experts.begin(), experts.end(), gen);
      const bool padding = (t % 5 == 4);
      for (int k = 0; k < K; ++k) idx[t * K + k] = padding ? -1 : experts[k];
    }
    p.idx.push_back(idx);
  }
  p.wg = test::RandomFp32Values(E * p.D * p.H, 0.6, seed + 101);
  p.wu = test::RandomFp32Values(E * p.D * p.H, 0.6, seed + 102);
  p.wd = test::RandomFp32Values(E * p.H * p.D, 0.6, seed + 103);
  return p;
}

// What every world rank computed.
struct RankResult {
  std::vector<float> y, d_a, d_cw;
  std::vector<float> dwg, dwu, dwd;  // this rank's experts, after the SUM over its EDP group
};

// Runs forward + backward on every rank; EP groups are the contiguous blocks of ep_size ranks
// (SEMANTICS.md §1), EDP groups the ranks with the same EP slot.
absl::StatusOr<std::vector<RankResult>> RunDispatch(const Problem& p) {
  std::vector<RankResult> results(p.world);
  absl::Status status = testing::RunRanks(p.world, [&](Communicator& world) -> absl::Status {
    const int r = world.rank();
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> ep,
                             world.Split(r / p.ep_size, r % p.ep_size));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> edp,
                             world.Split(r % p.ep_size, r / p.ep_size));
    const int slot = ep->rank();
    const std::vector<float> wg = p.Slice(p.wg, slot), wu = p.Slice(p.wu, slot),
                             wd = p.Slice(p.wd, slot);
    const std::vector<float> a = test::ToFloat(p.a[r]), cw = test::ToFloat(p.cw[r]), dy = test::ToFloat(p.dy[r]);
    RankResult& out = results[r];
    out.y.assign(a.size(), 0.0f);
    DispatchState state;
    GRADSUM_RETURN_IF_ERROR(DispatchCombineForward(*ep, p.config(), {wg, wu, wd}, a, p.idx[r], cw,
                                                   absl::MakeSpan(out.y), &state));
    out.d_a.assign(a.size(), 0.0f);
    out.d_cw.assign(cw.size(), 0.0f);
    out.dwg.assign(wg.size(), 0.0f);
    out.dwu.assign(wu.size(), 0.0f);
    out.dwd.assign(wd.size(), 0.0f);
    GRADSUM_RETURN_IF_ERROR(DispatchCombineBackward(
        *ep, p.config(), {wg, wu, wd}, state, dy, absl::MakeSpan(out.d_a),
        absl::MakeSpan(out.d_cw),
        {absl::MakeSpan(out.dwg), absl::MakeSpan(out.dwu), absl::MakeSpan(out.dwd)}));
    for (std::vector<float>* g : {&out.dwg, &out.dwu, &out.dwd}) {
      GRADSUM_RETURN_IF_ERROR(
          edp->AllReduce(g->data(), g->data(), g->size(), DType::kF32, ReduceOp::kSum));
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return results;
}

void ExpectMatchesReference(Problem p) {
  absl::StatusOr<std::vector<RankResult>> results = RunDispatch(p);
  ASSERT_TRUE(results.ok()) << results.status();
  auto loss = [&p] { return p.ReferenceLoss(); };
  const double h = 1e-6;
  for (int r = 0; r < p.world; ++r) {
    const RankResult& got = (*results)[r];
    const std::vector<double> y = p.ReferenceOutput(r);
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_NEAR(got.y[i], y[i], 1e-5) << "rank " << r << " y[" << i << "]";
    }
    for (size_t i = 0; i < p.a[r].size(); ++i) {
      const double fd = reference::CentralDifference(loss, &p.a[r][i], h);
      ASSERT_NEAR(got.d_a[i], fd, 2e-4 * (1 + std::abs(fd))) << "rank " << r << " d_a[" << i << "]";
    }
    for (size_t i = 0; i < p.cw[r].size(); ++i) {
      const double fd = reference::CentralDifference(loss, &p.cw[r][i], h);
      ASSERT_NEAR(got.d_cw[i], fd, 2e-4 * (1 + std::abs(fd)))
          << "rank " << r << " d_cw[" << i << "]";
    }
  }
  // Expert e's SUM-reduced gradient, read on every rank of its EP slot (all must agree).
  const size_t per_expert = static_cast<size_t>(p.D) * p.H;
  struct Param {
    std::vector<double>* w;
    std::vector<float> RankResult::*g;
    const char* name;
  };
  for (Param param : {Param{&p.wg, &RankResult::dwg, "dWg"}, Param{&p.wu, &RankResult::dwu, "dWu"},
                      Param{&p.wd, &RankResult::dwd, "dWd"}}) {
    for (size_t i = 0; i < param.w->size(); ++i) {
      const int e = static_cast<int>(i / per_expert);
      const int slot = e / p.local_experts();
      const size_t local = i - static_cast<size_t>(slot) * p.local_experts() * per_expert;
      const double fd = reference::CentralDifference(loss, &(*param.w)[i], h);
      for (int r = slot; r < p.world; r += p.ep_size) {
        ASSERT_NEAR(((*results)[r].*param.g)[local], fd, 2e-4 * (1 + std::abs(fd)))
            << param.name << " expert " << e << " element " << i % per_expert << " on rank " << r;
      }
    }
  }
}

// (world, ep_size, E, K)
class DispatchParityTest : public ::testing::TestWithParam<std::tuple<int, int, int, int>> {};

TEST_P(DispatchParityTest, MatchesSingleProcessReference) {
  const auto [world, ep_size, E, K] = GetParam();
  // Uneven token counts, one rank with none (when world > 1).
  std::vector<int> tokens = {7, 0, 9, 4, 6, 5, 3, 8};
  tokens.resize(world);
  if (world == 1) tokens[0] = 11;
  ExpectMatchesReference(MakeProblem(world, ep_size, E, K, tokens, 1000 + 7 * world + ep_size));
}

INSTANTIATE_TEST_SUITE_P(
    EpSizes, DispatchParityTest,
    ::testing::Values(std::make_tuple(1, 1, 4, 2),   // EP = 1
                      std::make_tuple(2, 2, 4, 2),   // EP = 2
                      std::make_tuple(4, 4, 4, 2),   // EP = 4, one expert per rank
                      std::make_tuple(4, 4, 8, 2),   // EP = 4, two experts per rank
                      std::make_tuple(4, 2, 4, 2),   // F = 2 x EP = 2: EDP sum over 2 ranks
                      std::make_tuple(2, 1, 4, 3),   // F = 2 x EP = 1
                      std::make_tuple(4, 4, 8, 1),   // K = 1
                      std::make_tuple(4, 4, 4, 4),   // K = E
                      std::make_tuple(2, 2, 2, 2)),  // K = E, one expert per rank
    [](const ::testing::TestParamInfo<std::tuple<int, int, int, int>>& info) {
      return absl::StrCat("W", std::get<0>(info.param), "_EP", std::get<1>(info.param), "_E",
                          std::get<2>(info.param), "_K", std::get<3>(info.param));
    });

TEST(DispatchTest, AllTokensToOneExpertLeavesOtherRanksEmpty) {
  // K = 1, every token of every rank goes to expert E-1 (owned by the last EP rank): the
  // other ranks' experts receive zero rows and the last rank receives everything.
  Problem p = MakeProblem(4, 4, 8, 1, {6, 5, 0, 7}, 77);
  for (auto& idx : p.idx) {
    for (int32_t& e : idx) e = 7;
  }
  ExpectMatchesReference(p);
}

TEST(DispatchTest, AllCopiesToTheFirstRanksExperts) {
  // K = 2 with every token on experts {1, 0}: both live on EP rank 0.
  Problem p = MakeProblem(2, 2, 4, 2, {5, 6}, 78);
  for (auto& idx : p.idx) {
    for (size_t c = 0; c < idx.size(); ++c) idx[c] = (c % 2 == 0) ? 1 : 0;
  }
  ExpectMatchesReference(p);
}

TEST(DispatchTest, NoTokensAnywhere) {
  Problem p = MakeProblem(2, 2, 4, 2, {0, 0}, 79);
  absl::StatusOr<std::vector<RankResult>> results = RunDispatch(p);
  ASSERT_TRUE(results.ok()) << results.status();
  for (const RankResult& r : *results) {
    for (float g : r.dwg) EXPECT_EQ(g, 0.0f);
  }
}

TEST(DispatchTest, UnevenExpertSplitIsInvalidArgumentNamingEAndP) {
  Problem p = MakeProblem(4, 4, 6, 2, {2, 2, 2, 2}, 80);
  absl::Status s = testing::RunRanks(4, [&](Communicator& comm) -> absl::Status {
    std::vector<float> w(1), a = test::ToFloat(p.a[comm.rank()]), cw = test::ToFloat(p.cw[comm.rank()]);
    std::vector<float> y(a.size());
    DispatchState state;
    return DispatchCombineForward(comm, p.config(), {w, w, w}, a, p.idx[comm.rank()], cw,
                                  absl::MakeSpan(y), &state);
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("E=6"));
  EXPECT_THAT(s.message(), HasSubstr("P=4"));
}

TEST(DispatchTest, BadArgumentsAreInvalidArgument) {
  // World of one: every check fires before any collective.
  Problem p = MakeProblem(1, 1, 4, 2, {3}, 81);
  const std::vector<float> wg = p.Slice(p.wg, 0), wu = p.Slice(p.wu, 0), wd = p.Slice(p.wd, 0);
  const std::vector<float> a = test::ToFloat(p.a[0]), cw = test::ToFloat(p.cw[0]);
  absl::Status s = testing::RunRanks(1, [&](Communicator& comm) -> absl::Status {
    std::vector<float> y(a.size());
    DispatchState state;
    auto forward = [&](const DispatchConfig& c, absl::Span<const float> aa,
                       absl::Span<const int32_t> idx, absl::Span<const float> w,
                       absl::Span<float> yy) {
      return DispatchCombineForward(comm, c, {wg, wu, wd}, aa, idx, w, yy, &state);
    };
    DispatchConfig k5 = p.config();
    k5.top_k = 5;
    EXPECT_THAT(forward(k5, a, p.idx[0], cw, absl::MakeSpan(y)).message(), HasSubstr("K=5"));
    DispatchConfig k0 = p.config();
    k0.top_k = 0;
    EXPECT_THAT(forward(k0, a, p.idx[0], cw, absl::MakeSpan(y)).message(), HasSubstr("K=0"));
    DispatchConfig h0 = p.config();
    h0.hidden = 0;
    EXPECT_THAT(forward(h0, a, p.idx[0], cw, absl::MakeSpan(y)).message(), HasSubstr("H=0"));
    EXPECT_THAT(forward(p.config(), std::vector<float>(17), p.idx[0], cw, absl::MakeSpan(y))
                    .message(),
                HasSubstr("not a multiple of D=6"));
    EXPECT_THAT(forward(p.config(), a, std::vector<int32_t>(5, 0), cw, absl::MakeSpan(y))
                    .message(),
                HasSubstr("expert_index has 5"));
    EXPECT_THAT(forward(p.config(), a, p.idx[0], std::vector<float>(7), absl::MakeSpan(y))
                    .message(),
                HasSubstr("combine_weight has 7"));
    std::vector<float> short_y(3);
    EXPECT_THAT(forward(p.config(), a, p.idx[0], cw, absl::MakeSpan(short_y)).message(),
                HasSubstr("y has 3"));
    std::vector<int32_t> bad_idx = p.idx[0];
    bad_idx[3] = 4;
    absl::Status out_of_range = forward(p.config(), a, bad_idx, cw, absl::MakeSpan(y));
    EXPECT_EQ(out_of_range.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(out_of_range.message(), HasSubstr("expert_index[token 1, slot 1] is 4"));
    bad_idx[3] = -2;
    EXPECT_THAT(forward(p.config(), a, bad_idx, cw, absl::MakeSpan(y)).message(),
                HasSubstr("is -2"));
    EXPECT_THAT(DispatchCombineForward(comm, p.config(), {wg, wu, std::vector<float>(3)}, a,
                                       p.idx[0], cw, absl::MakeSpan(y), &state)
                    .message(),
                HasSubstr("Wd has 3"));

    // Backward with spans that do not match the forward.
    GRADSUM_RETURN_IF_ERROR(forward(p.config(), a, p.idx[0], cw, absl::MakeSpan(y)));
    std::vector<float> dwg(wg.size()), dwu(wu.size()), dwd(wd.size()), d_a(a.size()),
        d_cw(cw.size()), bad(4);
    const ExpertWeightGrads grads{absl::MakeSpan(dwg), absl::MakeSpan(dwu), absl::MakeSpan(dwd)};
    EXPECT_THAT(DispatchCombineBackward(comm, p.config(), {wg, wu, wd}, state, bad,
                                        absl::MakeSpan(d_a), absl::MakeSpan(d_cw), grads)
                    .message(),
                HasSubstr("dy has 4"));
    EXPECT_THAT(DispatchCombineBackward(comm, p.config(), {wg, wu, wd}, state, y,
                                        absl::MakeSpan(d_a), absl::MakeSpan(bad), grads)
                    .message(),
                HasSubstr("d_combine_weight has 4"));
    DispatchConfig other = p.config();
    other.top_k = 1;
    EXPECT_THAT(DispatchCombineBackward(comm, other, {wg, wu, wd}, state, y, absl::MakeSpan(d_a),
                                        absl::MakeSpan(d_cw), grads)
                    .message(),
                HasSubstr("does not come from a forward"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum::moe
