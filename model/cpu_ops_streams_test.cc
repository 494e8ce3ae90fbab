// The host ops' label streams (model/ops.h MicroBatchInputs::extra_streams): Begin checks
// their number against the spec and their lengths against the rows, naming the stream; the
// stream-indexed embedding reads stream j's tokens and refuses a stream the micro-batch has
// not; an evaluation (forward_only) takes none.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/mesh.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/cpu_ops.h"
#include "testing/run_ranks.h"

namespace gradsum::model {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kVocab = 8, kDim = 4, kRows = 3;

MoeLmConfig TwoStreamsBeyondMain() {
  MoeLmConfig c;
  c.vocab = kVocab;
  c.dim = kDim;
  c.layers = 1;
  c.experts = 2;
  c.top_k = 1;
  c.expert_dim = 4;
  c.mtp_depth = 2;  // label streams 0, 1, 2
  c.mtp_scale = 0.5;
  return c;
}

// Runs `body` with the host ops of TwoStreamsBeyondMain() on a world of one.
absl::Status WithOps(const std::function<absl::Status(ModelOps&)>& body) {
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(TwoStreamsBeyondMain());
  if (!spec.ok()) return spec.status();
  return testing::RunRanks(1, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh, Mesh::Create(&comm, MeshShape{}));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<ModelOps> ops, MakeCpuOps(*spec, *mesh, {}));
    return body(*ops);
  });
}

struct Batch {
  std::vector<int32_t> tokens = {1, 2, 3}, labels = {2, 3, 4}, mask = {1, 1, 1};
  std::vector<int32_t> tokens1 = {2, 3, 0}, labels1 = {3, 4, -100};
  std::vector<int32_t> tokens2 = {3, 0, 0}, labels2 = {4, -100, -100};
  MicroBatchInputs Inputs() const {
    MicroBatchInputs in;
    in.rows = kRows;
    in.tokens = tokens;
    in.labels = labels;
    in.mask = mask;
    in.global_ce_weight_sum = 3;
    in.global_routed_tokens = 3;
    in.extra_streams = {{tokens1, labels1, {}, 2.0}, {tokens2, labels2, {}, 1.0}};
    return in;
  }
};

TEST(CpuOpsStreamsTest, BeginNamesAMissingOrMisSizedStream) {
  const Batch b;
  absl::Status s = WithOps([&](ModelOps& ops) -> absl::Status {
    MicroBatchInputs in = b.Inputs();
    in.extra_streams.pop_back();
    absl::Status one = ops.Begin(in);
    EXPECT_EQ(one.code(), absl::StatusCode::kInvalidArgument) << one;
    EXPECT_THAT(std::string(one.message()), HasSubstr("1 extra label streams, the model has 2"));
    in = b.Inputs();
    const std::vector<int32_t> short_labels = {4, -100};
    in.extra_streams[1].labels = short_labels;
    absl::Status sized = ops.Begin(in);
    EXPECT_EQ(sized.code(), absl::StatusCode::kInvalidArgument) << sized;
    EXPECT_THAT(std::string(sized.message()), HasSubstr("label stream 2's tokens, labels"));
    // An evaluation takes no extra stream.
    in = b.Inputs();
    in.extra_streams.clear();
    in.forward_only = true;
    return ops.Begin(in);
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(CpuOpsStreamsTest, EmbeddingReadsTheStreamsTokens) {
  const Batch b;
  std::vector<float> emb(kVocab * kDim);
  for (size_t i = 0; i < emb.size(); ++i) emb[i] = 0.5f * static_cast<float>(i) - 3.0f;
  absl::Status s = WithOps([&](ModelOps& ops) -> absl::Status {
    GRADSUM_RETURN_IF_ERROR(ops.Begin(b.Inputs()));
    const std::vector<int32_t>* want[] = {&b.tokens, &b.tokens1, &b.tokens2};
    for (int stream = 0; stream < 3; ++stream) {
      std::vector<float> h(kRows * kDim, -1.0f);
      GRADSUM_RETURN_IF_ERROR(ops.EmbeddingForward(stream, emb.data(), h.data()));
      for (int64_t t = 0; t < kRows; ++t) {
        for (int64_t d = 0; d < kDim; ++d) {
          EXPECT_EQ(h[t * kDim + d], emb[(*want[stream])[t] * kDim + d])
              << "stream " << stream << " t " << t << " d " << d;
        }
      }
    }
    std::vector<float> h(kRows * kDim);
    absl::Status bad = ops.EmbeddingForward(3, emb.data(), h.data());
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(bad.message()), HasSubstr("label stream 3 is not in [0, 2]"));
    bad = ops.EmbeddingForward(-1, emb.data(), h.data());
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum::model
