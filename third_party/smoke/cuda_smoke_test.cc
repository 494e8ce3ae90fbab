// Runs a trivial kernel where a GPU exists; skips, saying why, where none does.
#include "third_party/smoke/cuda_smoke.h"

#include <vector>

#include "gtest/gtest.h"
#include "testing/gpu_test_util.h"

TEST(CudaSmoke, AddOne) {
  GRADSUM_SKIP_WITHOUT_GPU();
  std::vector<float> v = {1.0f, 2.5f, -3.0f};
  ASSERT_EQ(CudaSmokeAddOne(v.data(), 3), 0);
  EXPECT_EQ(v[0], 2.0f);
  EXPECT_EQ(v[1], 3.5f);
  EXPECT_EQ(v[2], -2.0f);
}
