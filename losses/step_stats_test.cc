#include "losses/step_stats.h"

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collectives/communicator.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"

namespace gradsum::losses {
namespace {

using ::gradsum::testing::RunRanks;
using ::testing::HasSubstr;

// One rank's micro-batch, owning its arrays.
struct Batch {
  std::vector<int64_t> labels, sample_ids;
  std::vector<uint8_t> mask;
  MicroBatchTokens View() const { return {labels, sample_ids, mask}; }
};

// Uneven micro-batches: rank r, micro-batch m has 3 + 5 * ((r + 2 * m) % 3) tokens, in
// samples of up to 4 tokens, ~30% ignored labels, trailing padding on odd ranks; rank 1
// has no valid token at all.
Batch MakeBatch(int rank, int m, uint32_t seed) {
  std::mt19937 rng(seed + 100 * rank + m);
  std::bernoulli_distribution ignore(0.3);
  Batch b;
  const int t = 3 + 5 * ((rank + 2 * m) % 3);
  for (int i = 0; i < t; ++i) {
    const bool padding = rank % 2 == 1 && i >= t - 2;
    b.mask.push_back(padding ? 0 : 1);
    b.labels.push_back(padding || rank == 1 || ignore(rng) ? -100 : i % 7);
    b.sample_ids.push_back(i / 4);
  }
  return b;
}

// Single-process reference of D (§3): weights from the definition, over every token.
double ReferenceD(const std::vector<std::vector<Batch>>& batches, CeWeightMode mode) {
  double d = 0.0;
  for (const auto& rank_batches : batches) {
    for (const Batch& b : rank_batches) {
      std::map<int64_t, int> n_s;
      for (size_t t = 0; t < b.labels.size(); ++t) n_s[b.sample_ids[t]] += b.labels[t] != -100;
      for (size_t t = 0; t < b.labels.size(); ++t) {
        if (b.labels[t] == -100) continue;
        const double n = n_s[b.sample_ids[t]];
        d += mode == CeWeightMode::kToken    ? 1.0
             : mode == CeWeightMode::kSample ? 1.0 / n
                                             : 1.0 / std::sqrt(n);
      }
    }
  }
  return d;
}

TEST(StepStatsTest, GlobalSumsMatchSingleProcessOnEveryRank) {
  for (int world : {1, 3}) {
    for (int g : {1, 2, 3}) {
      for (CeWeightMode mode :
           {CeWeightMode::kToken, CeWeightMode::kSample, CeWeightMode::kSquare}) {
        std::vector<std::vector<Batch>> batches(world);
        int64_t routed = 0, valid = 0;
        for (int r = 0; r < world; ++r) {
          for (int m = 0; m < g; ++m) {
            batches[r].push_back(MakeBatch(r, m, 7));
            for (uint8_t x : batches[r].back().mask) routed += x;
            for (int64_t y : batches[r].back().labels) valid += y != -100;
          }
        }
        const double ref_d = ReferenceD(batches, mode);
        std::vector<StepStats> got(world);
        absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
          std::vector<MicroBatchTokens> mbs;
          for (const Batch& b : batches[comm.rank()]) mbs.push_back(b.View());
          StepStatsOptions opt;
          opt.mode = mode;
          absl::StatusOr<StepStats> st = ComputeStepStats(comm, mbs, opt);
          if (!st.ok()) return st.status();
          got[comm.rank()] = *std::move(st);
          return absl::OkStatus();
        });
        ASSERT_TRUE(s.ok()) << s;
        const std::string where =
            absl::StrCat("W=", world, " G=", g, " mode=", CeWeightModeName(mode));
        for (int r = 0; r < world; ++r) {
          EXPECT_NEAR(got[r].global_ce_weight_sum, ref_d, 1e-6 * ref_d) << where;
          EXPECT_EQ(got[r].global_ce_weight_sum, got[0].global_ce_weight_sum) << where;
          EXPECT_EQ(got[r].global_routed_tokens, routed) << where;
          EXPECT_EQ(got[r].global_valid_tokens, valid) << where;
          EXPECT_EQ(got[r].num_micro_batches, g);
          ASSERT_EQ(got[r].token_weights.size(), static_cast<size_t>(g));
          for (int m = 0; m < g; ++m) {
            EXPECT_EQ(got[r].token_weights[m].size(), batches[r][m].labels.size());
          }
        }
        if (world == 3) {
          EXPECT_EQ(got[1].local_valid_tokens, 0);
          EXPECT_EQ(got[1].local_ce_weight_sum, 0.0);
        }
      }
    }
  }
}

