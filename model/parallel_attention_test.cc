// The attention block's exchanges (model/parallel_attention.h) over the host ops' packing,
// against straightforward references: the Ulysses exchanges at S = 1, 2, 4 (every rank's
// head split is exactly the whole sequences of its query heads, key/value heads repeated
// to their query heads; the inverse exchange gives the token split back), and the errors
// for heads the SP group does not divide and for a micro-batch of another layout. (The
// ring itself: ring_attention_test.cc; the whole model at SP / CP against a single
// process: //train:parity_test.)
#include "model/parallel_attention.h"

#include <memory>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/mesh.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "model/attention_testing.h"
#include "model/cpu_ops.h"
#include "testing/run_ranks.h"

namespace gradsum::model {
namespace {

using testing::AttentionConfig;

// A value that names its place: sequence n, position p, head h, element i.
float Tag(int64_t n, int64_t p, int64_t h, int64_t i) {
  return static_cast<float>(n * 1000000 + p * 1000 + h * 10 + i);
}

class ParallelAttentionExchangeTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(ParallelAttentionExchangeTest, HeadSplitHoldsWholeSequencesOfTheRanksHeads) {
  const auto [S, heads, kv_heads] = GetParam();
  const MoeLmConfig c = AttentionConfig(heads, kv_heads);
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const int64_t J = 3, seq_len = 8, L = seq_len / S, hd = 4, T = J * L, Hl = heads / S;
  const int group = heads / kv_heads;
  absl::Status s = gradsum::testing::RunRanks(S, [&](Communicator& comm) -> absl::Status {
    // One group of S ranks: the EP and SP axes both span it.
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh,
                             Mesh::Create(&comm, MeshShape{.ep = S, .sp = S}));
    auto ops = MakeCpuOps(*spec, *mesh, {});
    if (!ops.ok()) return ops.status();
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<ParallelAttention> attention,
                             ParallelAttention::Create(c, ops->get(), {.mesh = mesh.get()}));
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
    GRADSUM_RETURN_IF_ERROR(attention->Begin(in));
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
      GRADSUM_RETURN_IF_ERROR(attention->TokensToHeads(x.data(), kv, split.data()));
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
      GRADSUM_RETURN_IF_ERROR(attention->HeadsToTokens(split.data(), back.data()));
      if (back != x) return absl::InternalError(absl::StrCat("rank ", i, ": round trip differs"));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(Meshes, ParallelAttentionExchangeTest,
                         ::testing::Values(std::make_tuple(1, 4, 2), std::make_tuple(2, 4, 4),
                                           std::make_tuple(2, 4, 1), std::make_tuple(4, 4, 2),
                                           std::make_tuple(4, 8, 2)));

TEST(ParallelAttentionTest, HeadsTheSpGroupDoesNotDivideAreInvalidArgument) {
  const MoeLmConfig c = AttentionConfig(3, 3);
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::Status s = gradsum::testing::RunRanks(2, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh,
                             Mesh::Create(&comm, MeshShape{.ep = 2, .sp = 2}));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<ModelOps> ops, MakeCpuOps(*spec, *mesh, {}));
    absl::StatusOr<std::unique_ptr<ParallelAttention>> attention =
        ParallelAttention::Create(c, ops.get(), {.mesh = mesh.get()});
    if (attention.status().code() != absl::StatusCode::kInvalidArgument ||
        !absl::StrContains(attention.status().message(), "model.heads=3") ||
        !absl::StrContains(attention.status().message(), "sp=2")) {
      return absl::InternalError(absl::StrCat("got ", attention.status().ToString()));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(ParallelAttentionTest, AMicroBatchOfAnotherLayoutIsInvalidArgument) {
  const MoeLmConfig c = AttentionConfig(4, 2);
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::Status s = gradsum::testing::RunRanks(1, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh, Mesh::Create(&comm, MeshShape{}));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<ModelOps> ops, MakeCpuOps(*spec, *mesh, {}));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<ParallelAttention> attention,
                             ParallelAttention::Create(c, ops.get(), {.mesh = mesh.get()}));
    std::vector<int32_t> doc_start(2 * 8, 0);
    MicroBatchInputs in;
    in.rows = 15;  // not 2 sequences of 8
    in.sequences = 2;
    in.seq_len = 8;
    in.doc_start = doc_start;
    absl::Status got = attention->Begin(in);
    if (got.code() != absl::StatusCode::kInvalidArgument ||
        !absl::StrContains(got.message(), "15 tokens are not 2 sequences of 8")) {
      return absl::InternalError(absl::StrCat("rows: got ", got.ToString()));
    }
    in.rows = 16;
    in.doc_start = absl::MakeConstSpan(doc_start).subspan(1);
    got = attention->Begin(in);
    if (got.code() != absl::StatusCode::kInvalidArgument ||
        !absl::StrContains(got.message(), "15 document starts")) {
      return absl::InternalError(absl::StrCat("doc_start: got ", got.ToString()));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

// Ops whose memory is not the host's (as a GPU's): every kernel refuses; only HostMemory's
// answer matters to the block's check.
class DeviceMemoryOps : public ModelOps {
 public:
  absl::StatusOr<std::unique_ptr<DeviceArray>> Allocate(int64_t) override { return No(); }
  absl::Status Begin(const MicroBatchInputs&) override { return No(); }
  absl::Status Add(const float*, const float*, float*, int64_t) override { return No(); }
  absl::Status EmbeddingForward(int, const float*, float*) override { return No(); }
  absl::Status EmbeddingBackward(int, const float*, GradTarget) override { return No(); }
  absl::Status RmsNormForward(const float*, const float*, float*, float*) override { return No(); }
  absl::Status RmsNormBackward(const float*, const float*, const float*, const float*, float*, bool,
                               GradTarget) override {
    return No();
  }
  absl::Status MoeForward(int, const float*, const MoeWeights&, float*) override { return No(); }
  absl::Status MoeBackward(int, const float*, const MoeWeights&, const float*, float*,
                           MoeGrads) override {
    return No();
  }
  absl::Status LmHeadCrossEntropy(int, const float*, const float*, float*, GradTarget) override {
    return No();
  }
  absl::Status LmHeadLoss(const float*, const float*) override { return No(); }
  absl::Status MatMul(const float*, const float*, int64_t, int64_t, float*) override {
    return No();
  }
  absl::Status MatMulBackward(const float*, const float*, int64_t, int64_t, const float*, float*,
                              bool, GradTarget) override {
    return No();
  }
  absl::Status Rope(float*, int, bool) override { return No(); }
  absl::Status PackHeads(const float*, bool, int, float*) override { return No(); }
  absl::Status UnpackHeads(const float*, int, int64_t, float*) override { return No(); }
  absl::Status PackTokens(const float*, int, int64_t, float*) override { return No(); }
  absl::Status UnpackTokens(const float*, int, float*) override { return No(); }
  absl::Status AllToAll(MeshAxis, const float*, float*, int64_t) override { return No(); }
  absl::Status SumKvGroups(const float*, float*) override { return No(); }
  absl::Status Attention(int, const float*, const float*, const float*, float*, float*) override {
    return No();
  }
  absl::Status AttentionBackward(int, const float*, const float*, const float*, const float*,
                                 const float*, const float*, float*, float*, float*) override {
    return No();
  }
  absl::StatusOr<MicroBatchLossTerms> End() override { return No(); }

 private:
  static absl::Status No() { return absl::UnimplementedError("not a kernel of this test"); }
};

// Context parallelism's ring runs on host memory: ops whose memory is not the host's are
// refused when the block is made, naming the CP size and the kernels the ring lacks there;
// the same ops without CP (SP only) are taken.
TEST(ParallelAttentionTest, ContextParallelismOnDeviceMemoryIsUnimplemented) {
  const MoeLmConfig c = AttentionConfig(4, 2);
  absl::Status s = gradsum::testing::RunRanks(2, [&](Communicator& comm) -> absl::Status {
    DeviceMemoryOps ops;
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> cp2, Mesh::Create(&comm, MeshShape{.cp = 2}));
    absl::StatusOr<std::unique_ptr<ParallelAttention>> refused =
        ParallelAttention::Create(c, &ops, {.mesh = cp2.get()});
    if (refused.status().code() != absl::StatusCode::kUnimplemented ||
        !absl::StrContains(refused.status().message(), "cp=2") ||
        !absl::StrContains(refused.status().message(), "log-sum-exp")) {
      return absl::InternalError(absl::StrCat("cp: got ", refused.status().ToString()));
    }
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> sp2, Mesh::Create(&comm, MeshShape{.sp = 2}));
    return ParallelAttention::Create(c, &ops, {.mesh = sp2.get()}).status();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum::model
