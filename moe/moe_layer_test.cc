// The whole MoE block (router + dispatch + experts + combine) on the host, as the shared
// orchestration (moe/moe_block.h) runs it over the host's kernels, on EP = 1, 2, 4 against
// the double-precision single-process reference, gradients SUM-reduced as SEMANTICS.md §7
// says: the router over the world, the experts over their EDP group (groups from
// collectives/mesh.h).
#include "moe/moe_layer.h"

#include <cmath>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/communicator.h"
#include "collectives/mesh.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "moe/reference.h"
#include "moe/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum::moe {
namespace {

// The host's kernels with the router losses' gradients given (the test's loss puts
// arbitrary cotangents on the logits and the gating sums) instead of the z and balancing
// losses'.
class GivenLossGrads : public MoeLayersCpu {
 public:
  GivenLossGrads(Communicator& ep, Communicator& world, const MoeLayerConfig& config,
                 std::vector<float> d_logits, std::vector<double> d_gating_sums)
      : MoeLayersCpu(ep, world, config, {}, 1),
        d_logits_(std::move(d_logits)),
        d_gating_sums_(std::move(d_gating_sums)) {}
  absl::Status RouterLosses(int l) override {
    loss_d_logits_ = d_logits_;
    loss_d_gating_sums_ = d_gating_sums_;
    return absl::OkStatus();
  }

