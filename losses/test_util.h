#ifndef GRADSUM_LOSSES_TEST_UTIL_H_
#define GRADSUM_LOSSES_TEST_UTIL_H_

// Small helpers shared by the losses tests: seeded normal data and f32 matrix views.
//
//   std::vector<float> x = RandomNormal(rows * cols, /*seed=*/1, /*stddev=*/0.5f);
//   TensorView v = F32Matrix(x.data(), rows, cols);

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "core/tensor.h"

namespace gradsum::losses {

// n samples of N(0, stddev^2) from a fixed seed (the same on every machine).
inline std::vector<float> RandomNormal(size_t n, uint32_t seed, float stddev) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

// A [rows, cols] f32 CPU view of `data`; the shape must be valid (tests only).
inline TensorView F32Matrix(float* data, int64_t rows, int64_t cols) {
  return *TensorView::Create(data, DType::kF32, {rows, cols});
}

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_TEST_UTIL_H_
