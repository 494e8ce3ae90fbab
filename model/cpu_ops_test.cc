// The host ops' attention pieces against straightforward references: the kv-group sum's
// order, RoPE's inverse, and the projections' gradients against a finite difference. (The
// layouts' packing with the Ulysses exchanges: model/parallel_attention_test.cc.)
#include "model/cpu_ops.h"

#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/mesh.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "model/attention_testing.h"
#include "model/layers.h"
#include "testing/run_ranks.h"

namespace gradsum::model {
namespace {

using testing::AttentionConfig;

TEST(CpuOpsAttentionTest, KvGroupSumAddsInHeadOrderAndRopeInverts) {
  const MoeLmConfig c = AttentionConfig(4, 2);
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok());
  absl::Status s = gradsum::testing::RunRanks(1, [&](Communicator& comm) -> absl::Status {
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