 private:
  std::vector<float> d_logits_;
  std::vector<double> d_gating_sums_;
};

std::vector<float> Concat(const std::vector<float>& a, const std::vector<float>& b,
                          const std::vector<float>& c) {
  std::vector<float> out(a);
  out.insert(out.end(), b.begin(), b.end());
  out.insert(out.end(), c.begin(), c.end());
  return out;
}

// (world, ep_size, E, K, norm_topk_prob)
class MoeLayerParityTest : public ::testing::TestWithParam<std::tuple<int, int, int, int, bool>> {};

TEST_P(MoeLayerParityTest, OutputsAndReducedGradientsMatchReference) {
  const auto [world, ep_size, E, K, norm] = GetParam();
  const int D = 5, H = 4;
  const float scale = 1.5f;
  const int E_local = E / ep_size;
  const std::vector<int> tokens_per_rank = {6, 3, 0, 5};
  reference::LayerConfig rc;
  rc.d_model = D;
  rc.hidden = H;
  rc.num_experts = E;
  rc.top_k = K;
  rc.norm_topk_prob = norm;
  rc.router_scale = scale;
  const MoeLayerConfig config{.d_model = D,
                              .hidden = H,
                              .num_experts = E,
                              .top_k = K,
                              .norm_topk_prob = norm,
                              .router_scale = scale};

  std::vector<std::vector<double>> a(world), dy(world), cu(world);
  std::vector<std::vector<uint8_t>> mask(world);
  for (int r = 0; r < world; ++r) {
    const int T = world == 1 ? 9 : tokens_per_rank[r];
    a[r] = test::RandomFp32Values(T * D, 1.0, 10 * r + 1);
    dy[r] = test::RandomFp32Values(T * D, 1.0, 10 * r + 2);
    cu[r] = test::RandomFp32Values(T * E, 0.3, 10 * r + 3);
    mask[r].assign(T, 1);
    if (T > 2) mask[r][1] = 0;  // a padding token
  }
  std::vector<double> wr = test::RandomFp32Values(D * E, 1.0, 100);
  std::vector<double> wg = test::RandomFp32Values(E * D * H, 0.6, 101);
  std::vector<double> wu = test::RandomFp32Values(E * D * H, 0.6, 102);
  std::vector<double> wd = test::RandomFp32Values(E * H * D, 0.6, 103);
  const std::vector<double> cg = test::RandomFp32Values(E, 1.0, 104);  // d L / d local_gating_sums

  // L = sum_r [ <dy_r, y_r> + sum_e cg_e * gating_r[e] + sum_{routed t, e} cu_r[t,e] u_t[e] ].
  auto loss = [&] {
    double l = 0.0;
    for (int r = 0; r < world; ++r) {
      const std::vector<double> y = reference::MoeLayer(rc, a[r], mask[r], wr, wg, wu, wd);
      for (size_t i = 0; i < y.size(); ++i) l += dy[r][i] * y[i];
      for (size_t t = 0; t < mask[r].size(); ++t) {
        if (!mask[r][t]) continue;
        reference::TokenRoute route = reference::RouteToken(rc, &a[r][t * D], wr);
        for (int e = 0; e < E; ++e)
          l += cg[e] * route.probs[e] + cu[r][t * E + e] * route.logits[e];
      }
    }
    return l;
  };

  struct Result {
    std::vector<float> y, d_a, dwr, dwg, dwu, dwd;
  };
  std::vector<Result> results(world);
  absl::Status status = testing::RunRanks(world, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh, Mesh::Create(&comm, ep_size));
    Communicator* ep = &mesh->ep_group();
    Communicator* edp = &mesh->edp_group();
    const size_t per = static_cast<size_t>(E_local) * D * H;
    const int slot = mesh->p_index();
    auto slice = [&](const std::vector<double>& w) {
      return std::vector<float>(w.begin() + slot * per, w.begin() + (slot + 1) * per);
    };
    const std::vector<float> wrf = test::ToFloat(wr), wgf = slice(wg), wuf = slice(wu),
                             wdf = slice(wd);
    const std::vector<float> af = test::ToFloat(a[r]), dyf = test::ToFloat(dy[r]),
                             cuf = test::ToFloat(cu[r]);
    Result& out = results[r];
    out.y.resize(af.size());
    const std::vector<float> experts = Concat(wgf, wuf, wdf);
    const MoeBlockWeights weights{.router = wrf.data(), .local_experts = experts.data()};
    GivenLossGrads kernels(*ep, mesh->world(), config, cuf, cg);
    MoeBlock block(&kernels, 1);
    const std::vector<int32_t> mask32(mask[r].begin(), mask[r].end());
    kernels.BeginMicroBatch({.rows = static_cast<int64_t>(mask32.size()), .mask = mask32});
    block.BeginMicroBatch();
    GRADSUM_RETURN_IF_ERROR(block.Forward(0, af.data(), weights, out.y.data()));
    // Activation recomputation: the dispatch state lent away and re-run from the kept
    // routing gives the same output bits, and the backward below (checked against finite
    // differences) runs on the re-run state.
    std::vector<float> rerun(af.size(), -1.0f);
    block.Release(0);
    GRADSUM_RETURN_IF_ERROR(block.Recompute(0, af.data(), weights, rerun.data()));
    if (rerun != out.y) return absl::InternalError("the re-run forward's output differs");
    out.d_a.assign(af.size(), -1.0f);  // written
    out.dwr.assign(wrf.size(), 0.0f);
    std::vector<float> d_experts(3 * per, 0.0f);
    const GradTarget d_router = GradTarget::Accumulate(out.dwr.data(), out.dwr.size());
    const GradTarget d_local = GradTarget::Accumulate(d_experts.data(), d_experts.size());
    GRADSUM_RETURN_IF_ERROR(
        block.Backward(0, af.data(), weights, dyf.data(), out.d_a.data(), {&d_router, &d_local}));
    out.dwg.assign(d_experts.begin(), d_experts.begin() + per);
    out.dwu.assign(d_experts.begin() + per, d_experts.begin() + 2 * per);
    out.dwd.assign(d_experts.begin() + 2 * per, d_experts.end());
    // SEMANTICS.md §7: router over the world, experts over the EDP group; plain SUM.
    GRADSUM_RETURN_IF_ERROR(comm.AllReduce(out.dwr.data(), out.dwr.data(), out.dwr.size(),
                                           DType::kF32, ReduceOp::kSum));
    for (std::vector<float>* g : {&out.dwg, &out.dwu, &out.dwd}) {
      GRADSUM_RETURN_IF_ERROR(
          edp->AllReduce(g->data(), g->data(), g->size(), DType::kF32, ReduceOp::kSum));
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;

  const double h = 1e-6;
  auto tol = [](double fd) { return 2e-4 * (1.0 + std::abs(fd)); };
  for (int r = 0; r < world; ++r) {
    const std::vector<double> y = reference::MoeLayer(rc, a[r], mask[r], wr, wg, wu, wd);
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_NEAR(results[r].y[i], y[i], 1e-5) << "rank " << r << " y[" << i << "]";
    }
    for (size_t i = 0; i < a[r].size(); ++i) {
      const double fd = reference::CentralDifference(loss, &a[r][i], h);
      ASSERT_NEAR(results[r].d_a[i], fd, tol(fd)) << "rank " << r << " d_a[" << i << "]";
    }
  }
  for (size_t i = 0; i < wr.size(); ++i) {
    const double fd = reference::CentralDifference(loss, &wr[i], h);
    for (int r = 0; r < world; ++r) {
      ASSERT_NEAR(results[r].dwr[i], fd, tol(fd)) << "dWr[" << i << "] on rank " << r;
    }
  }
  const size_t per = static_cast<size_t>(E_local) * D * H;
  for (auto [w, g] : {std::make_pair(&wg, &Result::dwg), std::make_pair(&wu, &Result::dwu),
                      std::make_pair(&wd, &Result::dwd)}) {
    for (size_t i = 0; i < w->size(); ++i) {
      const double fd = reference::CentralDifference(loss, &(*w)[i], h);
      const int slot = static_cast<int>(i / per);
      for (int r = slot; r < world; r += ep_size) {
        ASSERT_NEAR((results[r].*g)[i - slot * per], fd, tol(fd))
            << "expert weight element " << i << " on rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    EpSizes, MoeLayerParityTest,
    ::testing::Values(std::make_tuple(1, 1, 4, 2, false), std::make_tuple(2, 2, 4, 2, true),
                      std::make_tuple(4, 4, 4, 2, false), std::make_tuple(4, 4, 8, 1, true),
                      std::make_tuple(4, 2, 4, 4, true)),
    [](const ::testing::TestParamInfo<std::tuple<int, int, int, int, bool>>& info) {
      return absl::StrCat("W", std::get<0>(info.param), "_EP", std::get<1>(info.param), "_E",
                          std::get<2>(info.param), "_K", std::get<3>(info.param),
                          std::get<4>(info.param) ? "_norm" : "");
    });

// A re-run needs the routing of a forward on the same tokens, and the dispatch counts it
// exchanged: without them it fails by name, before any collective.
TEST(MoeLayerRecomputeTest, WithoutAForwardOnTheSameTokensIsFailedPrecondition) {
  const int D = 3, H = 2, E = 2;
  const MoeLayerConfig config{.d_model = D, .hidden = H, .num_experts = E, .top_k = 1};
  absl::Status status = testing::RunRanks(1, [&](Communicator& comm) -> absl::Status {
    // Expert 0 scores sum(a), expert 1 -sum(a): all-ones tokens go to 0, all-minus-ones to 1.
    std::vector<float> wr(D * E), w(3 * E * D * H, 0.25f), y(4 * D);
    for (int d = 0; d < D; ++d) wr[d * E] = 1.0f, wr[d * E + 1] = -1.0f;
    const std::vector<float> a(4 * D, 1.0f), negated(4 * D, -1.0f);
    const MoeBlockWeights weights{.router = wr.data(), .local_experts = w.data()};
    MoeLayersCpu kernels(comm, comm, config, {}, 1);
    MoeBlock block(&kernels, 1);
    kernels.BeginMicroBatch({.rows = 4});
    block.BeginMicroBatch();
    absl::Status s = block.Recompute(0, a.data(), weights, y.data());
    if (s.code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError(absl::StrCat("no forward: got ", s.ToString()));
    }
    GRADSUM_RETURN_IF_ERROR(block.Forward(0, a.data(), weights, y.data()));
    std::vector<float> fewer(2 * D, 1.0f), y2(2 * D);
    kernels.BeginMicroBatch({.rows = 2});
    s = kernels.Dispatch(0, fewer.data(), weights, y2.data(), /*rerun=*/true);
    if (s.code() != absl::StatusCode::kFailedPrecondition ||
        s.message().find("4 tokens, the input has 2") == absl::string_view::npos) {
      return absl::InternalError(absl::StrCat("other tokens: got ", s.ToString()));
    }
    // Routed again to other experts: the kept counts are not this routing's.
    kernels.BeginMicroBatch({.rows = 4});
    GRADSUM_RETURN_IF_ERROR(kernels.Route(0, negated.data(), weights));
    s = kernels.Dispatch(0, negated.data(), weights, y.data(), /*rerun=*/true);
    if (s.code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError(absl::StrCat("other counts: got ", s.ToString()));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace gradsum::moe