// MTP's label streams (§15.1) ride in the same all-reduce: each D_j is the reference D of
// that stream's labels, and D, N and the main weights are exactly those of a call without
// streams. Stream j here is the main labels j further on inside the sample.
TEST(StepStatsTest, ExtraStreamsGiveEachStreamItsOwnD) {
  const int world = 3, g = 2, k = 2;
  for (CeWeightMode mode : {CeWeightMode::kToken, CeWeightMode::kSample, CeWeightMode::kSquare}) {
    std::vector<std::vector<Batch>> batches(world);
    // streams[j][r][m]: depth j + 1's labels (int32), and the same as a Batch for ReferenceD.
    std::vector<std::vector<std::vector<std::vector<int32_t>>>> streams(
        k, std::vector<std::vector<std::vector<int32_t>>>(world));
    std::vector<std::vector<std::vector<Batch>>> stream_batches(
        k, std::vector<std::vector<Batch>>(world));
    for (int r = 0; r < world; ++r) {
      for (int m = 0; m < g; ++m) {
        const Batch b = MakeBatch(r, m, 11);
        batches[r].push_back(b);
        for (int j = 0; j < k; ++j) {
          Batch s = b;
          for (size_t t = 0; t < b.labels.size(); ++t) {
            const size_t u = t + j + 1;
            const bool inside = u < b.labels.size() && b.sample_ids[u] == b.sample_ids[t];
            s.labels[t] = inside ? b.labels[u] : -100;
          }
          streams[j][r].push_back(std::vector<int32_t>(s.labels.begin(), s.labels.end()));
          stream_batches[j][r].push_back(s);
        }
      }
    }
    std::vector<StepStats> with(world), without(world);
    absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      std::vector<MicroBatchTokens> plain, mtp;
      for (int m = 0; m < g; ++m) {
        plain.push_back(batches[r][m].View());
        mtp.push_back(batches[r][m].View());
        for (int j = 0; j < k; ++j) mtp.back().extra_streams.push_back({streams[j][r][m], {}});
      }
      StepStatsOptions opt;
      opt.mode = mode;
      GRADSUM_ASSIGN_OR_RETURN(without[r], ComputeStepStats(comm, plain, opt));
      opt.extra_streams = k;
      GRADSUM_ASSIGN_OR_RETURN(with[r], ComputeStepStats(comm, mtp, opt));
      return absl::OkStatus();
    });
    ASSERT_TRUE(s.ok()) << s;
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE(absl::StrCat("rank ", r, " mode ", CeWeightModeName(mode)));
      EXPECT_EQ(with[r].global_ce_weight_sum, without[r].global_ce_weight_sum);
      EXPECT_EQ(with[r].global_routed_tokens, without[r].global_routed_tokens);
      EXPECT_EQ(with[r].global_valid_tokens, without[r].global_valid_tokens);
      EXPECT_EQ(with[r].token_weights, without[r].token_weights);
      EXPECT_TRUE(without[r].global_stream_weight_sums.empty());
      ASSERT_EQ(with[r].global_stream_weight_sums.size(), static_cast<size_t>(k));
      ASSERT_EQ(with[r].stream_token_weights.size(), static_cast<size_t>(k));
      for (int j = 0; j < k; ++j) {
        const double ref = ReferenceD(stream_batches[j], mode);
        EXPECT_NEAR(with[r].global_stream_weight_sums[j], ref, 1e-6 * ref) << "depth " << j + 1;
        EXPECT_EQ(with[r].global_stream_weight_sums[j], with[0].global_stream_weight_sums[j]);
        double local = 0;
        ASSERT_EQ(with[r].stream_token_weights[j].size(), static_cast<size_t>(g));
        for (const std::vector<float>& w : with[r].stream_token_weights[j]) {
          for (float x : w) local += x;
        }
        EXPECT_EQ(with[r].local_stream_weight_sums[j], local);
      }
    }
  }
}

