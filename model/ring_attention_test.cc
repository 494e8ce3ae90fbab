// Ring attention (model/ring_attention.h) on C = 1, 2, 4 thread-backend ranks against the
// double reference of model/attention_testing.h on the whole sequences: every rank takes its
// zigzag rows of the same q, k, v, d_out, and the rows each returns, put back in sequence
// order, must be the reference's (documents crossing chunk boundaries, padding, several
// sequences, chunks that are not a multiple of the 64-token block). The gathered schedule
// must give the bits of the whole-sequence kernel at every C. GQA (kv_heads < heads): the
// reference reads kv head h / (heads / kv_heads) for query head h, and the ring's bytes are
// counted exactly. Then the argument errors.
#include "model/ring_attention.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "data/shard.h"
#include "gtest/gtest.h"
#include "model/attention.h"
#include "model/attention_testing.h"
#include "testing/run_ranks.h"

namespace gradsum::model {
namespace {

using ::gradsum::model::testing::DocStarts;
using ::gradsum::model::testing::ExpectNear;
using ::gradsum::model::testing::RandomPieces;
using ::gradsum::model::testing::RandomTensor;
using ::gradsum::model::testing::SameBits;

struct RingCase {
  std::string name;
  RingAttentionDims dims;
  std::vector<int32_t> doc_start;
};

RingAttentionDims Dims(int64_t num_seqs, int64_t seq_len, int heads, int64_t head_dim,
                       int kv_heads = 0) {
  RingAttentionDims d;
  d.num_seqs = num_seqs;
  d.seq_len = seq_len;
  d.heads = heads;
  d.kv_heads = kv_heads;
  d.head_dim = head_dim;
  return d;
}

int KvHeads(const RingAttentionDims& d) { return d.kv_heads == 0 ? d.heads : d.kv_heads; }

// seq_len a multiple of 8 (C = 4); documents that cross the chunk boundaries at every C.
std::vector<RingCase> Cases() {
  return {
      {"one_document", Dims(1, 200, 2, 16), DocStarts({{200}})},
      {"documents_across_chunks_padding", Dims(2, 200, 2, 16),
       DocStarts({{70, 61, 50, -19}, {5, 128, 7, 50, -10}})},
      {"many_short_documents_d64", Dims(1, 96, 3, 64), DocStarts({RandomPieces(96, 9, 3, 7)})},
      {"long_chunks_d32", Dims(1, 512, 2, 32), DocStarts({{300, 150, 62}})},
      {"padding_sequence", Dims(2, 40, 1, 16), DocStarts({{-40}, {17, 23}})},
      {"gqa_two_of_four", Dims(2, 200, 4, 16, 2),
       DocStarts({{70, 61, 50, -19}, {5, 128, 7, 50, -10}})},
      {"gqa_one_of_three_d32", Dims(1, 96, 3, 32, 1), DocStarts({RandomPieces(96, 5, 3, 9)})},
  };
}

struct Whole {
  std::vector<float> q, k, v, d_out;
};

struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

// Runs forward and backward on `cp` ranks; every rank's rows go back to sequence order.
absl::StatusOr<Result> RunRing(const RingCase& c, int cp, RingSchedule schedule, const Whole& in,
                               RingAttentionTimes* times0 = nullptr) {
  const int64_t S = c.dims.num_seqs, L = c.dims.seq_len, H = c.dims.heads, d = c.dims.head_dim;
  const int64_t row = H * d, kv_row = KvHeads(c.dims) * d, local = L / cp, chunk = L / (2 * cp);
  Result r;
  r.out.assign(S * L * row, NAN);
  r.lse.assign(S * L * H, NAN);
  r.dq = r.out;
  r.dk.assign(S * L * kv_row, NAN);
  r.dv = r.dk;
  absl::Status s = gradsum::testing::RunRanks(cp, [&](Communicator& comm) -> absl::Status {
    const int i = comm.rank();
    auto take = [&](const std::vector<float>& whole, int64_t width) {
      std::vector<float> mine(S * local * width);
      for (int64_t n = 0; n < S; ++n) {
        for (int64_t u = 0; u < local; ++u) {
          const int64_t t = n * L + data::ZigzagIndex(cp, i, chunk, u);
          std::copy(whole.begin() + t * width, whole.begin() + (t + 1) * width,
                    mine.begin() + (n * local + u) * width);
        }
      }
      return mine;
    };
    auto put = [&](const std::vector<float>& mine, int64_t width, std::vector<float>* whole) {
      for (int64_t n = 0; n < S; ++n) {
        for (int64_t u = 0; u < local; ++u) {
          const int64_t t = n * L + data::ZigzagIndex(cp, i, chunk, u);
          std::copy(mine.begin() + (n * local + u) * width,
                    mine.begin() + (n * local + u + 1) * width, whole->begin() + t * width);
        }
      }
    };
    const std::vector<float> q = take(in.q, row), k = take(in.k, kv_row), v = take(in.v, kv_row);
    const std::vector<float> d_out = take(in.d_out, row);
    std::vector<float> out(q.size(), NAN), lse(S * local * H, NAN);
    std::vector<float> dq(q.size(), NAN), dk(k.size(), NAN), dv(k.size(), NAN);
    RingAttentionTimes times;
    GRADSUM_RETURN_IF_ERROR(RingAttentionForward(comm, c.dims, schedule, q, k, v, c.doc_start,
                                                 absl::MakeSpan(out), absl::MakeSpan(lse), &times));
    GRADSUM_RETURN_IF_ERROR(RingAttentionBackward(comm, c.dims, schedule, q, k, v, c.doc_start, out,
                                                  lse, d_out, absl::MakeSpan(dq),
                                                  absl::MakeSpan(dk), absl::MakeSpan(dv), &times));
    if (i == 0 && times0 != nullptr) *times0 = times;
    // Ranks write disjoint rows of the shared results.
    put(out, row, &r.out);
    put(lse, H, &r.lse);
    put(dq, row, &r.dq);
    put(dk, kv_row, &r.dk);
    put(dv, kv_row, &r.dv);
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return r;
}

Whole MakeInputs(const RingCase& c, uint32_t seed) {
  const size_t tokens = c.dims.num_seqs * c.dims.seq_len;
  const size_t n = tokens * c.dims.heads * c.dims.head_dim;
  const size_t kv = tokens * KvHeads(c.dims) * c.dims.head_dim;
  return {RandomTensor(n, seed), RandomTensor(kv, seed + 1), RandomTensor(kv, seed + 2),
          RandomTensor(n, seed + 3)};
}

AttentionDims WholeDims(const RingAttentionDims& d) {
  return ::gradsum::model::testing::Dims(d.num_seqs, d.seq_len, d.heads, KvHeads(d), d.head_dim);
}

constexpr double kTol = 1e-5;

class RingTest : public ::testing::TestWithParam<int> {};

TEST_P(RingTest, RingMatchesTheDoubleReference) {
  const int cp = GetParam();
  for (const RingCase& c : Cases()) {
    SCOPED_TRACE(absl::StrCat(c.name, " cp=", cp));
    const Whole in = MakeInputs(c, 11);
    const testing::Grads want =
        testing::Reference(WholeDims(c.dims), in.q, in.k, in.v, c.doc_start, in.d_out);
    RingAttentionTimes times;
    absl::StatusOr<Result> got = RunRing(c, cp, RingSchedule::kRing, in, &times);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectNear(got->out, want.out, kTol, "out");
    ExpectNear(got->lse, want.lse, kTol, "lse");
    ExpectNear(got->dq, want.dq, kTol, "dq");
    ExpectNear(got->dk, want.dk, kTol, "dk");
    ExpectNear(got->dv, want.dv, kTol, "dv");
    if (cp > 1) {
      EXPECT_GT(times.bytes_sent, 0);
    } else {
      EXPECT_EQ(times.bytes_sent, 0);
    }
  }
}

TEST_P(RingTest, GatheredGivesTheWholeSequenceKernelsBits) {
  const int cp = GetParam();
  for (const RingCase& c : Cases()) {
    SCOPED_TRACE(absl::StrCat(c.name, " cp=", cp));
    const Whole in = MakeInputs(c, 23);
    const AttentionDims w = WholeDims(c.dims);
    std::vector<float> out(in.q.size()), lse(c.dims.num_seqs * c.dims.seq_len * c.dims.heads);
    std::vector<float> dq(in.q.size()), dk(in.k.size()), dv(in.k.size());
    ASSERT_TRUE(
        AttentionForward(w, in.q, in.k, in.v, c.doc_start, absl::MakeSpan(out), absl::MakeSpan(lse))
            .ok());
    ASSERT_TRUE(AttentionBackward(w, in.q, in.k, in.v, c.doc_start, out, lse, in.d_out,
                                  absl::MakeSpan(dq), absl::MakeSpan(dk), absl::MakeSpan(dv))
                    .ok());
    absl::StatusOr<Result> got = RunRing(c, cp, RingSchedule::kGathered, in);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(SameBits(got->out, out));
    EXPECT_TRUE(SameBits(got->lse, lse));
    EXPECT_TRUE(SameBits(got->dq, dq));
    EXPECT_TRUE(SameBits(got->dk, dk));
    EXPECT_TRUE(SameBits(got->dv, dv));
  }
}

// The ring's bytes, counted from the schedule: forward C - 1 shifts of this rank's k and v,
// backward the same plus C shifts of the dK, dV accumulators ([num_seqs, kv_heads, 2c,
// padded head_dim] each). With GQA only the kv heads travel: heads / kv_heads times fewer
// bytes than with one kv copy per query head, for the same results.
TEST(RingAttention, GqaSendsEachKvHeadOnce) {
  const int cp = 4;
  const int64_t S = 2, L = 64, H = 4, d = 16, dp = 16, rows = S * L / cp;
  RingCase gqa{"gqa", Dims(S, L, H, d, 1), DocStarts({{40, 24}, {-64}})};
  RingCase copies{"copies", Dims(S, L, H, d), gqa.doc_start};
  Whole in = MakeInputs(gqa, 5);
  // The copies case: every query head's k, v the one kv head's.
  Whole expanded = in;
  expanded.k.assign(S * L * H * d, 0.0f);
  expanded.v = expanded.k;
  for (int64_t t = 0; t < S * L; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      std::copy_n(in.k.begin() + t * d, d, expanded.k.begin() + (t * H + h) * d);
      std::copy_n(in.v.begin() + t * d, d, expanded.v.begin() + (t * H + h) * d);
    }
  }
  for (const auto& [c, inputs, kv_heads] :
       {std::tuple<const RingCase&, const Whole&, int64_t>{gqa, in, 1}, {copies, expanded, H}}) {
    SCOPED_TRACE(c.name);
    RingAttentionTimes times;
    absl::StatusOr<Result> got = RunRing(c, cp, RingSchedule::kRing, inputs, &times);
    ASSERT_TRUE(got.ok()) << got.status();
    const int64_t kv_block = 2 * rows * kv_heads * d;  // k and v
    const int64_t accumulators = 2 * S * kv_heads * (L / cp) * dp;
    EXPECT_EQ(times.bytes_sent,
              static_cast<int64_t>(sizeof(float)) * (2 * (cp - 1) * kv_block + cp * accumulators));
    const testing::Grads want =
        testing::Reference(WholeDims(gqa.dims), in.q, in.k, in.v, gqa.doc_start, in.d_out);
    ExpectNear(got->out, want.out, kTol, "out");
    ExpectNear(got->dq, want.dq, kTol, "dq");
    if (kv_heads == 1) {
      ExpectNear(got->dk, want.dk, kTol, "dk");
      ExpectNear(got->dv, want.dv, kTol, "dv");
    } else {  // the copies' gradients sum to the shared head's
      std::vector<float> dk(S * L * d, 0.0f), dv(dk.size(), 0.0f);
      for (int64_t t = 0; t < S * L; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t c2 = 0; c2 < d; ++c2) {
            dk[t * d + c2] += got->dk[(t * H + h) * d + c2];
            dv[t * d + c2] += got->dv[(t * H + h) * d + c2];
          }
        }
      }
      ExpectNear(dk, want.dk, kTol, "summed dk");
      ExpectNear(dv, want.dv, kTol, "summed dv");
    }
  }
}

TEST(RingAttention, KvHeadsThatDoNotDivideHeadsAreNamed) {
  RingCase c{"bad", Dims(1, 32, 4, 16, 3), DocStarts({{32}})};
  absl::StatusOr<Result> got = RunRing(c, 2, RingSchedule::kRing, MakeInputs(c, 1));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("kv_heads = 3 does not divide heads = 4"),
            std::string::npos)
      << got.status();
}

