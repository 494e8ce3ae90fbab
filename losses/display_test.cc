#include "losses/display.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "collectives/communicator.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/exact_sum_reference.h"
#include "testing/run_ranks.h"

namespace gradsum::losses {
namespace {

using ::gradsum::testing::RunRanks;
using ::testing::HasSubstr;

TEST(StepDisplayTest, RegistryRejectsUnregisteredAndMismatchedTerms) {
  StepDisplay display(1, 3);
  ASSERT_TRUE(display.RegisterTerm("ce").ok());
  ASSERT_TRUE(display.RegisterTerm("tokens", DisplayTermKind::kMetric).ok());
  EXPECT_EQ(display.RegisterTerm("ce").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(display.RegisterTerm("").code(), absl::StatusCode::kInvalidArgument);

  absl::Status s = display.AddBackwardTerm("balance", 0.5);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'balance' has no display entry"));
  EXPECT_EQ(display.AddBackwardTerm("tokens", 1.0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(display.AddMetric("ce", 1.0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(display.AddMetric("nope", 1.0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(display.AddBackwardTerm("ce", std::nan("")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(display.AddBackwardTerm("ce", INFINITY).code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(display.AddGlobalExpertCounts(1, std::vector<int64_t>{1, 2, 3}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(display.AddGlobalExpertCounts(-1, std::vector<int64_t>{1, 2, 3}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(display.AddGlobalExpertCounts(0, std::vector<int64_t>{1, 2}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(display.AddGlobalExpertCounts(0, std::vector<int64_t>{1, -2, 3}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(StepDisplayTest, OneReduceGivesIdenticalGlobalValuesAndHistograms) {
  const int world = 3, g = 2;
  // local[r][m] = {ce, z, tokens}; counts[m][l] = global c (the same on every rank).
  auto local = [](int r, int m, int term) { return 0.125 * (r + 1) + 0.5 * m + 2.0 * term; };
  const std::vector<std::vector<std::vector<int64_t>>> counts = {{{4, 0, 2, 2}, {1, 1, 1, 1}},
                                                                 {{0, 4, 2, 2}, {2, 2, 2, 2}}};
  std::vector<StepDisplayValues> got(world);
  absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
    StepDisplay display(/*num_moe_layers=*/2, /*num_experts=*/4);
    for (const char* t : {"ce", "z_loss"}) {
      absl::Status st = display.RegisterTerm(t);
      if (!st.ok()) return st;
    }
    absl::Status st = display.RegisterTerm("tokens", DisplayTermKind::kMetric);
    if (!st.ok()) return st;
    for (int step = 0; step < 2; ++step) {  // the second step checks the reset
      for (int m = 0; m < g; ++m) {
        const int r = comm.rank();
        if (!(st = display.AddBackwardTerm("ce", local(r, m, 0))).ok()) return st;
        if (!(st = display.AddBackwardTerm("z_loss", local(r, m, 1))).ok()) return st;
        if (!(st = display.AddMetric("tokens", local(r, m, 2))).ok()) return st;
        for (int l = 0; l < 2; ++l) {
          if (!(st = display.AddGlobalExpertCounts(l, counts[m][l])).ok()) return st;
        }
      }
      absl::StatusOr<StepDisplayValues> v = display.Reduce(comm);
      if (!v.ok()) return v.status();
      got[comm.rank()] = *std::move(v);
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  double ref[3] = {0, 0, 0};
  for (int r = 0; r < world; ++r)
    for (int m = 0; m < g; ++m)
      for (int t = 0; t < 3; ++t) ref[t] += local(r, m, t);
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(got[r].terms.size(), 3u);
    EXPECT_EQ(got[r].terms[0].name, "ce");
    EXPECT_EQ(got[r].terms[2].kind, DisplayTermKind::kMetric);
    EXPECT_DOUBLE_EQ(*got[r].Value("ce"), ref[0]);
    EXPECT_DOUBLE_EQ(*got[r].Value("z_loss"), ref[1]);
    EXPECT_DOUBLE_EQ(*got[r].Value("tokens"), ref[2]);
    EXPECT_DOUBLE_EQ(got[r].total_loss, ref[0] + ref[1]);  // metrics are not in the loss
    EXPECT_EQ(got[r].Value("missing").status().code(), absl::StatusCode::kNotFound);
    // Bitwise identical on every rank.
    EXPECT_EQ(got[r].total_loss, got[0].total_loss);
    EXPECT_EQ(got[r].tokens_per_expert,
              (std::vector<std::vector<int64_t>>{{4, 4, 4, 4}, {3, 3, 3, 3}}));
    ASSERT_EQ(got[r].maxvio.size(), 2u);
    EXPECT_DOUBLE_EQ(got[r].maxvio[0], 0.0);
    EXPECT_DOUBLE_EQ(got[r].maxvio[1], 0.0);
  }
}

TEST(StepDisplayTest, MaxVioOfImbalancedAndEmptyLayers) {
  std::vector<StepDisplayValues> got(1);
  absl::Status s = RunRanks(1, [&](Communicator& comm) -> absl::Status {
    StepDisplay display(2, 4);
    absl::Status st = display.AddGlobalExpertCounts(0, std::vector<int64_t>{6, 0, 1, 1});
    if (!st.ok()) return st;
    absl::StatusOr<StepDisplayValues> v = display.Reduce(comm);
    if (!v.ok()) return v.status();
    got[0] = *std::move(v);
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_DOUBLE_EQ(got[0].maxvio[0], (6.0 - 2.0) / 2.0);  // mean 2, max 6
  EXPECT_EQ(got[0].maxvio[1], 0.0);                       // nothing routed
  EXPECT_EQ(got[0].total_loss, 0.0);
}

TEST(StepDisplayTest, CollectiveErrorsFailEveryRank) {
  enum Fault { kMissingTerm, kDifferentRegistry, kLocalCounts };
  for (Fault fault : {kMissingTerm, kDifferentRegistry, kLocalCounts}) {
    std::vector<absl::Status> status(2);
    RunRanks(2, [&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      StepDisplay display(1, 2);
      display.RegisterTerm("ce").IgnoreError();
      display.RegisterTerm(fault == kDifferentRegistry && r == 1 ? "balance" : "z_loss")
          .IgnoreError();
      display.AddBackwardTerm("ce", 1.0).IgnoreError();
      if (!(fault == kMissingTerm && r == 0)) {
        display.AddBackwardTerm(fault == kDifferentRegistry && r == 1 ? "balance" : "z_loss", 1.0)
            .IgnoreError();
      }
      // Local counts differ between ranks; global ones would not.
      const std::vector<int64_t> c =
          fault == kLocalCounts ? std::vector<int64_t>{r, 1} : std::vector<int64_t>{1, 1};
      display.AddGlobalExpertCounts(0, c).IgnoreError();
      status[r] = display.Reduce(comm).status();
      return absl::OkStatus();
    }).IgnoreError();
    for (int r = 0; r < 2; ++r) {
      switch (fault) {
        case kMissingTerm:
          EXPECT_EQ(status[r].code(), absl::StatusCode::kFailedPrecondition);
          EXPECT_THAT(std::string(status[r].message()),
                      HasSubstr("loss term 'z_loss' received no value this step on 1 of 2"));
          break;
        case kDifferentRegistry:
          EXPECT_EQ(status[r].code(), absl::StatusCode::kFailedPrecondition);
          EXPECT_THAT(std::string(status[r].message()), HasSubstr("different terms"));
          break;
        case kLocalCounts:
          EXPECT_EQ(status[r].code(), absl::StatusCode::kInvalidArgument);
          EXPECT_THAT(std::string(status[r].message()), HasSubstr("GLOBAL counts"));
          break;
      }
    }
  }
}

TEST(StepDisplayTest, DifferentTermCountsFailInTheAllReduce) {
  std::vector<absl::Status> status(2);
  RunRanks(2,
           [&](Communicator& comm) -> absl::Status {
             StepDisplay display;
             display.RegisterTerm("ce").IgnoreError();
             if (comm.rank() == 1)
               display.RegisterTerm("extra", DisplayTermKind::kMetric).IgnoreError();
             display.AddBackwardTerm("ce", 1.0).IgnoreError();
             status[comm.rank()] = display.Reduce(comm).status();
             return absl::OkStatus();
           },
           {absl::Seconds(5)})
      .IgnoreError();
  for (const absl::Status& st : status) EXPECT_FALSE(st.ok());
}

// Exact mode (SEMANTICS.md §11): per-sequence values split over ranks and micro-batches
// in different ways give the same bits, equal to an independent __int128 reference.
TEST(StepDisplayTest, ExactModeIsTheSameBitsAtEveryMesh) {
  constexpr int kSeq = 48;
  std::mt19937_64 rng(17);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> ce(kSeq), z(kSeq);
  for (int j = 0; j < kSeq; ++j) {
    ce[j] = std::ldexp(u(rng), static_cast<int>(rng() % 12));  // per-sequence losses
    z[j] = std::ldexp(u(rng), -static_cast<int>(rng() % 40));
  }
  namespace ref = ::gradsum::exact_reference;
  ref::i128 ce_units = 0, z_units = 0;
  for (int j = 0; j < kSeq; ++j) {
    ce_units += ref::Units(ce[j], -100);
    z_units += ref::Units(z[j], -100);
  }
  const double want_ce = ref::ToDouble(ce_units, -100);
  const double want_z = ref::ToDouble(z_units, -100);
  const double want_total = ref::ToDouble(ce_units + z_units, -100);
  for (int world : {1, 2, 3, 4}) {
    for (int micro : {1, 3}) {
      std::mutex mu;
      std::vector<StepDisplayValues> got(world);
      absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
        StepDisplay d(0, 0, GradPrecision::kExact);
        if (!d.exact()) return absl::InternalError("not exact");
        GRADSUM_RETURN_IF_ERROR(d.RegisterTerm("ce"));
        GRADSUM_RETURN_IF_ERROR(d.RegisterTerm("z"));
        for (int m = 0; m < micro; ++m) {
          for (int j = 0; j < kSeq; ++j) {
            const int slot = (j * 7 + world) % (world * micro);
            if (slot / world != m || slot % world != comm.rank()) continue;
            GRADSUM_RETURN_IF_ERROR(d.AddBackwardTerm("ce", ce[j]));
            GRADSUM_RETURN_IF_ERROR(d.AddBackwardTerm("z", z[j]));
          }
        }
        GRADSUM_ASSIGN_OR_RETURN(StepDisplayValues v, d.Reduce(comm));
        std::lock_guard<std::mutex> lock(mu);
        got[comm.rank()] = v;
        return absl::OkStatus();
      });
      ASSERT_TRUE(s.ok()) << "world " << world << ": " << s;
      for (const StepDisplayValues& v : got) {
        EXPECT_EQ(*v.Value("ce"), want_ce) << world << " " << micro;
        EXPECT_EQ(*v.Value("z"), want_z) << world << " " << micro;
        EXPECT_EQ(v.total_loss, want_total) << world << " " << micro;
      }
    }
  }
  // The exact sum is also accurate: within a double's rounding of the long-double sum.
  long double sum = 0;
  for (double x : ce) sum += x;
  EXPECT_NEAR(want_ce, static_cast<double>(sum), std::fabs(want_ce) * 1e-15);
}

TEST(StepDisplayTest, ExactModeRejectsOutOfRangeValues) {
  StepDisplay d(0, 0, GradPrecision::kExact);
  ASSERT_TRUE(d.RegisterTerm("ce").ok());
  absl::Status s = d.AddBackwardTerm("ce", std::ldexp(1.0, 60));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'ce'"));
  EXPECT_EQ(d.AddBackwardTerm("ce", std::nan("")).code(), absl::StatusCode::kInvalidArgument);
}

// A rank's own sums before Reduce (the trainer's per-rank mean CE), in both modes; Reduce
// clears them; an unknown name is NotFound.
TEST(StepDisplayTest, LocalValueIsThisRanksSumBeforeReduce) {
  for (GradPrecision precision : {GradPrecision::kF32, GradPrecision::kExact}) {
    StepDisplay d(0, 0, precision);
    ASSERT_TRUE(d.RegisterTerm("ce").ok());
    ASSERT_TRUE(d.RegisterTerm("tokens", DisplayTermKind::kMetric).ok());
    ASSERT_TRUE(d.AddBackwardTerm("ce", 0.25).ok());
    ASSERT_TRUE(d.AddBackwardTerm("ce", 0.5).ok());
    ASSERT_TRUE(d.AddMetric("tokens", 3).ok());
    EXPECT_EQ(*d.LocalValue("ce"), 0.75);
    EXPECT_EQ(*d.LocalValue("tokens"), 3);
    EXPECT_EQ(d.LocalValue("nope").status().code(), absl::StatusCode::kNotFound);
    const absl::Status reduced = RunRanks(1, [&](Communicator& c) { return d.Reduce(c).status(); });
    ASSERT_TRUE(reduced.ok()) << reduced;
    EXPECT_EQ(*d.LocalValue("ce"), 0);
  }
}

TEST(StepDisplayTest, MixedExactAndF64RanksFail) {
  auto statuses = ::gradsum::testing::RunRanksPerRank(2, [&](Communicator& comm) -> absl::Status {
    StepDisplay d(0, 0, comm.rank() == 0 ? GradPrecision::kExact : GradPrecision::kF32);
    GRADSUM_RETURN_IF_ERROR(d.RegisterTerm("ce"));
    GRADSUM_RETURN_IF_ERROR(d.AddBackwardTerm("ce", 1.0));
    return d.Reduce(comm).status();
  });
  ASSERT_TRUE(statuses.ok());
  for (const absl::Status& s : *statuses) EXPECT_FALSE(s.ok());
}

// kMetricMax / kMetricMin (SEMANTICS.md §8, §13): reduced over micro-batches and ranks with
// MAX / MIN, not summed; a rank that adds nothing does not count; SUM stays the default
// kind; the accumulators reset between steps; exact mode reduces them the same way.
TEST(StepDisplayTest, MaxAndMinMetricsReduceWithMaxAndMin) {
  const int world = 3, g = 2;
  // value(r, m): rank 2 adds nothing to the extremes (as a rank with no valid tokens).
  auto value = [](int step, int r, int m) { return 0.5 * r - 1.25 * m + 10.0 * step; };
  for (GradPrecision precision : {GradPrecision::kF32, GradPrecision::kExact}) {
    std::mutex mu;
    std::vector<std::vector<StepDisplayValues>> got(2, std::vector<StepDisplayValues>(world));
    absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
      StepDisplay d(0, 0, precision);
      GRADSUM_RETURN_IF_ERROR(d.RegisterTerm("loss"));
      GRADSUM_RETURN_IF_ERROR(d.RegisterTerm("ratio_sum", DisplayTermKind::kMetric));
      GRADSUM_RETURN_IF_ERROR(d.RegisterTerm("ratio_max", DisplayTermKind::kMetricMax));
      GRADSUM_RETURN_IF_ERROR(d.RegisterTerm("ratio_min", DisplayTermKind::kMetricMin));
      GRADSUM_RETURN_IF_ERROR(d.RegisterTerm("never", DisplayTermKind::kMetricMax));
      // A max metric is a metric, not a loss term.
      if (d.AddBackwardTerm("ratio_max", 1.0).code() != absl::StatusCode::kFailedPrecondition) {
        return absl::InternalError("a max metric accepted a backward value");
      }
      if (d.AddMetric("ratio_min", INFINITY).code() != absl::StatusCode::kInvalidArgument) {
        return absl::InternalError("a min metric accepted +inf");
      }
      for (int step = 0; step < 2; ++step) {
        for (int m = 0; m < g; ++m) {
          const double v = value(step, comm.rank(), m);
          GRADSUM_RETURN_IF_ERROR(d.AddBackwardTerm("loss", v));
          GRADSUM_RETURN_IF_ERROR(d.AddMetric("ratio_sum", v));
          if (comm.rank() == 2) continue;
          GRADSUM_RETURN_IF_ERROR(d.AddMetric("ratio_max", v));
          GRADSUM_RETURN_IF_ERROR(d.AddMetric("ratio_min", v));
        }
        GRADSUM_ASSIGN_OR_RETURN(StepDisplayValues v, d.Reduce(comm));
        std::lock_guard<std::mutex> lock(mu);
        got[step][comm.rank()] = v;
      }
      return absl::OkStatus();
    });
    ASSERT_TRUE(s.ok()) << s;
    for (int step = 0; step < 2; ++step) {
      double sum = 0.0;
      for (int r = 0; r < world; ++r)
        for (int m = 0; m < g; ++m) sum += value(step, r, m);
      // Ranks 0 and 1 only: max at r = 1, m = 0; min at r = 0, m = 1.
      const double want_max = value(step, 1, 0), want_min = value(step, 0, 1);
      for (int r = 0; r < world; ++r) {
        const StepDisplayValues& v = got[step][r];
        EXPECT_EQ(*v.Value("ratio_max"), want_max) << step << " " << r;
        EXPECT_EQ(*v.Value("ratio_min"), want_min) << step << " " << r;
        EXPECT_EQ(*v.Value("never"), 0.0);  // no rank added a value
        EXPECT_DOUBLE_EQ(*v.Value("ratio_sum"), sum);
        // Only the loss term is in the total, not the metrics of any kind.
        EXPECT_DOUBLE_EQ(v.total_loss, sum);
        ASSERT_EQ(v.terms.size(), 5u);
        EXPECT_EQ(v.terms[2].kind, DisplayTermKind::kMetricMax);
        EXPECT_EQ(v.terms[3].kind, DisplayTermKind::kMetricMin);
      }
    }
  }
}

}  // namespace
}  // namespace gradsum::losses
