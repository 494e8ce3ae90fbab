// Proves that GoogleMock's matchers link.
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

TEST(GmockSmoke, Matchers) {
  std::vector<int> v = {3, 1, 2};
  EXPECT_THAT(v, ::testing::UnorderedElementsAre(1, 2, 3));
  EXPECT_THAT(v, ::testing::Not(::testing::Contains(4)));
}
