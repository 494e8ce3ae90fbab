// SEMANTICS.md §9: frameworks that AVERAGE gradients match gradsum only by scaling the
// losses back up. The legacy path runs CE and the balancing statistics through an
// autograd all-reduce, whose backward all-reduces the upstream gradient (1 on every rank)
// and so multiplies each rank's gradient by the group size W; the gradients are then
// reduced with ReduceOp::kAvg. gradsum's path: local components, ReduceOp::kSum. In fp32
// with power-of-two W the two agree element by element (scaling by 2^k is exact).
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "collectives/communicator.h"
#include "core/status.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "losses/linear_cross_entropy.h"
#include "losses/router_losses.h"
#include "losses/step_stats.h"
#include "losses/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum::losses {
namespace {

using ::gradsum::testing::RunRanks;

constexpr int64_t kVocab = 29, kDim = 5, kExperts = 4;
constexpr int kTopK = 2, kMicroBatches = 2;

// Per rank: local gradients of the LM head (CE) and of the router logits' weights
// (balancing), accumulated over the micro-batches. Everything is rank-local.
struct LocalGrads {
  std::vector<float> head, router;
};

absl::StatusOr<LocalGrads> ComputeLocalGrads(Communicator& comm, const std::vector<float>& head,
                                             const std::vector<float>& router) {
  const int r = comm.rank();
  std::vector<std::vector<float>> hidden(kMicroBatches);
  std::vector<std::vector<int64_t>> labels(kMicroBatches);
  std::vector<MicroBatchTokens> mbs;
  for (int m = 0; m < kMicroBatches; ++m) {
    const int64_t t = 3 + 4 * ((r + m) % 3);  // uneven
    hidden[m] = RandomNormal(t * kDim, 100 * r + m, 1.0f);
    std::mt19937 rng(7 * r + m);
    for (int64_t i = 0; i < t; ++i)
      labels[m].push_back(i % 4 == 3 ? -100 : static_cast<int64_t>(rng() % kVocab));
  }
  for (int m = 0; m < kMicroBatches; ++m) mbs.push_back({labels[m], {}, {}});
  GRADSUM_ASSIGN_OR_RETURN(StepStats stats, ComputeStepStats(comm, mbs));
  LocalGrads g{std::vector<float>(head.size(), 0.0f), std::vector<float>(router.size(), 0.0f)};
  for (int m = 0; m < kMicroBatches; ++m) {
    const int64_t t = static_cast<int64_t>(labels[m].size());
    std::vector<float> h = hidden[m], w = head, gh(t * kDim);
    GRADSUM_RETURN_IF_ERROR(LinearCrossEntropyForwardBackward(
                                F32Matrix(h.data(), t, kDim), F32Matrix(w.data(), kDim, kVocab),
                                labels[m], stats.token_weights[m], stats.global_ce_weight_sum,
                                F32Matrix(gh.data(), t, kDim),
                                F32Matrix(g.head.data(), kDim, kVocab))
                                .status());
    // Router logits u = hidden @ router; counts from the top-k, reduced over the world.
    std::vector<float> u(t * kExperts, 0.0f), du(t * kExperts, 0.0f);
    std::vector<int32_t> topk;
    for (int64_t i = 0; i < t; ++i) {
      for (int64_t e = 0; e < kExperts; ++e)
        for (int64_t k = 0; k < kDim; ++k)
          u[i * kExperts + e] += h[i * kDim + k] * router[k * kExperts + e];
      int32_t a = 0, b = 1;
      if (u[i * kExperts + b] > u[i * kExperts + a]) std::swap(a, b);
      for (int32_t e = 2; e < kExperts; ++e) {
        if (u[i * kExperts + e] > u[i * kExperts + a]) {
          b = a;
          a = e;
        } else if (u[i * kExperts + e] > u[i * kExperts + b]) {
          b = e;
        }
      }
      topk.push_back(a);
      topk.push_back(b);
    }
    GRADSUM_ASSIGN_OR_RETURN(std::vector<int64_t> local,
                             CountLocalExpertAssignments(topk, kTopK, {}, kExperts));
    GRADSUM_ASSIGN_OR_RETURN(ExpertCountReduction red,
                             ExpertCountReduction::Start(comm, local, kTopK));
    GRADSUM_ASSIGN_OR_RETURN(absl::Span<const int64_t> c, red.Wait());
    GRADSUM_RETURN_IF_ERROR(LoadBalancingLossForwardBackward(F32Matrix(u.data(), t, kExperts), {},
                                                             c, kTopK, kMicroBatches, 0.01,
                                                             F32Matrix(du.data(), t, kExperts))
                                .status());
    for (int64_t i = 0; i < t; ++i)
      for (int64_t k = 0; k < kDim; ++k)
        for (int64_t e = 0; e < kExperts; ++e)
          g.router[k * kExperts + e] += h[i * kDim + k] * du[i * kExperts + e];
  }
  return g;
}

void RunEquivalence(int world) {
  const std::vector<float> head = RandomNormal(kDim * kVocab, 1, 0.5f);
  const std::vector<float> router = RandomNormal(kDim * kExperts, 2, 1.0f);
  std::vector<std::vector<float>> sum_path(world), legacy_path(world), plain_avg(world);
  absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(LocalGrads g, ComputeLocalGrads(comm, head, router));
    std::vector<float> flat = g.head;
    flat.insert(flat.end(), g.router.begin(), g.router.end());

    // gradsum: local components + SUM.
    std::vector<float> summed = flat;
    GRADSUM_RETURN_IF_ERROR(
        comm.AllReduce(summed.data(), summed.data(), summed.size(), DType::kF32, ReduceOp::kSum));

    // Legacy: the autograd all-reduce's backward sums the upstream gradient (1.0 on every
    // rank) over the group, scaling this rank's gradient by it; then AVG.
    float upstream = 1.0f;
    GRADSUM_RETURN_IF_ERROR(comm.AllReduce(&upstream, &upstream, 1, DType::kF32, ReduceOp::kSum));
    std::vector<float> legacy = flat;
    for (float& x : legacy) x *= upstream;
    GRADSUM_RETURN_IF_ERROR(
        comm.AllReduce(legacy.data(), legacy.data(), legacy.size(), DType::kF32, ReduceOp::kAvg));

    // Control: AVG without the legacy scaling is off by the factor W.
    std::vector<float> avg = flat;
    GRADSUM_RETURN_IF_ERROR(
        comm.AllReduce(avg.data(), avg.data(), avg.size(), DType::kF32, ReduceOp::kAvg));

    sum_path[comm.rank()] = summed;
    legacy_path[comm.rank()] = legacy;
    plain_avg[comm.rank()] = avg;
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(sum_path[r].size(), legacy_path[r].size());
    int nonzero = 0;
    for (size_t i = 0; i < sum_path[r].size(); ++i) {
      ASSERT_EQ(sum_path[r][i], legacy_path[r][i])
          << "W=" << world << " rank " << r << " element " << i;
      if (sum_path[r][i] != 0.0f) {
        ++nonzero;
        EXPECT_EQ(plain_avg[r][i] * static_cast<float>(world), sum_path[r][i]);
        EXPECT_NE(plain_avg[r][i], sum_path[r][i]);
      }
    }
    EXPECT_GT(nonzero, static_cast<int>(sum_path[r].size()) / 2);  // a real comparison
  }
}

TEST(LegacyEquivalenceTest, AutogradAllReduceScalingPlusAvgEqualsLocalPlusSumWorld2) {
  RunEquivalence(2);
}

TEST(LegacyEquivalenceTest, AutogradAllReduceScalingPlusAvgEqualsLocalPlusSumWorld4) {
  RunEquivalence(4);
}

}  // namespace
}  // namespace gradsum::losses
