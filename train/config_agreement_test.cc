#include "train/config_agreement.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"
#include "train/config.h"
#include "train/test_util.h"

namespace gradsum::train {
namespace {

using ::testing::HasSubstr;

// Ranks started with different configs are refused by name on every rank.
TEST(CheckRanksAgreeTest, DifferentFieldsAreNamedWithTheRanks) {
  const TrainConfig base = ResolvedConfig(TinyConfig(3, 1, 1, TrainConfig::fsdp));
  auto st = gradsum::testing::RunRanksPerRank(3, [&](Communicator& c) -> absl::Status {
    TrainConfig mine = base;
    if (c.rank() == 2) mine.set_seed(7);
    if (c.rank() >= 1) mine.mutable_optim()->set_lr(0.5);
    return CheckRanksAgree(mine, c);
  });
  ASSERT_TRUE(st.ok());
  for (int r = 0; r < 3; ++r) {
    const absl::Status& s = (*st)[r];
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("optim.lr ("));
    EXPECT_THAT(s.message(), HasSubstr(") differs: ranks {0} vs {1,2}"));
    EXPECT_THAT(s.message(), HasSubstr(") differs: ranks {0,1} vs {2}"));
  }
  EXPECT_THAT((*st)[2].message(), HasSubstr("seed (7 on rank 2)"));
  auto same = gradsum::testing::RunRanksPerRank(
      2, [&](Communicator& c) { return CheckRanksAgree(base, c); });
  ASSERT_TRUE(same.ok());
  EXPECT_TRUE((*same)[0].ok() && (*same)[1].ok()) << (*same)[0];
}

TEST(CheckRanksAgreeTest, ADataFileOneRankCannotReadFailsEveryRankWithItsMessage) {
  const TrainConfig base = ResolvedConfig(TinyConfig(2, 1, 1, TrainConfig::fsdp));
  auto st = gradsum::testing::RunRanksPerRank(2, [&](Communicator& c) -> absl::Status {
    TrainConfig mine = base;
    if (c.rank() == 1) mine.mutable_data()->set_path("/nonexistent/corpus.txt");
    return CheckRanksAgree(mine, c);
  });
  ASSERT_TRUE(st.ok());
  for (const absl::Status& s : *st) {
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(), HasSubstr("failed on rank 1 of 2: NOT_FOUND: --data=/nonexistent/corpus.txt"));
  }
}

}  // namespace
}  // namespace gradsum::train
