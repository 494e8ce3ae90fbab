#include "moe/ep_exchange.h"

#include <algorithm>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "collectives/thread_backend.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"

namespace gradsum::moe {
namespace {

// One simulated EP rank: its copies sorted by expert (stable), as ids (rank, copy).
struct SimRank {
  std::vector<int> expert_of_row;           // destination expert of each sent row
  std::vector<std::pair<int, int>> row_id;  // (origin rank, copy index) per sent row
  std::vector<int64_t> offsets;             // E + 1
};

SimRank Route(int rank, int tokens, int K, int E, std::mt19937& gen) {
  std::uniform_int_distribution<int> pick(-1, E - 1);  // -1: padding / unrouted copy
  std::vector<std::tuple<int, int>> copies;            // (expert, copy)
  for (int c = 0; c < tokens * K; ++c) {
    const int e = pick(gen);
    if (e >= 0) copies.push_back({e, c});
  }
  std::stable_sort(copies.begin(), copies.end(),
                   [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  SimRank s;
  s.offsets.assign(E + 1, 0);
  for (const auto& [e, c] : copies) {
    s.expert_of_row.push_back(e);
    s.row_id.push_back({rank, c});
    ++s.offsets[e + 1];
  }
  for (int e = 0; e < E; ++e) s.offsets[e + 1] += s.offsets[e];
  return s;
}

// Moves `send[p]` (elements) to every rank as Communicator::AllToAllV would, checking that
// the two sides agree on every count.
template <typename T>
std::vector<std::vector<T>> AllToAllV(const std::vector<std::vector<T>>& send,
                                      const std::vector<EpExchangePlan>& plans, bool reverse) {
  const int P = static_cast<int>(plans.size());
  std::vector<std::vector<T>> recv(P);
  for (int q = 0; q < P; ++q) {
    const EpExchangePlan& to = plans[q];
    size_t total = 0;
    for (size_t c : reverse ? to.send_counts : to.recv_counts) total += c;
    recv[q].assign(total, T{});
    for (int p = 0; p < P; ++p) {
      const EpExchangePlan& from = plans[p];
      const size_t n = reverse ? from.recv_counts[q] : from.send_counts[q];
      const size_t want = reverse ? to.send_counts[p] : to.recv_counts[p];
      EXPECT_EQ(n, want) << "ranks " << p << " -> " << q << " disagree";
      const size_t src = reverse ? from.recv_offsets[q] : from.send_offsets[q];
      const size_t dst = reverse ? to.send_offsets[p] : to.recv_offsets[p];
      for (size_t i = 0; i < std::min(n, want); ++i) recv[q][dst + i] = send[p][src + i];
    }
  }
  return recv;
}

TEST(EpExchangeTest, EveryRoutedCopyReachesItsExpertGroupedBySourceAndComesBack) {
  std::mt19937 gen(7);
  for (int P : {1, 2, 3, 4}) {
    for (int El : {1, 3}) {
      const int E = P * El, K = 2;
      std::vector<SimRank> ranks;
      for (int r = 0; r < P; ++r) ranks.push_back(Route(r, r == 1 ? 0 : 5 + 3 * r, K, E, gen));
      // What the count exchange delivers: peer_counts[q][p * El + j] = rows p sends to
      // expert q * El + j, counted from the routing directly.
      std::vector<EpExchangePlan> plans;
      for (int q = 0; q < P; ++q) {
        std::vector<int64_t> peer(P * El, 0);
        for (int p = 0; p < P; ++p) {
          for (int e : ranks[p].expert_of_row) {
            if (e / El == q) ++peer[p * El + e % El];
          }
        }
        auto plan = PlanEpExchange(ranks[q].offsets, peer, P, /*width=*/1);
        ASSERT_TRUE(plan.ok()) << plan.status();
        plans.push_back(*plan);
      }
      std::vector<std::vector<std::pair<int, int>>> send(P);
      for (int p = 0; p < P; ++p) send[p] = ranks[p].row_id;
      const auto recv = AllToAllV(send, plans, /*reverse=*/false);
      // Receive side: source p's block, then local expert j's rows, hold exactly the copies
      // p routed to expert q * El + j, in p's send order.
      size_t delivered = 0, routed = 0;
      for (int p = 0; p < P; ++p) routed += ranks[p].row_id.size();
      for (int q = 0; q < P; ++q) {
        const EpExchangePlan& x = plans[q];
        ASSERT_EQ(static_cast<int64_t>(recv[q].size()), x.recv_rows);
        for (int p = 0; p < P; ++p) {
          for (int j = 0; j < El; ++j) {
            std::vector<std::pair<int, int>> want;
            for (size_t i = 0; i < ranks[p].row_id.size(); ++i) {
              if (ranks[p].expert_of_row[i] == q * El + j) want.push_back(ranks[p].row_id[i]);
            }
            const int64_t begin = x.source_first_row[p] + x.source_offsets[p][j];
            const int64_t end = x.source_first_row[p] + x.source_offsets[p][j + 1];
            ASSERT_EQ(end - begin, static_cast<int64_t>(want.size()))
                << "P " << P << " El " << El << " q " << q << " p " << p << " j " << j;
            for (int64_t i = begin; i < end; ++i) EXPECT_EQ(recv[q][i], want[i - begin]);
            delivered += want.size();
          }
        }
      }
      EXPECT_EQ(delivered, routed);
      // The reverse exchange returns every row to its home position.
      const auto back = AllToAllV(recv, plans, /*reverse=*/true);
      for (int p = 0; p < P; ++p) EXPECT_EQ(back[p], send[p]) << "P " << P << " rank " << p;
    }
  }
}

// The count exchange over a real communicator (thread backend) delivers exactly what the
// plan expects: peer_counts[p * El + j] = rows rank p routes to my local expert j.
TEST(EpExchangeTest, ExchangeExpertCountsDeliversEachSourcesCountsForMyExperts) {
  for (int P : {1, 2, 3, 4}) {
    const int El = 2, E = P * El;
    std::mt19937 gen(11 + P);
    std::vector<SimRank> ranks;
    for (int r = 0; r < P; ++r) ranks.push_back(Route(r, 4 + 5 * r, 2, E, gen));
    std::vector<std::vector<int64_t>> got(P);
    absl::Status s = testing::RunRanks(P, [&](Communicator& comm) -> absl::Status {
      auto peer = ExchangeExpertCounts(comm, ranks[comm.rank()].offsets);
      if (!peer.ok()) return peer.status();
      got[comm.rank()] = *peer;
      return absl::OkStatus();
    });
    ASSERT_TRUE(s.ok()) << s;
    for (int q = 0; q < P; ++q) {
      std::vector<int64_t> want(P * El, 0);
      for (int p = 0; p < P; ++p) {
        for (int e : ranks[p].expert_of_row) {
          if (e / El == q) ++want[p * El + e % El];
        }
      }
      EXPECT_EQ(got[q], want) << "P " << P << " rank " << q;
    }
  }
  // Bad offsets fail before any communication (a one-rank group cannot hang).
  auto one = CreateThreadCommunicators(1);
  ASSERT_TRUE(one.ok());
  auto bad = ExchangeExpertCounts(*(*one)[0], std::vector<int64_t>{0, 4, 2});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
}

TEST(EpExchangeTest, CountsAndOffsetsScaleWithTheRowWidth) {
  const std::vector<int64_t> offsets = {0, 2, 2, 7, 9};  // E = 4, P = 2, El = 2
  const std::vector<int64_t> peer = {1, 0, 3, 4};
  auto x = PlanEpExchange(offsets, peer, 2, /*width=*/16);
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(x->send_counts, (std::vector<size_t>{2 * 16, 7 * 16}));
  EXPECT_EQ(x->send_offsets, (std::vector<size_t>{0, 2 * 16}));
  EXPECT_EQ(x->recv_counts, (std::vector<size_t>{1 * 16, 7 * 16}));
  EXPECT_EQ(x->recv_offsets, (std::vector<size_t>{0, 1 * 16}));
  EXPECT_EQ(x->source_first_row, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(x->source_offsets[1], (std::vector<int64_t>{0, 3, 7}));
  EXPECT_EQ(x->recv_rows, 8);
}

TEST(EpExchangeTest, BadInputIsInvalidArgumentNamingTheValue) {
  auto check = [](absl::StatusOr<EpExchangePlan> r, const char* what) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(r.status().message().find(what), absl::string_view::npos) << r.status();
  };
  const std::vector<int64_t> ok_offsets = {0, 1, 3, 3, 4};
  const std::vector<int64_t> ok_peer = {0, 0, 0, 0};
  check(PlanEpExchange(ok_offsets, ok_peer, 0, 1), "ep_size = 0");
  check(PlanEpExchange(ok_offsets, ok_peer, 3, 1), "not divisible by ep_size 3");
  check(PlanEpExchange(ok_offsets, ok_peer, 2, -1), "width = -1");
  check(PlanEpExchange({5, 6, 7, 8, 9}, ok_peer, 2, 1), "expert_offsets[0] = 5");
  check(PlanEpExchange({0, 3, 2, 4, 4}, ok_peer, 2, 1), "decrease at 2: 3 -> 2");
  check(PlanEpExchange(ok_offsets, {0, 0, 0}, 2, 1), "peer_counts has 3 entries");
  check(PlanEpExchange(ok_offsets, {0, -2, 0, 0}, 2, 1), "peer_counts[1] = -2");
  check(PlanEpExchange({0}, {}, 1, 1), "expert_offsets has 1 entries");
}

}  // namespace
}  // namespace gradsum::moe
