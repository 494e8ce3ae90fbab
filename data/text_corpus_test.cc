#include "data/text_corpus.h"

#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::data {
namespace {

using ::testing::HasSubstr;

TEST(TextFileCorpusTest, LinesAreDocumentsAndLongLinesSplit) {
  const std::string path = ::testing::TempDir() + "/corpus.txt";
  std::ofstream(path, std::ios::binary) << "hello\n\nabcdefghij\xff"
                                        << "xyz";
  auto corpus = TextFileCorpus::Load(path, 4);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  // "hell" "o\n" "\n" "abcd" "efgh" "ij\xffx" "yz"
  ASSERT_EQ((*corpus)->num_documents(), 7);
  EXPECT_EQ((*corpus)->Document(1), (std::vector<int32_t>{'o', '\n'}));
  EXPECT_EQ((*corpus)->Document(2), (std::vector<int32_t>{'\n'}));
  EXPECT_EQ((*corpus)->Document(5), (std::vector<int32_t>{'i', 'j', 255, 'x'}));
  EXPECT_EQ((*corpus)->DocumentLength(6), 2);
  EXPECT_LT((*corpus)->EntropyFloorNats(), 0);
  EXPECT_LT((*corpus)->ContextFloorNats(), 0);

  EXPECT_EQ(TextFileCorpus::Load("/nonexistent/x.txt", 4).status().code(),
            absl::StatusCode::kNotFound);
  std::ofstream(path, std::ios::binary | std::ios::trunc).flush();
  auto empty = TextFileCorpus::Load(path, 4);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr(path));
}

// Thread ranks share one copy while it is alive; another max_len, or a rewritten file, is
// its own load.
TEST(TextFileCorpusTest, LoadSharedGivesThreadsOneCopy) {
  const std::string path = ::testing::TempDir() + "/shared.txt";
  std::ofstream(path, std::ios::binary) << "one\ntwo\n";
  std::vector<std::shared_ptr<const TextFileCorpus>> got(8);
  std::vector<std::thread> threads;
  for (int r = 0; r < 8; ++r) {
    threads.emplace_back([&, r] {
      auto c = TextFileCorpus::LoadShared(path, 16);
      if (c.ok()) got[r] = *c;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 8; ++r) {
    ASSERT_NE(got[r], nullptr);
    EXPECT_EQ(got[r].get(), got[0].get()) << "rank " << r;
  }
  EXPECT_EQ(got[0]->num_documents(), 2);
  auto other_len = TextFileCorpus::LoadShared(path, 2);
  ASSERT_TRUE(other_len.ok());
  EXPECT_NE(other_len->get(), got[0].get());
  EXPECT_EQ((*other_len)->num_documents(), 4);
  // Rewritten (another size): a fresh load, not the cached copy.
  std::ofstream(path, std::ios::binary | std::ios::trunc) << "three\nfour\nfive\n";
  auto rewritten = TextFileCorpus::LoadShared(path, 16);
  ASSERT_TRUE(rewritten.ok());
  EXPECT_EQ((*rewritten)->num_documents(), 3);
  EXPECT_NE((*rewritten)->ContentFingerprint(), got[0]->ContentFingerprint());
  EXPECT_EQ(TextFileCorpus::LoadShared("/nonexistent/x.txt", 4).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace gradsum::data