// A rank whose micro-batch holds another number of extra streams than extra_streams is named; the
// others fail with it instead of waiting.
TEST(StepStatsTest, ExtraStreamCountIsChecked) {
  std::vector<absl::Status> status(2);
  RunRanks(2, [&](Communicator& comm) -> absl::Status {
    const std::vector<int64_t> labels = {1, 2, -100};
    const std::vector<int32_t> depth1 = {2, -100, -100};
    MicroBatchTokens mb{labels, {}, {}};
    mb.extra_streams.push_back({depth1, {}});
    if (comm.rank() == 1) mb.extra_streams.push_back({depth1, {}});
    StepStatsOptions opt;
    opt.extra_streams = 1;
    status[comm.rank()] = ComputeStepStats(comm, {&mb, 1}, opt).status();
    return absl::OkStatus();
  }).IgnoreError();
  EXPECT_EQ(status[0].code(), absl::StatusCode::kFailedPrecondition) << status[0];
  EXPECT_EQ(status[1].code(), absl::StatusCode::kInvalidArgument) << status[1];
  EXPECT_THAT(std::string(status[1].message()),
              HasSubstr("2 extra label streams, not extra_streams 1"));
}

TEST(StepStatsTest, AllIgnoredStepHasZeroD) {
  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    const std::vector<int64_t> labels(5, -100);
    const MicroBatchTokens mb{labels, {}, {}};
    absl::StatusOr<StepStats> st = ComputeStepStats(comm, {&mb, 1});
    if (!st.ok()) return st.status();
    EXPECT_EQ(st->global_ce_weight_sum, 0.0);
    EXPECT_EQ(st->global_valid_tokens, 0);
    EXPECT_EQ(st->global_routed_tokens, 10);  // empty mask: every token routed
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(StepStatsTest, RanksDisagreeingOnGFailTogether) {
  std::vector<absl::Status> status(3);
  RunRanks(3, [&](Communicator& comm) -> absl::Status {
    const std::vector<int64_t> labels = {1, 2};
    const MicroBatchTokens mb{labels, {}, {}};
    std::vector<MicroBatchTokens> mbs(comm.rank() == 1 ? 3 : 2, mb);  // G = 2, 3, 2
    status[comm.rank()] = ComputeStepStats(comm, mbs).status();
    return absl::OkStatus();
  }).IgnoreError();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kFailedPrecondition) << r;
    EXPECT_THAT(std::string(status[r].message()), HasSubstr("number of micro-batches G")) << r;
  }
}

TEST(StepStatsTest, BadInputOnOneRankFailsEveryRankWithoutWaiting) {
  struct Case {
    std::vector<int64_t> labels, sample_ids;
    std::vector<uint8_t> mask;
    CeWeightMode mode;
    const char* text;
  };
  const std::vector<Case> cases = {
      {{1, 2},
       {},
       {1, 0},
       CeWeightMode::kToken,
       "token 1 is padding (input_mask 0) but has label 2"},
      {{1, 2}, {}, {1}, CeWeightMode::kToken, "1 mask entries for 2 labels"},
      {{1, 2}, {}, {1, 3}, CeWeightMode::kToken, "input_mask[1] = 3"},
      {{1, 2}, {}, {}, CeWeightMode::kSample, "sample ids"},
  };
  for (const Case& c : cases) {
    std::vector<absl::Status> status(2);
    RunRanks(2, [&](Communicator& comm) -> absl::Status {
      const std::vector<int64_t> good = {1, 2};
      const std::vector<int64_t> ids = {0, 0};
      MicroBatchTokens mb{good, ids, {}};
      if (comm.rank() == 1) mb = {c.labels, c.sample_ids, c.mask};
      StepStatsOptions opt;
      opt.mode = c.mode;
      status[comm.rank()] = ComputeStepStats(comm, {&mb, 1}, opt).status();
      return absl::OkStatus();
    }).IgnoreError();
    EXPECT_EQ(status[1].code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(status[1].message()), HasSubstr(c.text));
    EXPECT_EQ(status[0].code(), absl::StatusCode::kFailedPrecondition) << c.text;
  }
  // No micro-batches at all.
  std::vector<absl::Status> status(2);
  RunRanks(2, [&](Communicator& comm) -> absl::Status {
    const std::vector<int64_t> labels = {1};
    const MicroBatchTokens mb{labels, {}, {}};
    status[comm.rank()] =
        ComputeStepStats(comm, comm.rank() == 0 ? absl::Span<const MicroBatchTokens>()
                                                : absl::Span<const MicroBatchTokens>(&mb, 1))
            .status();
    return absl::OkStatus();
  }).IgnoreError();
  EXPECT_EQ(status[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status[1].code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ExpertCountsTest, LocalCountsSkipPaddingAndCheckIds) {
  const std::vector<int32_t> idx = {0, 2, 2, 3, 1, 0, 3, 3};  // 4 tokens, K = 2
  auto c = CountLocalExpertAssignments(idx, 2, std::vector<uint8_t>{1, 1, 0, 1}, 4);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, (std::vector<int64_t>{1, 0, 2, 3}));
  auto all = CountLocalExpertAssignments(idx, 2, {}, 4);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, (std::vector<int64_t>{2, 1, 2, 3}));
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(CountLocalExpertAssignments(idx, 3, {}, 4).status().code(), kInvalid);
  EXPECT_EQ(CountLocalExpertAssignments(idx, 0, {}, 4).status().code(), kInvalid);
  EXPECT_EQ(CountLocalExpertAssignments(idx, 2, {}, 0).status().code(), kInvalid);
  EXPECT_EQ(CountLocalExpertAssignments(idx, 2, std::vector<uint8_t>{1, 1}, 4).status().code(),
            kInvalid);
  EXPECT_EQ(
      CountLocalExpertAssignments(idx, 2, std::vector<uint8_t>{1, 1, 2, 1}, 4).status().code(),
      kInvalid);
  auto out = CountLocalExpertAssignments(idx, 2, {}, 3);
  EXPECT_EQ(out.status().code(), kInvalid);
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("token 1 slot 1 routes to expert 3"));
}

