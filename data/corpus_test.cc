#include "data/corpus.h"

#include <fstream>
#include <string>
#include <vector>

#include "data/markov.h"
#include "data/token_files.h"
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

// data.path: a .bin / .u16 / .u32 path (or a Megatron prefix) is a token file split at
// data.eod_token; any other a byte text file. CheckCorpusVocab holds each to its vocabulary.
TEST(MakeCorpusTest, TokenFilesByPathAndTheirVocabulary) {
  const std::string u16 = ::testing::TempDir() + "/tokens.u16";
  {
    std::ofstream out(u16, std::ios::binary);
    for (uint16_t t : {300, 7, 2, 5, 2}) out.write(reinterpret_cast<const char*>(&t), 2);
  }
  DataConfig config;
  config.set_path(u16);
  config.set_eod_token(2);
  config.set_seq_len(16);
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  const auto* tokens = dynamic_cast<const TokenFileCorpus*>(corpus->get());
  ASSERT_NE(tokens, nullptr);
  EXPECT_EQ(tokens->Document(0), (std::vector<int32_t>{300, 7, 2}));
  EXPECT_EQ(tokens->Document(1), (std::vector<int32_t>{5, 2}));
  EXPECT_TRUE(CheckCorpusVocab(**corpus, 301).ok());
  const absl::Status small = CheckCorpusVocab(**corpus, 256);
  EXPECT_EQ(small.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(small.message(), HasSubstr("model.vocab=256"));
  EXPECT_THAT(small.message(), HasSubstr("at least 301"));

  const std::string text = ::testing::TempDir() + "/corpus.txt";
  std::ofstream(text, std::ios::binary) << "ab\ncd\n";
  config.set_path(text);
  auto bytes = MakeCorpus(config);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(dynamic_cast<const TokenFileCorpus*>(bytes->get()), nullptr);
  EXPECT_TRUE(CheckCorpusVocab(**bytes, 256).ok());
  EXPECT_THAT(CheckCorpusVocab(**bytes, 301).message(), HasSubstr("must be 256"));
}

}  // namespace
}  // namespace gradsum::data
