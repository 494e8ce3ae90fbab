// The host ops' attention pieces against straightforward references: the Ulysses
// exchanges at S = 1, 2, 4 (every rank's head split is exactly the whole sequences of its
// query heads, key/value heads repeated to their query heads; the inverse exchange gives
// the token split back), the kv-group sum's order, RoPE's inverse, and the projections'
// gradients against a finite difference.
#include "model/cpu_ops.h"

#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/mesh.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "model/layers.h"
#include "testing/run_ranks.h"

namespace gradsum::model {
namespace {

MoeLmConfig AttentionConfig(int heads, int kv_heads) {
  MoeLmConfig c;
  c.vocab = 16;
  c.dim = heads * 4;  // head_dim 4
  c.layers = 1;
  c.experts = 4;
  c.top_k = 1;
  c.expert_dim = 4;
  c.attention = true;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  return c;
}

// A value that names its place: sequence n, position p, head h, element i.
float Tag(int64_t n, int64_t p, int64_t h, int64_t i) {
  return static_cast<float>(n * 1000000 + p * 1000 + h * 10 + i);
}

class ExchangeTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(ExchangeTest, HeadSplitHoldsWholeSequencesOfTheRanksHeads) {
  const auto [S, heads, kv_heads] = GetParam();
  const MoeLmConfig c = AttentionConfig(heads, kv_heads);
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const int64_t J = 3, seq_len = 8, L = seq_len / S, hd = 4, T = J * L, Hl = heads / S;
  const int group = heads / kv_heads;
  absl::Status s = testing::RunRanks(S, [&](Communicator& comm) -> absl::Status {
    // One group of S ranks: the EP and SP axes both span it.
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh,
                             Mesh::Create(&comm, MeshShape{.ep = S, .sp = S}));
    auto ops = MakeCpuOps(*spec, *mesh, {});
    if (!ops.ok()) return ops.status();
    const int i = comm.rank();
    std::vector<int32_t> tokens(T, 1), labels(T, 2), mask(T, 1), positions(T, 0);
    std::vector<int32_t> doc_start(J * seq_len, 0);
    MicroBatchInputs in;
    in.rows = T;
    in.tokens = tokens;
    in.labels = labels;
    in.mask = mask;
    in.sequences = J;
    in.seq_len = seq_len;
    in.positions = positions;
    in.doc_start = doc_start;
    GRADSUM_RETURN_IF_ERROR((*ops)->Begin(in));
    // This rank's tokens: positions [i L, (i + 1) L) of each sequence.
    for (bool kv : {false, true}) {
      const int heads_in = kv ? kv_heads : heads;
      std::vector<float> x(T * heads_in * hd);
      for (int64_t n = 0; n < J; ++n) {
        for (int64_t r = 0; r < L; ++r) {
          for (int64_t h = 0; h < heads_in; ++h) {
            for (int64_t e = 0; e < hd; ++e) {
              x[((n * L + r) * heads_in + h) * hd + e] = Tag(n, i * L + r, h, e);
            }
          }
        }
      }
      std::vector<float> split(J * seq_len * Hl * hd, -1.0f);
      GRADSUM_RETURN_IF_ERROR((*ops)->TokensToHeads(x.data(), kv, split.data()));
      for (int64_t n = 0; n < J; ++n) {
        for (int64_t p = 0; p < seq_len; ++p) {
          for (int64_t hl = 0; hl < Hl; ++hl) {
            const int64_t q_head = i * Hl + hl;
            const int64_t source = kv ? q_head / group : q_head;
            for (int64_t e = 0; e < hd; ++e) {
              const float got = split[((n * seq_len + p) * Hl + hl) * hd + e];
              if (got != Tag(n, p, source, e)) {
                return absl::InternalError(absl::StrCat("rank ", i, (kv ? " kv" : " q"),
                                                        ": head split at seq ", n, " pos ", p,
                                                        " head ", hl, " holds ", got));
              }
            }
          }
        }
      }
      if (kv) continue;
      // And back.
      std::vector<float> back(T * heads * hd, -1.0f);
      GRADSUM_RETURN_IF_ERROR((*ops)->HeadsToTokens(split.data(), back.data()));
      if (back != x) return absl::InternalError(absl::StrCat("rank ", i, ": round trip differs"));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(Meshes, ExchangeTest,
                         ::testing::Values(std::make_tuple(1, 4, 2), std::make_tuple(2, 4, 4),
                                           std::make_tuple(2, 4, 1), std::make_tuple(4, 4, 2),
                                           std::make_tuple(4, 8, 2)));

TEST(CpuOpsAttentionTest, KvGroupSumAddsInHeadOrderAndRopeInverts) {
  const MoeLmConfig c = AttentionConfig(4, 2);
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok());
  absl::Status s = testing::RunRanks(1, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh, Mesh::Create(&comm, MeshShape{}));
    auto ops = MakeCpuOps(*spec, *mesh, {});
    if (!ops.ok()) return ops.status();
    const int64_t T = 5, hd = 4;
    std::vector<int32_t> tokens(T, 1), labels(T, 2), mask(T, 1), positions = {0, 1, 2, 0, 7};
    std::vector<int32_t> doc_start = {0, 0, 0, 3, 3};
    MicroBatchInputs in;
    in.rows = T;
    in.tokens = tokens;
    in.labels = labels;
    in.mask = mask;
    in.sequences = 1;
    in.seq_len = T;
    in.positions = positions;
    in.doc_start = doc_start;
    GRADSUM_RETURN_IF_ERROR((*ops)->Begin(in));
    std::vector<float> x(T * 4 * hd);
    for (size_t k = 0; k < x.size(); ++k) x[k] = std::sin(0.37f * k) + 0.1f * k;
    std::vector<float> sum(T * 2 * hd);
    GRADSUM_RETURN_IF_ERROR((*ops)->SumKvGroups(x.data(), sum.data()));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < 2; ++j) {
        for (int64_t e = 0; e < hd; ++e) {
          const float want = x[(t * 4 + 2 * j) * hd + e] + x[(t * 4 + 2 * j + 1) * hd + e];
          if (sum[(t * 2 + j) * hd + e] != want) return absl::InternalError("group sum");
        }
      }
    }
    // RoPE then its inverse: back to x within rounding; position 0 is the identity.
    std::vector<float> y = x;
    GRADSUM_RETURN_IF_ERROR((*ops)->Rope(y.data(), 4, false));
    for (int64_t e = 0; e < 4 * hd; ++e) {
      if (y[e] != x[e]) return absl::InternalError("RoPE at position 0 changed a value");
    }
    GRADSUM_RETURN_IF_ERROR((*ops)->Rope(y.data(), 4, true));
    for (size_t k = 0; k < x.size(); ++k) {
      if (std::abs(y[k] - x[k]) > 1e-5f * (1 + std::abs(x[k]))) {
        return absl::InternalError(absl::StrCat("RoPE inverse at ", k, ": ", y[k], " vs ", x[k]));
      }
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum::model
