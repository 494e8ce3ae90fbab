#ifndef GRADSUM_MOE_DISPATCH_TESTING_H_
#define GRADSUM_MOE_DISPATCH_TESTING_H_

// Test-only: a global dispatch problem (every rank's tokens, routing and output gradient, all
// E experts), the per-rank forward + backward on any Communicator backend, and the check of a
// rank's results against the double reference (moe/reference.h) with central differences.
// Shared by the thread-backend test (dispatch_test.cc) and the MPI test (dispatch_mpi_test.cc).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "collectives/communicator.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "moe/dispatch.h"
#include "moe/reference.h"
#include "moe/test_util.h"

namespace gradsum::moe::test {

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

// Forward + backward on world rank world.rank() (any backend), then the SUM of the expert
// gradients over the EDP group. EP groups are the contiguous blocks of ep_size ranks
// (SEMANTICS.md §1), EDP groups the ranks with the same EP slot.
inline absl::Status RunDispatchOnRank(Communicator& world, const Problem& p, RankResult* result) {
  const int r = world.rank();
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> ep,
                           world.Split(r / p.ep_size, r % p.ep_size));
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> edp,
                           world.Split(r % p.ep_size, r / p.ep_size));
  const int slot = ep->rank();
  const std::vector<float> wg = p.Slice(p.wg, slot), wu = p.Slice(p.wu, slot),
                           wd = p.Slice(p.wd, slot);
  const std::vector<float> a = test::ToFloat(p.a[r]), cw = test::ToFloat(p.cw[r]),
                           dy = test::ToFloat(p.dy[r]);
  RankResult& out = *result;
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
      *ep, p.config(), {wg, wu, wd}, state, dy, absl::MakeSpan(out.d_a), absl::MakeSpan(out.d_cw),
      {absl::MakeSpan(out.dwg), absl::MakeSpan(out.dwu), absl::MakeSpan(out.dwd)}));
  for (std::vector<float>* g : {&out.dwg, &out.dwu, &out.dwd}) {
    GRADSUM_RETURN_IF_ERROR(
        edp->AllReduce(g->data(), g->data(), g->size(), DType::kF32, ReduceOp::kSum));
  }
  return absl::OkStatus();
}

// Checks what world rank r computed against the reference: outputs, d_a, d(combine weights)
// of its tokens, and the SUM-reduced gradients of its slot's experts, all against central
// differences of the global reference loss.
inline void ExpectRankMatchesReference(Problem p, int r, const RankResult& got) {
  auto loss = [&p] { return p.ReferenceLoss(); };
  const double h = 1e-6;
  {
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
  // The SUM-reduced gradients of this rank's experts.
  const int my_slot = r % p.ep_size;
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
      if (slot != my_slot) continue;
      const size_t local = i - static_cast<size_t>(slot) * p.local_experts() * per_expert;
      const double fd = reference::CentralDifference(loss, &(*param.w)[i], h);
      ASSERT_NEAR((got.*param.g)[local], fd, 2e-4 * (1 + std::abs(fd)))
          << param.name << " expert " << e << " element " << i % per_expert << " on rank " << r;
    }
  }
}

}  // namespace gradsum::moe::test

#endif  // GRADSUM_MOE_DISPATCH_TESTING_H_
