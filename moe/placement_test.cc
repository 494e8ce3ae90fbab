#include "moe/placement.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::moe {
namespace {

using ::testing::HasSubstr;

TEST(ExpertPlacementTest, OwnerIsExpertDividedByExpertsPerRank) {
  absl::StatusOr<ExpertPlacement> p = ExpertPlacement::Create(8, 4);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->experts_per_rank(), 2);
  const int owners[8] = {0, 0, 1, 1, 2, 2, 3, 3};
  for (int e = 0; e < 8; ++e) EXPECT_EQ(p->OwnerEpRank(e), owners[e]) << e;
  for (int r = 0; r < 4; ++r) EXPECT_EQ(p->FirstLocalExpert(r), 2 * r);
  EXPECT_EQ(*p->CheckedOwnerEpRank(7), 3);
  EXPECT_EQ(p->CheckedOwnerEpRank(8).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(p->CheckedOwnerEpRank(-1).status().code(), absl::StatusCode::kOutOfRange);
}

TEST(ExpertPlacementTest, ReduceGroups) {
  EXPECT_EQ(ReduceGroupOfRouterParams(), ParamReduceGroup::kWorld);
  EXPECT_EQ(ReduceGroupOfExpertParams(), ParamReduceGroup::kEdp);
}

TEST(ExpertPlacementTest, UnevenSplitIsInvalidArgumentNamingEAndP) {
  absl::StatusOr<ExpertPlacement> p = ExpertPlacement::Create(6, 4);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), HasSubstr("E=6"));
  EXPECT_THAT(p.status().message(), HasSubstr("P=4"));
  EXPECT_THAT(ExpertPlacement::Create(0, 1).status().message(), HasSubstr("E=0"));
  EXPECT_THAT(ExpertPlacement::Create(4, 0).status().message(), HasSubstr("P=0"));
}

}  // namespace
}  // namespace gradsum::moe
