#include "data/text_corpus.h"

#include <fstream>
#include <string>
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

}  // namespace
}  // namespace gradsum::data
