// OpenBLAS is found, its CBLAS header compiles and sgemm links and computes.
#include <cblas.h>

#include <vector>

#include "gtest/gtest.h"

TEST(OpenBlasSmokeTest, SgemmMatchesHandComputedProduct) {
  // [2x3] x [3x2], row-major: [[1 2 3] [4 5 6]] x [[7 8] [9 10] [11 12]].
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {7, 8, 9, 10, 11, 12};
  std::vector<float> c(4, -1.0f);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 2, 2, 3, 1.0f, a.data(), 3, b.data(), 2,
              0.0f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{58, 64, 139, 154}));
}

TEST(OpenBlasSmokeTest, ReportsItsRunTimeKernel) {
  // DYNAMIC_ARCH builds name the kernel they picked for this CPU.
  const char* core = openblas_get_corename();
  ASSERT_NE(core, nullptr);
  EXPECT_STRNE(core, "");
}
