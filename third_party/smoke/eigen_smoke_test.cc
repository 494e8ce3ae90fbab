// Proves that Eigen's headers are found: a small GEMM against a hand computation.
#include <Eigen/Dense>

#include "gtest/gtest.h"

TEST(EigenSmoke, MatrixProduct) {
  Eigen::Matrix2f a;
  a << 1, 2, 3, 4;
  Eigen::Matrix2f b;
  b << 5, 6, 7, 8;
  Eigen::Matrix2f c = a * b;
  EXPECT_FLOAT_EQ(c(0, 0), 19);
  EXPECT_FLOAT_EQ(c(0, 1), 22);
  EXPECT_FLOAT_EQ(c(1, 0), 43);
  EXPECT_FLOAT_EQ(c(1, 1), 50);
}
