#include "losses/display.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "collectives/communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
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

}  // namespace
}  // namespace gradsum::losses
