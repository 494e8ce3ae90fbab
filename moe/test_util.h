#ifndef GRADSUM_MOE_TEST_UTIL_H_
#define GRADSUM_MOE_TEST_UTIL_H_

// Test-only helpers shared by the moe/ tests: seeded random inputs that are exactly
// representable in fp32, so the fp32 code under test and the double reference
// (moe/reference.h) see identical values.

#include <cstdint>
#include <random>
#include <vector>

namespace gradsum::moe::test {

// n values uniform in [-scale, scale], each rounded to the nearest fp32.
inline std::vector<double> RandomFp32Values(size_t n, double scale, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<double> v(n);
  for (double& x : v) x = static_cast<float>(dist(gen));
  return v;
}

inline std::vector<float> ToFloat(const std::vector<double>& v) { return {v.begin(), v.end()}; }

}  // namespace gradsum::moe::test

#endif  // GRADSUM_MOE_TEST_UTIL_H_
