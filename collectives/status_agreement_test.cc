#include "collectives/status_agreement.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

using ::gradsum::testing::RunRanksPerRank;

TEST(StatusAgreementTest, AllOkIsOk) {
  auto st =
      RunRanksPerRank(3, [](Communicator& c) { return AgreeOnStatus(c, absl::OkStatus(), "x"); });
  ASSERT_TRUE(st.ok()) << st.status();
  for (const absl::Status& s : *st) EXPECT_TRUE(s.ok()) << s;
}

TEST(StatusAgreementTest, EveryRankGetsEveryFailingRanksOwnMessage) {
  auto st = RunRanksPerRank(4, [](Communicator& c) -> absl::Status {
    absl::Status local = absl::OkStatus();
    if (c.rank() == 1) local = absl::DataLossError("rank-00001.safetensors is corrupt");
    if (c.rank() == 3) local = absl::NotFoundError("no such file 'x'");
    return AgreeOnStatus(c, local, "checkpoint load");
  });
  ASSERT_TRUE(st.ok()) << st.status();
  const std::string want =
      "checkpoint load failed on ranks 1, 3 of 4; rank 1: DATA_LOSS: rank-00001.safetensors is "
      "corrupt; rank 3: NOT_FOUND: no such file 'x'";
  for (int r = 0; r < 4; ++r) {
    const absl::Status& s = (*st)[r];
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << r;  // the lowest failing rank's code
    EXPECT_EQ(s.message(), want) << r;
    EXPECT_TRUE(IsAgreedFailure(s)) << r;
  }
}

TEST(StatusAgreementTest, OneFailureReadsOnceAndIdenticalErrorsAreGrouped) {
  auto one = RunRanksPerRank(2, [](Communicator& c) -> absl::Status {
    return AgreeOnStatus(c, c.rank() == 1 ? absl::InternalError("boom") : absl::OkStatus(),
                         "step 2");
  });
  ASSERT_TRUE(one.ok());
  EXPECT_EQ((*one)[0].message(), "step 2 failed on rank 1 of 2: INTERNAL: boom");
  EXPECT_EQ((*one)[0], (*one)[1]);
  auto same = RunRanksPerRank(3, [](Communicator& c) -> absl::Status {
    return AgreeOnStatus(c, absl::InvalidArgumentError("bad"), "start-up");
  });
  ASSERT_TRUE(same.ok());
  EXPECT_EQ((*same)[2].message(),
            "start-up failed on ranks 0, 1, 2 of 3; ranks 0, 1, 2: INVALID_ARGUMENT: bad");
}

TEST(StatusAgreementTest, AnAgreedFailureIsNotExchangedAgainAndLongMessagesAreCut) {
  auto st = RunRanksPerRank(2, [](Communicator& c) -> absl::Status {
    absl::Status first = AgreeOnStatus(
        c, c.rank() == 0 ? absl::InternalError(std::string(5000, 'x')) : absl::OkStatus(), "a");
    // Only rank 1 would call a second exchange if agreed failures were exchanged again.
    return AgreeOnStatus(c, first, "b");
  });
  ASSERT_TRUE(st.ok());
  EXPECT_EQ((*st)[0], (*st)[1]);
  EXPECT_LT((*st)[0].message().size(), 2100u);
  EXPECT_NE((*st)[0].message().find("xxx..."), std::string::npos);
}

TEST(StatusAgreementTest, APeerThatNeverArrivesLeavesTheLocalErrorUnmarked) {
  ThreadBackendOptions options;
  options.timeout = absl::Milliseconds(200);
  auto st = RunRanksPerRank(
      2,
      [](Communicator& c) -> absl::Status {
        if (c.rank() == 1) return absl::OkStatus();  // never joins the agreement
        return AgreeOnStatus(c, absl::InternalError("mine"), "x");
      },
      options);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ((*st)[0].message(), "mine");
  EXPECT_FALSE(IsAgreedFailure((*st)[0]));
}

}  // namespace
}  // namespace gradsum
