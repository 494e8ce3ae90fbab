#ifndef GRADSUM_TESTING_GPU_COMPARE_H_
#define GRADSUM_TESTING_GPU_COMPARE_H_

// Helpers for GPU tests that compare device results with CPU references: host <-> device
// copies (f32 / bf16 as float or double on the host), element-wise closeness with a clear
// first-mismatch message, seeded random inputs. --config=cuda only.
//
//   DeviceBuffer x = UploadAs(values, DType::kBF16);   // rounds to bf16
//   ExpectAllNear(DownloadAsDouble(x, DType::kBF16), want, /*atol=*/1e-7, /*rtol=*/1e-2, "x");

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda/device_buffer.h"
#include "core/dtype.h"
#include "core/half.h"
#include "gtest/gtest.h"

namespace gradsum::testing {

// A device copy of `v` (a failed copy is a test failure and gives an empty buffer).
template <typename T>
cuda::DeviceBuffer Dev(const std::vector<T>& v) {
  absl::StatusOr<cuda::DeviceBuffer> b = cuda::DeviceBuffer::FromHost(v);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : cuda::DeviceBuffer();
}

// The buffer's contents as T (a failed copy is a test failure and gives an empty vector).
template <typename T>
std::vector<T> Host(const cuda::DeviceBuffer& b) {
  absl::StatusOr<std::vector<T>> v = b.ToHost<T>();
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? std::move(*v) : std::vector<T>();
}

// A zero-filled device buffer of `bytes`.
inline cuda::DeviceBuffer DevZeros(size_t bytes) {
  absl::StatusOr<cuda::DeviceBuffer> b = cuda::DeviceBuffer::Create(bytes);
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return cuda::DeviceBuffer();
  EXPECT_TRUE(b->Fill(0).ok());
  return std::move(*b);
}

// Rounds every value to bf16 in place when dtype is bf16 (so a reference sees exactly what
// the device reads); no-op for f32.
inline void RoundTo(DType dtype, std::vector<float>* v) {
  if (dtype != DType::kBF16) return;
  for (float& f : *v) f = BF16::FromFloat(f).ToFloat();
}

// `v` on the device as f32 or bf16 (rounded to nearest even).
inline cuda::DeviceBuffer UploadAs(const std::vector<float>& v, DType dtype) {
  if (dtype == DType::kF32) return Dev(v);
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = BF16::FromFloat(v[i]).bits;
  return Dev(bits);
}

// An f32 or bf16 device buffer's values, exactly, as doubles.
inline std::vector<double> DownloadAsDouble(const cuda::DeviceBuffer& d, DType dtype) {
  std::vector<double> out;
  if (dtype == DType::kF32) {
    for (float f : Host<float>(d)) out.push_back(f);
  } else {
    for (uint16_t b : Host<uint16_t>(d)) out.push_back(BF16::FromBits(b).ToFloat());
  }
  return out;
}

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
