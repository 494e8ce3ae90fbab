#include "train/config_agreement.h"

#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "data/corpus.h"
#include "data/document_source.h"
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
    if (c.rank() == 2) mine.mutable_model()->set_seed(7);
    if (c.rank() >= 1) mine.mutable_optim()->set_lr(0.5);
    if (c.rank() == 1) mine.mutable_parallelism()->set_grad_acc(2);
    return CheckRanksAgree(mine, data::MakeCorpus(mine.data()), c);
  });
  ASSERT_TRUE(st.ok());
  for (int r = 0; r < 3; ++r) {
    const absl::Status& s = (*st)[r];
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("optim.lr ("));
    EXPECT_THAT(s.message(), HasSubstr(") differs: ranks {0} vs {1,2}"));
    EXPECT_THAT(s.message(), HasSubstr(") differs: ranks {0,1} vs {2}"));
  }
  EXPECT_THAT((*st)[2].message(), HasSubstr("model.seed (7 on rank 2)"));
  // A field of a section the old layout had at top level is named by its section's path.
  EXPECT_THAT((*st)[1].message(),
              HasSubstr("parallelism.grad_acc (2 on rank 1) differs: ranks {0,2} vs {1}"));
  auto same = gradsum::testing::RunRanksPerRank(
      2, [&](Communicator& c) { return CheckRanksAgree(base, data::MakeCorpus(base.data()), c); });
  ASSERT_TRUE(same.ok());
  EXPECT_TRUE((*same)[0].ok() && (*same)[1].ok()) << (*same)[0];
}

TEST(CheckRanksAgreeTest, ADataFileOneRankCannotReadFailsEveryRankWithItsMessage) {
  const TrainConfig base = ResolvedConfig(TinyConfig(2, 1, 1, TrainConfig::fsdp));
  auto st = gradsum::testing::RunRanksPerRank(2, [&](Communicator& c) -> absl::Status {
    TrainConfig mine = base;
    if (c.rank() == 1) mine.mutable_data()->set_path("/nonexistent/corpus.txt");
    return CheckRanksAgree(mine, data::MakeCorpus(mine.data()), c);
  });
  ASSERT_TRUE(st.ok());
  for (const absl::Status& s : *st) {
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(),
                HasSubstr("failed on rank 1 of 2: NOT_FOUND: --data=/nonexistent/corpus.txt"));
  }
}

// The data files' bytes are compared, not their names: same path text, other content.
TEST(CheckRanksAgreeTest, DataFilesWithOtherContentAreRefused) {
  const std::string dir = ::testing::TempDir();
  for (int r = 0; r < 2; ++r) {
    std::ofstream(absl::StrCat(dir, "/agree_corpus_", r, ".txt"))
        << "the same first line\n"
        << (r == 0 ? "rank zero's line\n" : "rank one's line\n");
  }
  TrainConfig base = ResolvedConfig(TinyConfig(2, 1, 1, TrainConfig::fsdp));
  auto st = gradsum::testing::RunRanksPerRank(2, [&](Communicator& c) -> absl::Status {
    TrainConfig mine = base;
    mine.mutable_data()->set_path(absl::StrCat(dir, "/agree_corpus_", c.rank(), ".txt"));
    // Both ranks report the same path text, so only the content can differ.
    absl::StatusOr<std::shared_ptr<const data::DocumentSource>> corpus =
        data::MakeCorpus(mine.data());
    mine.mutable_data()->set_path("corpus.txt");
    return CheckRanksAgree(mine, corpus, c);
  });
  ASSERT_TRUE(st.ok());
  for (const absl::Status& s : *st) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(),
                HasSubstr("the content of data.path=corpus.txt differs: ranks {0} vs {1}"));
  }
}

// Issue 50 item 5: the --eval_data file's bytes are compared too (ranks evaluating on
// different files logged a mixed held-out CE), and named as --eval_data's.
TEST(CheckRanksAgreeTest, EvalDataFilesWithOtherContentAreRefused) {
  const std::string dir = ::testing::TempDir();
  std::ofstream(absl::StrCat(dir, "/agree_train.txt")) << "one training line\nanother one\n";
  for (int r = 0; r < 2; ++r) {
    std::ofstream(absl::StrCat(dir, "/agree_eval_", r, ".txt"))
        << "the same first line\n"
        << (r == 0 ? "rank zero's held-out line\n" : "rank one's held-out line\n");
  }
  TrainConfig base = ResolvedConfig(TinyConfig(2, 1, 1, TrainConfig::fsdp));
  base.mutable_data()->set_path(absl::StrCat(dir, "/agree_train.txt"));
  base.mutable_log()->set_eval_every(1);
  auto st = gradsum::testing::RunRanksPerRank(2, [&](Communicator& c) -> absl::Status {
    TrainConfig mine = base;
    mine.mutable_data()->set_eval_path(absl::StrCat(dir, "/agree_eval_", c.rank(), ".txt"));
    absl::StatusOr<std::shared_ptr<const data::DocumentSource>> held_out =
        data::MakeHeldOutCorpus(mine.data());
    // Both ranks report the same path text, so only the content can differ.
    mine.mutable_data()->set_eval_path("held_out.txt");
    return CheckRanksAgree(mine, data::MakeCorpus(mine.data()), held_out, c);
  });
  ASSERT_TRUE(st.ok());
  for (const absl::Status& s : *st) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("the content of data.eval_path=held_out.txt (--eval_data) "
                                       "differs: ranks {0} vs {1}"));
  }
  // The same file on every rank agrees.
  auto same = gradsum::testing::RunRanksPerRank(2, [&](Communicator& c) -> absl::Status {
    TrainConfig mine = base;
    mine.mutable_data()->set_eval_path(absl::StrCat(dir, "/agree_eval_0.txt"));
    return CheckRanksAgree(mine, data::MakeCorpus(mine.data()),
                           data::MakeHeldOutCorpus(mine.data()), c);
  });
  ASSERT_TRUE(same.ok());
  EXPECT_TRUE((*same)[0].ok() && (*same)[1].ok()) << (*same)[0];
}

}  // namespace
}  // namespace gradsum::train
