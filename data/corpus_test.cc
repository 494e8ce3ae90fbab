#include "data/corpus.h"

#include "data/markov.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "train/config.h"

namespace gradsum::data {
namespace {

using ::testing::HasSubstr;
using train::DataConfig;
using train::ResolvedConfig;
using train::TrainConfig;

// data.corpus picks the embedded corpus; a file and a non-default corpus contradict.
TEST(MakeCorpusTest, PicksTheCorpusTheConfigNames) {
  DataConfig config;  // the default: markov2
  config.set_corpus(DataConfig::markov1);
  auto first = MakeCorpus(config);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_NE(dynamic_cast<const MarkovCorpus*>(first->get()), nullptr);
  config.clear_corpus();
  auto second = MakeCorpus(config);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(dynamic_cast<const SecondOrderMarkovCorpus*>(second->get()), nullptr);
  EXPECT_THAT((*second)->Describe(), HasSubstr("order-2"));
  config.set_path("/nonexistent/file.txt");
  config.set_corpus(DataConfig::markov2);
  auto both = MakeCorpus(config);
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(both.status().message(), HasSubstr("data.corpus=markov2"));
  EXPECT_THAT(both.status().message(), HasSubstr("data.path=/nonexistent/file.txt"));
  // A file with no corpus named reads the file (here: finds it missing).
  config.clear_corpus();
  EXPECT_EQ(MakeCorpus(config).status().code(), absl::StatusCode::kNotFound);
  // Resolving a file's config names markov1, the corpus value of file runs.
  TrainConfig with_file;
  with_file.mutable_data()->set_path("/nonexistent/file.txt");
  EXPECT_EQ(ResolvedConfig(with_file).data().corpus(), DataConfig::markov1);
}

}  // namespace
}  // namespace gradsum::data
