// PickIsaBuild against a table of fake builds: the widest one the "CPU" runs, unless the
// environment variable names one it runs.
#include "core/cpu_isa.h"

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace gradsum {
namespace {

struct FakeKernels {
  std::string name;
};

// Which fake builds this fake CPU runs.
bool runs_avx2 = false, runs_avx512 = false;

const FakeKernels* FakeFor(const char* isa) {
  static const FakeKernels generic{"generic"}, avx2{"avx2"}, avx512{"avx512"};
  const std::string name = isa;
  if (name == "generic") return &generic;
  if (name == "avx2" && runs_avx2) return &avx2;
  if (name == "avx512" && runs_avx512) return &avx512;
  return nullptr;
}

std::string Pick(bool avx2, bool avx512, const char* forced) {
  runs_avx2 = avx2;
  runs_avx512 = avx512;
  if (forced != nullptr) {
    setenv("GRADSUM_TEST_ISA", forced, 1);
  } else {
    unsetenv("GRADSUM_TEST_ISA");
  }
  return PickIsaBuild<FakeKernels>("GRADSUM_TEST_ISA", &FakeFor).name;
}

TEST(PickIsaBuildTest, WidestTheCpuRunsUnlessForced) {
  EXPECT_EQ(Pick(false, false, nullptr), "generic");
  EXPECT_EQ(Pick(true, false, nullptr), "avx2");
  EXPECT_EQ(Pick(true, true, nullptr), "avx512");
  EXPECT_EQ(Pick(true, true, "generic"), "generic");
  EXPECT_EQ(Pick(true, true, "avx2"), "avx2");
  EXPECT_EQ(Pick(true, false, "avx512"), "avx2");  // forced but not runnable: the widest
  EXPECT_EQ(Pick(false, false, "sse9"), "generic");
  unsetenv("GRADSUM_TEST_ISA");
}

TEST(CpuIsaTest, Avx512ImpliesAvx2Fma) {
  if (CpuHasAvx512()) {
    EXPECT_TRUE(CpuHasAvx2Fma());
  }
}

TEST(CpuIsaTest, Avx512Bf16ImpliesAvx512) {
  if (CpuHasAvx512Bf16()) {
    EXPECT_TRUE(CpuHasAvx512());
  }
}

}  // namespace
}  // namespace gradsum
