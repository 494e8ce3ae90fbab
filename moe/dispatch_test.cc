// Dispatch/combine over EP groups of the thread backend against the double-precision
// single-process reference (moe/reference.h), with expert gradients SUM-reduced over the
// EDP group as SEMANTICS.md §7 prescribes.
#include "moe/dispatch.h"

#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collectives/communicator.h"
#include "collectives/forwarding_communicator.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/dispatch_testing.h"
#include "moe/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum::moe {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

using test::MakeProblem;
using test::Problem;
using test::RankResult;

// Runs every rank of p on the thread backend and checks each against the reference.
void ExpectMatchesReference(const Problem& p) {
  std::vector<RankResult> results(p.world);
  absl::Status status = testing::RunRanks(p.world, [&](Communicator& world) {
    return test::RunDispatchOnRank(world, p, &results[world.rank()]);
  });
  ASSERT_TRUE(status.ok()) << status;
  for (int r = 0; r < p.world; ++r) test::ExpectRankMatchesReference(p, r, results[r]);
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

// Records the issue and the wait of every all-to-all-v ("i3": the fourth one issued, "w3":
// the wait for it), forwarding everything to `inner`; sub-communicators record into the
// same log.
class ExchangeRecorder : public ForwardingCommunicator {
 public:
  explicit ExchangeRecorder(std::unique_ptr<Communicator> inner)
      : ForwardingCommunicator(std::move(inner), SyncCalls::kThroughAsync),
        log_(std::make_shared<Log>()) {}
  std::vector<std::string> events() const { return log_->events; }

  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override {
    const int id = log_->next++;
    log_->events.push_back(absl::StrCat("i", id));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Work> work,
                             inner().AllToAllVAsync(send, send_counts, send_offsets, recv,
                                                    recv_counts, recv_offsets, dtype));
    return std::unique_ptr<Work>(new RecordedWork(std::move(work), log_, id));
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, inner().Split(color, key));
    auto recorder = std::make_unique<ExchangeRecorder>(std::move(sub));
    recorder->log_ = log_;
    return std::unique_ptr<Communicator>(std::move(recorder));
  }

 private:
  struct Log {  // used by one rank's thread only
    int next = 0;
    std::vector<std::string> events;
  };
  class RecordedWork : public Work {
   public:
    RecordedWork(std::unique_ptr<Work> inner, std::shared_ptr<Log> log, int id)
        : inner_(std::move(inner)), log_(std::move(log)), id_(id) {}
    absl::Status Wait(absl::Duration timeout) override {
      log_->events.push_back(absl::StrCat("w", id_));
      return inner_->Wait(timeout);
    }
    bool IsCompleted() override { return inner_->IsCompleted(); }
    absl::Time CompletionTime() override { return inner_->CompletionTime(); }

   private:
    std::unique_ptr<Work> inner_;
    std::shared_ptr<Log> log_;
    int id_;
  };
  std::shared_ptr<Log> log_;
};

// The exchanges overlap the experts: with E/P = 4 local experts, every slot's rows leave
// before the first wait, and chunk c's results are issued home before chunk c + 1's rows
// are waited for (its experts then run while they travel), in forward and in backward.
// The chunks are one expert wide on one compute thread and two wide on two. The results
// still match the reference.
TEST(DispatchTest, ExchangesArePipelinedWithTheExperts) {
  const Problem p = MakeProblem(/*world=*/2, /*ep_size=*/2, /*E=*/8, /*K=*/2, {9, 6}, 77);
  for (int threads : {1, 2}) {
    std::vector<RankResult> results(p.world);
    std::vector<std::vector<std::string>> events(p.world);
    absl::Status status = testing::RunRanks(p.world, [&](Communicator& world) -> absl::Status {
      ScopedComputeThreads budget(threads);
      GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> copy, world.Split(0, world.rank()));
      ExchangeRecorder recorder(std::move(copy));
      GRADSUM_RETURN_IF_ERROR(test::RunDispatchOnRank(recorder, p, &results[world.rank()]));
      events[world.rank()] = recorder.events();
      return absl::OkStatus();
    });
    ASSERT_TRUE(status.ok()) << status;
    // Per pass (forward: exchanges 0-7, backward: 8-15): dispatch slots 0-3, returns 4-7.
    std::vector<std::string> want;
    for (int base : {0, 8}) {
      for (int j = 0; j < 4; ++j) want.push_back(absl::StrCat("i", base + j));
      for (int j0 = 0; j0 < 4; j0 += threads) {
        for (int j = j0; j < j0 + threads; ++j) want.push_back(absl::StrCat("w", base + j));
        for (int j = j0; j < j0 + threads; ++j) want.push_back(absl::StrCat("i", base + 4 + j));
      }
      for (int j = 0; j < 4; ++j) want.push_back(absl::StrCat("w", base + 4 + j));
    }
    for (int r = 0; r < p.world; ++r) {
      EXPECT_THAT(events[r], ElementsAreArray(want))
          << "rank " << r << ", " << threads << " compute threads";
      test::ExpectRankMatchesReference(p, r, results[r]);
    }
  }
}

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
  std::vector<RankResult> results(p.world);
  absl::Status status = testing::RunRanks(p.world, [&](Communicator& world) {
    return test::RunDispatchOnRank(world, p, &results[world.rank()]);
  });
  ASSERT_TRUE(status.ok()) << status;
  for (const RankResult& r : results) {
    EXPECT_TRUE(r.y.empty());
    for (const std::vector<float>* g : {&r.dwg, &r.dwu, &r.dwd}) {
      ASSERT_FALSE(g->empty());
      for (float v : *g) EXPECT_EQ(v, 0.0f);
    }
  }
}

TEST(DispatchTest, UnevenExpertSplitIsInvalidArgumentNamingEAndP) {
  Problem p = MakeProblem(4, 4, 6, 2, {2, 2, 2, 2}, 80);
  absl::Status s = testing::RunRanks(4, [&](Communicator& comm) -> absl::Status {
    std::vector<float> w(1), a = test::ToFloat(p.a[comm.rank()]),
                             cw = test::ToFloat(p.cw[comm.rank()]);
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
    EXPECT_THAT(
        forward(p.config(), std::vector<float>(17), p.idx[0], cw, absl::MakeSpan(y)).message(),
        HasSubstr("not a multiple of D=6"));
    EXPECT_THAT(forward(p.config(), a, std::vector<int32_t>(5, 0), cw, absl::MakeSpan(y)).message(),
                HasSubstr("expert_index has 5"));
    EXPECT_THAT(
        forward(p.config(), a, p.idx[0], std::vector<float>(7), absl::MakeSpan(y)).message(),
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
    EXPECT_THAT(
        DispatchCombineBackward(comm, p.config(), {wg, wu, wd}, state, y, absl::MakeSpan(d_a),
                                absl::MakeSpan(d_cw),
                                {absl::MakeSpan(dwg), absl::MakeSpan(bad), absl::MakeSpan(dwd)})
            .message(),
        HasSubstr("dWu has 4"));
    EXPECT_THAT(DispatchCombineBackward(comm, p.config(), {wg, bad, wd}, state, y,
                                        absl::MakeSpan(d_a), absl::MakeSpan(d_cw), grads)
                    .message(),
                HasSubstr("Wu has 4"));
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