TEST(ExpertCountsTest, AsyncAllReduceGivesGlobalCountsOnEveryRank) {
  const int world = 3, k = 2;
  const std::vector<std::vector<int64_t>> layer0 = {{0, 2, 0, 2}, {1, 1, 0, 2}, {2, 0, 1, 1}};
  const std::vector<std::vector<int64_t>> layer1 = {{0, 0, 2, 0}, {1, 1, 2, 0}, {2, 2, 2, 0}};
  std::vector<std::vector<int64_t>> got0(world), got1(world);
  std::vector<int64_t> n0(world), n1(world);
  absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    // Two layers in flight at once, as during a forward pass; waited in reverse order.
    absl::StatusOr<ExpertCountReduction> a = ExpertCountReduction::Start(comm, layer0[r], k);
    if (!a.ok()) return a.status();
    absl::StatusOr<ExpertCountReduction> b = ExpertCountReduction::Start(comm, layer1[r], k);
    if (!b.ok()) return b.status();
    absl::StatusOr<absl::Span<const int64_t>> cb = b->Wait();
    if (!cb.ok()) return cb.status();
    absl::StatusOr<absl::Span<const int64_t>> ca = a->Wait();
    if (!ca.ok()) return ca.status();
    EXPECT_TRUE(a->IsCompleted());
    got0[r].assign(ca->begin(), ca->end());
    got1[r].assign(cb->begin(), cb->end());
    n0[r] = a->global_routed_tokens();
    n1[r] = b->global_routed_tokens();
    absl::StatusOr<absl::Span<const int64_t>> again = a->Wait();  // same result again
    EXPECT_TRUE(again.ok() && again->data() == ca->data());
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(got0[r], (std::vector<int64_t>{3, 3, 1, 5}));
    EXPECT_EQ(got1[r], (std::vector<int64_t>{3, 3, 6, 0}));
    EXPECT_EQ(n0[r], 6);  // 12 assignments / K
    EXPECT_EQ(n1[r], 6);
  }
}

TEST(ExpertCountsTest, Errors) {
  std::vector<absl::Status> wait_status(2);
  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    EXPECT_EQ(ExpertCountReduction::Start(comm, {}, 2).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ExpertCountReduction::Start(comm, std::vector<int64_t>{1, -1}, 2).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ExpertCountReduction::Start(comm, std::vector<int64_t>{1, 1}, 0).status().code(),
              absl::StatusCode::kInvalidArgument);
    // Counts that sum to 3 over the world cannot come from K = 2 on every rank.
    const std::vector<int64_t> local = {comm.rank() == 0 ? 2 : 1, 0};
    absl::StatusOr<ExpertCountReduction> red = ExpertCountReduction::Start(comm, local, 2);
    if (!red.ok()) return red.status();
    wait_status[comm.rank()] = red->Wait().status();
    EXPECT_EQ(red->global_routed_tokens(), -1);
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (const absl::Status& w : wait_status) {
    EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(w.message()), HasSubstr("not a multiple of top_k 2"));
  }
}

}  // namespace
}  // namespace gradsum::losses
