#include "data/streams.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace gradsum::data {
namespace {

// Stream j of the document 10 11 12, written out: input t + j, label t + j + 1, inside the
// document only.
TEST(StreamsTest, StreamJIsRolledJInsideTheDocument) {
  const std::vector<int32_t> doc = {10, 11, 12};
  const int32_t I = kIgnoreIndex;
  const std::vector<std::vector<int32_t>> inputs = {{10, 11, 12}, {11, 12, 0}, {12, 0, 0}};
  const std::vector<std::vector<int32_t>> labels = {{11, 12, I}, {12, I, I}, {I, I, I}};
  for (int j = 0; j < 3; ++j) {
    for (size_t t = 0; t < doc.size(); ++t) {
      EXPECT_EQ(StreamInput(doc, j, t), inputs[j][t]) << j << " " << t;
      EXPECT_EQ(StreamLabel(doc, j, t), labels[j][t]) << j << " " << t;
    }
  }
  EXPECT_EQ(StreamValidTokens(3, 0), 2);
  EXPECT_EQ(StreamValidTokens(3, 1), 1);
  EXPECT_EQ(StreamValidTokens(3, 2), 0);
  EXPECT_EQ(StreamValidTokens(3, 5), 0);
  EXPECT_EQ(StreamValidTokens(1, 0), 0);
  EXPECT_EQ(kIgnoreIndex, -100);  // SEMANTICS.md §1, PyTorch's default
}

}  // namespace
}  // namespace gradsum::data
