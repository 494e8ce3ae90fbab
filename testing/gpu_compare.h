#ifndef GRADSUM_TESTING_GPU_COMPARE_H_
#define GRADSUM_TESTING_GPU_COMPARE_H_

// Small helpers for GPU tests that compare device results with CPU references:
// element-wise closeness with a clear first-mismatch message, and seeded random inputs.
//
//   ExpectAllNear(gpu_values, cpu_values, /*atol=*/1e-7, /*rtol=*/1e-5, "probs");

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace gradsum::testing {

// |got[i] - want[i]| <= atol + rtol * |want[i]| for every i; sizes must match. Reports
// the first offending index (and stops there, so a broken kernel gives one line).
template <typename A, typename B>
void ExpectAllNear(const std::vector<A>& got, const std::vector<B>& want, double atol, double rtol,
                   const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    ASSERT_LE(std::abs(g - w), atol + rtol * std::abs(w))
        << what << "[" << i << "]: got " << g << ", want " << w;
  }
}

// n normal(0, scale) floats from a fixed seed.
inline std::vector<float> RandomNormal(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

}  // namespace gradsum::testing

#endif  // GRADSUM_TESTING_GPU_COMPARE_H_