INSTANTIATE_TEST_SUITE_P(Cp, RingTest, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return absl::StrCat("cp", info.param); });

TEST(RingAttention, ASeqLenThatTwoCDoesNotDivideIsNamedOnEveryRank) {
  const RingCase c{"odd", Dims(1, 12, 1, 16), DocStarts({{12}})};
  absl::StatusOr<std::vector<absl::Status>> statuses =
      gradsum::testing::RunRanksPerRank(4, [&](Communicator& comm) -> absl::Status {
        std::vector<float> x(3 * 16), lse(3);
        return RingAttentionForward(comm, c.dims, RingSchedule::kRing, x, x, x, c.doc_start,
                                    absl::MakeSpan(x), absl::MakeSpan(lse));
      });
  ASSERT_TRUE(statuses.ok()) << statuses.status();
  for (const absl::Status& s : *statuses) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("seq_len = 12"), std::string::npos) << s;
    EXPECT_NE(s.message().find("2 * cp = 8"), std::string::npos) << s;
  }
}

TEST(RingAttention, WrongSizesAndDocumentStartsAreNamed) {
  const RingCase c{"one", Dims(1, 8, 1, 16), DocStarts({{8}})};
  absl::Status s = gradsum::testing::RunRanks(2, [&](Communicator& comm) -> absl::Status {
    std::vector<float> x(4 * 16), small(3 * 16), lse(4);
    absl::Status bad_q = RingAttentionForward(comm, c.dims, RingSchedule::kRing, small, x, x,
                                              c.doc_start, absl::MakeSpan(x), absl::MakeSpan(lse));
    EXPECT_EQ(bad_q.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad_q.message().find("q holds 48 values"), std::string::npos) << bad_q;
    std::vector<int32_t> broken = c.doc_start;
    broken[5] = 3;  // continues no document
    absl::Status bad_doc =
        RingAttentionBackward(comm, c.dims, RingSchedule::kRing, x, x, x, broken, x, lse, x,
                              absl::MakeSpan(x), absl::MakeSpan(x), absl::MakeSpan(x));
    EXPECT_EQ(bad_doc.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad_doc.message().find("doc_start[5] = 3"), std::string::npos) << bad_doc;
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum::model
