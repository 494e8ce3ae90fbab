#include "data/shard.h"

#include <cstdint>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::data {
namespace {

using ::testing::HasSubstr;

// The positions a rank holds, in local order.
std::vector<int64_t> Positions(const SequenceShard& shard) {
  std::vector<int64_t> out;
  for (int64_t u = 0; u < shard.local_len(); ++u) out.push_back(shard.Position(u));
  return out;
}

struct Layout {
  int cp, sp;
  // want[cp_rank][sp_rank]: the positions, in local order.
  std::vector<std::vector<std::vector<int64_t>>> want;
};

// Sequences of 8 tokens, written out by hand: CP rank i holds chunks i and 2C-1-i of the 2C
// chunks, in that order, and SP rank k of it the k-th slice of those.
TEST(SequenceShardTest, ZigzagPositionsAsWrittenOut) {
  const std::vector<Layout> layouts = {
      {1, 1, {{{0, 1, 2, 3, 4, 5, 6, 7}}}},
      {1, 2, {{{0, 1, 2, 3}, {4, 5, 6, 7}}}},
      {2, 1, {{{0, 1, 6, 7}}, {{2, 3, 4, 5}}}},
      {2, 2, {{{0, 1}, {6, 7}}, {{2, 3}, {4, 5}}}},
      {4, 1, {{{0, 7}}, {{1, 6}}, {{2, 5}}, {{3, 4}}}},
      {4, 2, {{{0}, {7}}, {{1}, {6}}, {{2}, {5}}, {{3}, {4}}}},
  };
  for (const Layout& l : layouts) {
    for (int i = 0; i < l.cp; ++i) {
      for (int k = 0; k < l.sp; ++k) {
        SCOPED_TRACE(absl::StrCat("cp ", l.cp, " rank ", i, ", sp ", l.sp, " rank ", k));
        absl::StatusOr<SequenceShard> shard = SequenceShard::Create(8, l.sp, k, l.cp, i);
        ASSERT_TRUE(shard.ok()) << shard.status();
        EXPECT_EQ(shard->seq_len(), 8);
        EXPECT_EQ(shard->local_len(), 8 / (l.cp * l.sp));
        EXPECT_EQ(Positions(*shard), l.want[i][k]);
      }
    }
  }
}

// The same against an enumeration built from the definition, for C = 1, 2, 4 and S = 1, 2 on
// sequences of 32 tokens: the chunks' positions listed in the CP rank's order, cut into S
// slices. LocalIndex inverts Position, is -1 on every other position, and the C S ranks hold
// each position exactly once.
TEST(SequenceShardTest, ZigzagPositionsMatchAnEnumerationAndCoverTheSequenceOnce) {
  const int64_t L = 32;
  for (int C : {1, 2, 4}) {
    for (int S : {1, 2}) {
      std::vector<int> held(L, 0);
      for (int i = 0; i < C; ++i) {
        // The CP rank's two chunks (one chunk of L tokens, the whole sequence, for C = 1).
        std::vector<int64_t> chunks_tokens;
        const int64_t chunk = L / (2 * C);
        const std::vector<int64_t> chunks =
            C == 1 ? std::vector<int64_t>{0, 1} : std::vector<int64_t>{i, 2 * C - 1 - i};
        for (int64_t c : chunks) {
          for (int64_t t = 0; t < chunk; ++t) chunks_tokens.push_back(c * chunk + t);
        }
        const int64_t local = L / (C * S);
        for (int k = 0; k < S; ++k) {
          SCOPED_TRACE(absl::StrCat("C ", C, " i ", i, " S ", S, " k ", k));
          absl::StatusOr<SequenceShard> shard = SequenceShard::Create(L, S, k, C, i);
          ASSERT_TRUE(shard.ok()) << shard.status();
          const std::vector<int64_t> want(chunks_tokens.begin() + k * local,
                                          chunks_tokens.begin() + (k + 1) * local);
          EXPECT_EQ(Positions(*shard), want);
          std::vector<int64_t> index(L, -1);
          for (int64_t u = 0; u < local; ++u) index[want[u]] = u;
          for (int64_t pos = 0; pos < L; ++pos) {
            EXPECT_EQ(shard->LocalIndex(pos), index[pos]) << "position " << pos;
            held[pos] += shard->LocalIndex(pos) >= 0;
          }
        }
      }
      for (int64_t pos = 0; pos < L; ++pos) EXPECT_EQ(held[pos], 1) << C << " " << S << " " << pos;
    }
  }
}

// Ring attention's index of another rank's rows is the shard's position without SP.
TEST(SequenceShardTest, ZigzagIndexIsTheCpRanksPosition) {
  for (int C : {2, 4}) {
    for (int i = 0; i < C; ++i) {
      absl::StatusOr<SequenceShard> shard = SequenceShard::Create(24 * C, 1, 0, C, i);
      ASSERT_TRUE(shard.ok());
      for (int64_t u = 0; u < shard->local_len(); ++u) {
        EXPECT_EQ(ZigzagIndex(C, i, 12, u), shard->Position(u)) << C << " " << i << " " << u;
      }
      EXPECT_EQ(ZigzagChunk(C, i, 0), i);
      EXPECT_EQ(ZigzagChunk(C, i, 1), 2 * C - 1 - i);
    }
  }
}

TEST(SequenceShardTest, BadArgumentsAreNamed) {
  auto odd = SequenceShard::Create(12, 1, 0, 4, 0);  // 2 cp = 8 does not divide 12
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(odd.status().message(), HasSubstr("cp=4"));
  auto sp = SequenceShard::Create(12, 5, 0, 1, 0);
  EXPECT_EQ(sp.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(sp.status().message(), HasSubstr("sp=5"));
  auto rank = SequenceShard::Create(16, 2, 2, 1, 0);
  EXPECT_EQ(rank.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rank.status().message(), HasSubstr("sp_rank=2"));
  auto cp_rank = SequenceShard::Create(16, 1, 0, 2, -1);
  EXPECT_EQ(cp_rank.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cp_rank.status().message(), HasSubstr("cp_rank=-1"));
  EXPECT_EQ(SequenceShard::Create(0, 1, 0, 1, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SequenceShard::Create(7, 1, 0, 1, 0).ok()) << "an odd length without CP";
}

// World 16 at SP 2 x CP 4: ranks 8 d .. 8 d + 7 are data rank d of 2, and rank r holds of
// each 32-token sequence (8 chunks of 4) chunks i = (r % 8) / 2 and 7 - i put together, the
// half r % 2 of those 8 tokens (written out here, not asked of the shard).
TEST(DataPlaceTest, RanksThatShareSequencesAreOneDataRank) {
  train::ParallelismConfig p;
  p.set_world(16);
  p.set_sp(2);
  p.set_cp(4);
  for (int r = 0; r < 16; ++r) {
    absl::StatusOr<DataPlace> place = DataPlaceOf(p, 32, r);
    ASSERT_TRUE(place.ok()) << place.status();
    EXPECT_EQ(place->data_rank, r / 8);
    EXPECT_EQ(place->data_ranks, 2);
    ASSERT_EQ(place->shard.seq_len(), 32);
    ASSERT_EQ(place->shard.local_len(), 4);
    const int i = (r % 8) / 2, half = r % 2;
    for (int u = 0; u < 4; ++u) {
      const int v = half * 4 + u;
      const int pos = v < 4 ? i * 4 + v : (7 - i) * 4 + v - 4;
      EXPECT_EQ(place->shard.Position(u), pos) << "rank " << r << " u " << u;
    }
  }
  // Without SP or CP every rank is its own data rank with whole sequences.
  p.set_sp(1);
  p.set_cp(1);
  absl::StatusOr<DataPlace> whole = DataPlaceOf(p, 32, 5);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->data_rank, 5);
  EXPECT_EQ(whole->data_ranks, 16);
  EXPECT_EQ(whole->shard.local_len(), 32);
}

TEST(DataPlaceTest, BadArgumentsAreNamed) {
  train::ParallelismConfig p;
  p.set_world(16);
  p.set_sp(2);
  p.set_cp(4);
  absl::StatusOr<DataPlace> place = DataPlaceOf(p, 32, 16);
  EXPECT_EQ(place.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(place.status().message(), HasSubstr("rank=16"));
  p.set_sp(3);
  place = DataPlaceOf(p, 32, 0);
  EXPECT_EQ(place.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(place.status().message(), HasSubstr("parallelism.sp=3"));
  p.set_world(12);
  p.set_sp(2);
  p.set_cp(3);
  place = DataPlaceOf(p, 32, 0);  // 2 cp = 6 does not divide 32
  EXPECT_EQ(place.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(place.status().message(), HasSubstr("cp=3"));
}

// ContiguousPiece against an explicit enumeration: every rank's global positions in the
// order it holds them (the zigzag chunks j and 2C - 1 - j, then its SP slice), cut into
// runs of consecutive positions; a block tiles them at the same global places as at
// sp = cp = 1 exactly when it divides every run's start and length.
TEST(ContiguousPieceTest, IsTheGcdOfEveryRanksRuns) {
  for (int64_t seq_len : {32, 96, 128, 48}) {
    for (int sp = 1; sp <= 4; ++sp) {
      for (int cp = 1; cp <= 4; ++cp) {
        if ((cp > 1 && seq_len % (2 * cp) != 0) || (seq_len / cp) % sp != 0) continue;
        if (cp == 1 && seq_len % sp != 0) continue;
        int64_t g = 0;
        for (int j = 0; j < cp; ++j) {
          std::vector<int64_t> local;  // the CP rank's tokens, in its order
          if (cp == 1) {
            for (int64_t t = 0; t < seq_len; ++t) local.push_back(t);
          } else {
            const int64_t c = seq_len / (2 * cp);
            for (int64_t chunk : {int64_t{j}, int64_t{2 * cp - 1 - j}}) {
              for (int64_t t = 0; t < c; ++t) local.push_back(chunk * c + t);
            }
          }
          const int64_t slice = static_cast<int64_t>(local.size()) / sp;
          for (int i = 0; i < sp; ++i) {
            int64_t start = local[i * slice], length = 1;
            for (int64_t t = i * slice + 1; t <= (i + 1) * slice; ++t) {
              if (t < (i + 1) * slice && local[t] == local[t - 1] + 1) {
                ++length;
                continue;
              }
              g = std::gcd(g, std::gcd(start, length));
              if (t < (i + 1) * slice) start = local[t], length = 1;
            }
          }
        }
        EXPECT_EQ(ContiguousPiece(seq_len, sp, cp), g)
            << "seq_len " << seq_len << " sp " << sp << " cp " << cp;
      }
    }
  }
}

}  // namespace
}  // namespace gradsum::data
