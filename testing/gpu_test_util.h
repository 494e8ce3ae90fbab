#ifndef GRADSUM_TESTING_GPU_TEST_UTIL_H_
#define GRADSUM_TESTING_GPU_TEST_UTIL_H_

// Helpers for tests tagged `gpu`.
//
// Where no usable CUDA device exists (no GPU, or a driver that answers "driver version
// is insufficient"), a GPU test must skip and say why, never pass on the CPU path or fail.

#include <string>

#include "gtest/gtest.h"

namespace gradsum::testing {

// Returns true when at least one CUDA device can be used; otherwise false and sets
// `why` to the CUDA runtime's explanation.
bool CudaDeviceAvailable(std::string* why);

}  // namespace gradsum::testing

#define GRADSUM_SKIP_WITHOUT_GPU()                                    \
  do {                                                                \
    std::string gradsum_gpu_why;                                      \
    if (!::gradsum::testing::CudaDeviceAvailable(&gradsum_gpu_why)) { \
      GTEST_SKIP() << "no usable CUDA device: " << gradsum_gpu_why;   \
    }                                                                 \
  } while (0)

#endif  // GRADSUM_TESTING_GPU_TEST_UTIL_H_
