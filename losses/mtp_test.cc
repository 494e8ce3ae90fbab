// Multi-token prediction's loss side (SEMANTICS.md §15) against a straightforward fp64
// reference: the rolled labels by hand, and at world 1, 2 and 4 with G = 2 (uneven valid
// counts, one rank whose labels are all ignored) the summed components, the reduced display
// and every gradient row equal the single-process loss of the whole batch.
#include "losses/mtp.h"

#include <cmath>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "losses/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum::losses {
namespace {

using ::gradsum::testing::RunRanks;
using ::testing::HasSubstr;
constexpr int64_t kIgnore = -100;

// Two sequences of 6: documents 0 (3 tokens), 1 (3); 2 (4), 3 (2). Labels are the next
// token inside the document, ignored on each document's last token; token 8 is a prompt
// token whose label the caller ignored.
TEST(MtpLabelsTest, RollInsideDocumentsAndSequencesByHand) {
  const std::vector<int64_t> docs = {0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3};
  const std::vector<int64_t> y = {11, 12,      kIgnore, 14,      15, kIgnore,
                                  17, kIgnore, 19,      kIgnore, 21, kIgnore};
  absl::StatusOr<std::vector<int64_t>> d1 = MtpLabels(y, docs, 6, 1);
  ASSERT_TRUE(d1.ok()) << d1.status();
  EXPECT_EQ(*d1, (std::vector<int64_t>{12, kIgnore, kIgnore, 15, kIgnore, kIgnore, kIgnore, 19,
                                       kIgnore, kIgnore, kIgnore, kIgnore}));
  absl::StatusOr<std::vector<int64_t>> d2 = MtpLabels(y, docs, 6, 2);
  ASSERT_TRUE(d2.ok()) << d2.status();
  EXPECT_EQ(*d2, (std::vector<int64_t>{kIgnore, kIgnore, kIgnore, kIgnore, kIgnore, kIgnore, 19,
                                       kIgnore, kIgnore, kIgnore, kIgnore, kIgnore}));
  // One document across the two sequences' boundary is not rolled across it.
  const std::vector<int64_t> one_doc(12, 7), all(12, 1);
  absl::StatusOr<std::vector<int64_t>> cross = MtpLabels(all, one_doc, 6, 1);
  ASSERT_TRUE(cross.ok());
  EXPECT_EQ((*cross)[5], kIgnore);
  EXPECT_EQ((*cross)[4], 1);

  EXPECT_THAT(MtpLabels(y, docs, 6, 0).status().message(), HasSubstr("depth must be >= 1, got 0"));
  EXPECT_THAT(MtpLabels(y, docs, 5, 1).status().message(), HasSubstr("seq_len 5"));
  EXPECT_EQ(MtpLabels(y, {}, 6, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

// The global batch: R ranks x G micro-batches x B sequences of S tokens, random documents,
// random logits per depth; the reference rolls each document itself.
struct Batch {
  static constexpr int64_t kS = 12, kB = 2, kV = 7;
  int ranks = 0, g = 2;
  std::vector<int64_t> tokens, docs, labels;  // [ranks * g * kB * kS], micro-batch-major
  std::vector<std::vector<float>> logits;     // [k][rows * kV]
  int64_t Rows() const { return static_cast<int64_t>(labels.size()); }
  // Rows of rank r's micro-batch m.
  int64_t First(int r, int m) const { return ((int64_t{m} * ranks + r) * kB) * kS; }
};

Batch MakeBatch(int ranks, int k, int empty_rank) {
  Batch b;
  b.ranks = ranks;
  const int64_t n = int64_t{ranks} * b.g * Batch::kB * Batch::kS;
  uint32_t state = 12345;
  auto next = [&state](uint32_t mod) {
    state = state * 1664525u + 1013904223u;
    return (state >> 8) % mod;
  };
  int64_t doc = 0;
  for (int64_t s = 0; s < n / Batch::kS; ++s) {
    int64_t left = 0;
    for (int64_t t = 0; t < Batch::kS; ++t) {
      if (left == 0) {
        left = 1 + next(6);
        ++doc;
      }
      b.docs.push_back(doc);
      b.tokens.push_back(next(Batch::kV));
      --left;
    }
  }
  b.labels.assign(n, kIgnore);
  for (int64_t t = 0; t + 1 < n; ++t) {
    if ((t + 1) % Batch::kS != 0 && b.docs[t + 1] == b.docs[t]) b.labels[t] = b.tokens[t + 1];
  }
  if (empty_rank >= 0) {  // every label of this rank ignored
    for (int m = 0; m < b.g; ++m) {
      const int64_t f = b.First(empty_rank, m);
      for (int64_t t = f; t < f + Batch::kB * Batch::kS; ++t) b.labels[t] = kIgnore;
    }
  }
  for (int j = 0; j < k; ++j) b.logits.push_back(RandomNormal(n * Batch::kV, 100 + j, 2.0f));
  return b;
}

struct Reference {
  double loss = 0;
  std::vector<std::vector<double>> grad;  // [k][rows * V]
  std::vector<double> d;                  // D_j
};

// Token mode: D_j counts the depth-j labels; depth j's label of row t is the main label of
// t + j when both are in one sequence and one document.
Reference Compute(const Batch& b, int k, double scale) {
  Reference ref;
  const int64_t n = b.Rows(), V = Batch::kV;
  ref.grad.assign(k, std::vector<double>(n * V, 0.0));
  for (int j = 1; j <= k; ++j) {
    std::vector<int64_t> y(n, kIgnore);
    double d = 0;
    for (int64_t t = 0; t + j < n; ++t) {
      if ((t + j) / Batch::kS == t / Batch::kS && b.docs[t + j] == b.docs[t])
        y[t] = b.labels[t + j];
      if (y[t] != kIgnore) d += 1;
    }
    ref.d.push_back(d);
    if (d == 0) continue;
    for (int64_t t = 0; t < n; ++t) {
      if (y[t] == kIgnore) continue;
      const float* z = b.logits[j - 1].data() + t * V;
      double mx = -INFINITY, sum = 0;
      for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double{z[v]});
      for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - mx);
      const double lse = mx + std::log(sum);
      const double c = scale / k / d;
      ref.loss += c * (lse - z[y[t]]);
      for (int64_t v = 0; v < V; ++v) {
        ref.grad[j - 1][t * V + v] = c * (std::exp(z[v] - lse) - (v == y[t] ? 1.0 : 0.0));
      }
    }
  }
  return ref;
}

TEST(MtpLossTest, EveryWorldSizeGivesTheSingleProcessLossAndGradients) {
  const int k = 2;
  const double scale = 0.1;
  for (int world : {1, 2, 4}) {
    const Batch b = MakeBatch(world, k, world > 1 ? 1 : -1);
    const Reference want = Compute(b, k, scale);
    ASSERT_GT(want.d[0], 0);
    const int64_t rows = Batch::kB * Batch::kS, V = Batch::kV;
    std::vector<std::vector<float>> grads(k, std::vector<float>(b.Rows() * V, -1.0f));
    std::vector<double> losses(world, 0.0), display(world, 0.0);
    std::vector<std::vector<double>> d(world);
    std::mutex mu;
    absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      std::vector<MtpMicroBatch> mbs;
      for (int m = 0; m < b.g; ++m) {
        const int64_t f = b.First(r, m);
        mbs.push_back({absl::MakeConstSpan(b.labels).subspan(f, rows),
                       absl::MakeConstSpan(b.docs).subspan(f, rows), Batch::kS});
      }
      GRADSUM_ASSIGN_OR_RETURN(MtpStats stats, ComputeMtpStats(comm, mbs, k));
      StepDisplay disp;
      for (int j = 1; j <= k; ++j)
        GRADSUM_RETURN_IF_ERROR(disp.RegisterTerm(absl::StrCat("mtp_", j)));
      double local = 0;
      for (int m = 0; m < b.g; ++m) {
        const int64_t f = b.First(r, m);
        for (int j = 1; j <= k; ++j) {
          std::vector<float> z(b.logits[j - 1].begin() + f * V,
                               b.logits[j - 1].begin() + (f + rows) * V);
          std::vector<float> dz(rows * V);
          GRADSUM_ASSIGN_OR_RETURN(
              CrossEntropyResult res,
              MtpCrossEntropyForwardBackward(F32Matrix(z.data(), rows, V), stats, j, m, scale,
                                             F32Matrix(dz.data(), rows, V)));
          local += res.local_loss;
          GRADSUM_RETURN_IF_ERROR(AddMtpToDisplay(disp, res, j));
          std::lock_guard<std::mutex> lock(mu);
          std::copy(dz.begin(), dz.end(), grads[j - 1].begin() + f * V);
        }
      }
      GRADSUM_ASSIGN_OR_RETURN(StepDisplayValues v, disp.Reduce(comm));
      std::lock_guard<std::mutex> lock(mu);
      losses[r] = local;
      display[r] = v.total_loss;
      d[r] = stats.global_weight_sum;
      return absl::OkStatus();
    });
    ASSERT_TRUE(s.ok()) << s;
    double sum = 0;
    for (int r = 0; r < world; ++r) {
      sum += losses[r];
      EXPECT_NEAR(display[r], want.loss, 1e-6) << "world " << world << " rank " << r;
      ASSERT_EQ(d[r].size(), 2u);
      EXPECT_EQ(d[r][0], want.d[0]) << "D_1 is an exact count";
      EXPECT_EQ(d[r][1], want.d[1]);
    }
    EXPECT_NEAR(sum, want.loss, 1e-6) << "world " << world;
    for (int j = 0; j < k; ++j) {
      for (int64_t i = 0; i < b.Rows() * V; ++i) {
        ASSERT_NEAR(grads[j][i], want.grad[j][i], 1e-6)
            << "world " << world << " depth " << j + 1 << " element " << i;
      }
    }
    if (world > 1) {  // the rank whose labels are all ignored: exactly zero
      for (int m = 0; m < b.g; ++m) {
        for (int64_t i = b.First(1, m) * V; i < (b.First(1, m) + rows) * V; ++i) {
          ASSERT_EQ(grads[0][i], 0.0f);
          ASSERT_EQ(grads[1][i], 0.0f);
        }
      }
    }
  }
}

