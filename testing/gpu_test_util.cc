#include "testing/gpu_test_util.h"

#include <cuda_runtime.h>

namespace gradsum::testing {

bool CudaDeviceAvailable(std::string* why) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    *why = cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    *why = "cudaGetDeviceCount returned 0";
    return false;
  }
  return true;
}

}  // namespace gradsum::testing
