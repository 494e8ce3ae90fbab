#include "data/packer.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::data {
namespace {

using ::testing::HasSubstr;

// Documents of the given lengths (tokens all 1): the packer reads lengths only.
class Lengths : public DocumentSource {
 public:
  explicit Lengths(std::vector<int64_t> lengths) : lengths_(std::move(lengths)) {}
  int64_t num_documents() const override { return static_cast<int64_t>(lengths_.size()); }
  int64_t DocumentLength(int64_t i) const override { return lengths_[i]; }
  std::vector<int32_t> Document(int64_t i) const override {
    return std::vector<int32_t>(lengths_[i], 1);
  }
  int64_t MinDocumentLength() const override {
    int64_t m = lengths_.empty() ? 0 : lengths_[0];
    for (int64_t x : lengths_) m = std::min(m, x);
    return m;
  }
  int64_t MaxDocumentLength() const override {
    int64_t m = 0;
    for (int64_t x : lengths_) m = std::max(m, x);
    return m;
  }
  std::string Describe() const override { return "the test lengths"; }

 private:
  std::vector<int64_t> lengths_;
};

std::shared_ptr<const DocumentSource> Corpus(std::vector<int64_t> lengths) {
  return std::make_shared<const Lengths>(std::move(lengths));
}

// Lengths 3 5 2 4 6 into sequences of 8, written out by hand: whole documents, greedily, in
// order, cycling through the corpus.
TEST(SequencePackerTest, FillsSequencesGreedilyWithWholeDocumentsInOrder) {
  absl::StatusOr<SequencePacker> packer = SequencePacker::Create(Corpus({3, 5, 2, 4, 6}), 8);
  ASSERT_TRUE(packer.ok()) << packer.status();
  const std::vector<std::vector<int64_t>> want = {
      {0, 1},  // 3 + 5 = 8
      {2, 3},  // 2 + 4 = 6; document 4 (6) does not fit
      {4},     // 6; document 0 (3) does not fit
      {0, 1},  // the next epoch, as the first
      {2, 3}, {4},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(packer->position().sequences, static_cast<int64_t>(i));
    EXPECT_EQ(packer->NextSequence(), want[i]) << "sequence " << i;
  }
  EXPECT_EQ(packer->position().sequences, 6);
  EXPECT_EQ(packer->position().next_document, 0);
  EXPECT_EQ(packer->seq_len(), 8);
}

// Skip advances as NextSequence would; Seek to a position continues the stream from it.
TEST(SequencePackerTest, SkipAndSeekContinueTheSameStream) {
  const std::shared_ptr<const DocumentSource> corpus = Corpus({3, 5, 2, 4, 6, 1, 7});
  auto a = SequencePacker::Create(corpus, 9);
  auto b = SequencePacker::Create(corpus, 9);
  auto c = SequencePacker::Create(corpus, 9);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  for (int i = 0; i < 11; ++i) a->NextSequence();
  b->Skip(11);
  EXPECT_EQ(b->position().sequences, a->position().sequences);
  EXPECT_EQ(b->position().next_document, a->position().next_document);
  ASSERT_TRUE(c->Seek(a->position()).ok());
  for (int i = 0; i < 9; ++i) {
    const std::vector<int64_t> want = a->NextSequence();
    EXPECT_EQ(b->NextSequence(), want) << i;
    EXPECT_EQ(c->NextSequence(), want) << i;
  }
  const absl::Status bad = c->Seek({7, 0});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("next_document=7"));
  EXPECT_EQ(c->Seek({0, -1}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SequencePackerTest, CorporaItCannotPackAreNamed) {
  auto empty = SequencePacker::Create(Corpus({}), 8);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("the test lengths: has no document"));
  auto long_doc = SequencePacker::Create(Corpus({3, 9, 2}), 8);
  EXPECT_EQ(long_doc.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(long_doc.status().message(), HasSubstr("document 1 has length 9 > data.seq_len=8"));
  auto nothing = SequencePacker::Create(Corpus({1, 1, 1}), 8);
  EXPECT_EQ(nothing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(nothing.status().message(), HasSubstr("no trainable token in its 3 documents"));
  EXPECT_TRUE(SequencePacker::Create(Corpus({1, 2, 1}), 8).ok());
}

// Row j of micro-batch m on rank r in step s: s B + (m world + r) micro_batch + j.
TEST(GlobalSequenceIndexTest, StepThenMicroBatchThenRankThenRow) {
  // world 3, grad_acc 2, micro_batch 2: B = 12.
  EXPECT_EQ(GlobalSequenceIndex(0, 0, 0, 0, 3, 2, 2), 0);
  EXPECT_EQ(GlobalSequenceIndex(0, 0, 0, 1, 3, 2, 2), 1);
  EXPECT_EQ(GlobalSequenceIndex(0, 0, 2, 1, 3, 2, 2), 5);
  EXPECT_EQ(GlobalSequenceIndex(0, 1, 0, 0, 3, 2, 2), 6);
  EXPECT_EQ(GlobalSequenceIndex(1, 1, 2, 1, 3, 2, 2), 23);
  EXPECT_EQ(GlobalSequenceIndex(int64_t{1} << 40, 0, 0, 0, 3, 2, 2), int64_t{12} << 40);
}

}  // namespace
}  // namespace gradsum::data