TEST(MtpLossTest, BadInputIsNamedOnItsRankAndTheOthersReturnToo) {
  const std::vector<int64_t> y(8, 1), docs(8, 0);
  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    const MtpMicroBatch mb{y, docs, comm.rank() == 0 ? 8 : 3};  // rank 1: 3 does not divide 8
    absl::StatusOr<MtpStats> st = ComputeMtpStats(comm, {&mb, 1}, 1);
    if (comm.rank() == 1) {
      if (st.status().code() != absl::StatusCode::kInvalidArgument ||
          st.status().message().find("seq_len 3") == absl::string_view::npos) {
        return absl::InternalError(absl::StrCat("rank 1: ", st.status().ToString()));
      }
    } else if (st.status().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError(absl::StrCat("rank 0: ", st.status().ToString()));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  // An index or a scale out of range.
  absl::Status one = RunRanks(1, [&](Communicator& comm) -> absl::Status {
    const MtpMicroBatch mb{y, docs, 8};
    GRADSUM_ASSIGN_OR_RETURN(MtpStats st, ComputeMtpStats(comm, {&mb, 1}, 2));
    std::vector<float> z(8 * 3, 0.0f), dz(8 * 3);
    const TensorView zv = F32Matrix(z.data(), 8, 3), dzv = F32Matrix(dz.data(), 8, 3);
    auto msg = [&](int j, int m, double sc) {
      return std::string(MtpCrossEntropyForwardBackward(zv, st, j, m, sc, dzv).status().message());
    };
    if (msg(3, 0, 0.1).find("depth index 3 is not in [1, 2]") == std::string::npos ||
        msg(1, 1, 0.1).find("micro-batch index 1") == std::string::npos ||
        msg(1, 0, 2.5).find("mtp_scale 2.5 must be in (0, k = 2]") == std::string::npos ||
        msg(1, 0, 0.0).find("mtp_scale 0") == std::string::npos) {
      return absl::InternalError("an out-of-range argument was not named");
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(one.ok()) << one;
}

}  // namespace
}  // namespace gradsum::losses
