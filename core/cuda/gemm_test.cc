// Checks the row-major cuBLAS GEMM wrapper against a double-precision CPU matmul for every
// transpose combination, f32 and bf16 inputs, f32 and bf16 outputs, alpha/beta, and padded
// leading dimensions. Skips without a GPU.
#include "core/cuda/gemm.h"

#include <cstdint>
#include <vector>

#include "core/cuda/cuda_status.h"
#include "core/cuda/device_buffer.h"
#include "core/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/gpu_compare.h"
#include "testing/gpu_test_util.h"

namespace gradsum::cuda {
namespace {

using ::gradsum::testing::DownloadAsDouble;
using ::gradsum::testing::ExpectAllNear;
using ::gradsum::testing::RandomNormal;
using ::gradsum::testing::RoundTo;
using ::gradsum::testing::UploadAs;
using ::testing::HasSubstr;

struct GemmCase {
  bool trans_a, trans_b;
  DType in, out;
};

class GemmRowMajorTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmRowMajorTest, MatchesDoubleReference) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const GemmCase c = GetParam();
  const int64_t m = 37, n = 53, k = 129, pad = 3;
  // Stored shapes (row-major) with padded leading dimensions.
  const int64_t a_rows = c.trans_a ? k : m, a_cols = c.trans_a ? m : k;
  const int64_t b_rows = c.trans_b ? n : k, b_cols = c.trans_b ? k : n;
  const int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = n + pad;
  std::vector<float> a = RandomNormal(a_rows * lda, 1), b = RandomNormal(b_rows * ldb, 2);
  std::vector<float> c0 = RandomNormal(m * ldc, 3);
  RoundTo(c.in, &a);
  RoundTo(c.in, &b);
  RoundTo(c.out, &c0);
  DeviceBuffer a_dev = UploadAs(a, c.in), b_dev = UploadAs(b, c.in), c_dev = UploadAs(c0, c.out);
  absl::StatusOr<CublasHandle> h = CublasHandle::Create();
  ASSERT_TRUE(h.ok()) << h.status();
  GemmArgs g;
  g.trans_a = c.trans_a;
  g.trans_b = c.trans_b;
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = 0.75f;
  g.beta = -0.5f;
  g.a = a_dev.get();
  g.a_dtype = c.in;
  g.lda = lda;
  g.b = b_dev.get();
  g.b_dtype = c.in;
  g.ldb = ldb;
  g.c = c_dev.get();
  g.c_dtype = c.out;
  g.ldc = ldc;
  absl::Status s = GemmRowMajor(*h, nullptr, g);
  ASSERT_TRUE(s.ok()) << s;

  const std::vector<double> got = DownloadAsDouble(c_dev, c.out);
  std::vector<double> want(c0.begin(), c0.end());  // padding columns must stay as they were
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = c.trans_a ? a[p * lda + i] : a[i * lda + p];
        const double bv = c.trans_b ? b[j * ldb + p] : b[p * ldb + j];
        acc += av * bv;
      }
      want[i * ldc + j] = 0.75 * acc - 0.5 * c0[i * ldc + j];
    }
  }
  ExpectAllNear(got, want, 1e-3, c.out == DType::kBF16 ? 1.0 / 128 : 1e-5, "C");
}

INSTANTIATE_TEST_SUITE_P(All, GemmRowMajorTest,
                         ::testing::Values(GemmCase{false, false, DType::kF32, DType::kF32},
                                           GemmCase{true, false, DType::kF32, DType::kF32},
                                           GemmCase{false, true, DType::kF32, DType::kF32},
                                           GemmCase{true, true, DType::kF32, DType::kF32},
                                           GemmCase{false, false, DType::kBF16, DType::kF32},
                                           GemmCase{true, false, DType::kBF16, DType::kBF16},
                                           GemmCase{false, true, DType::kBF16, DType::kBF16}));

TEST(GemmRowMajor, BadArgumentsAreInvalidArgument) {
  GRADSUM_SKIP_WITHOUT_GPU();
  absl::StatusOr<CublasHandle> h = CublasHandle::Create();
  ASSERT_TRUE(h.ok());
  DeviceBuffer buf = *DeviceBuffer::Create(4 * 64);
  GemmArgs g;
  g.m = g.n = g.k = 4;
  g.a = g.b = buf.get();
  g.c = buf.get();
  g.lda = g.ldb = g.ldc = 4;
  ASSERT_TRUE(GemmRowMajor(*h, nullptr, g).ok());
  GemmArgs bad = g;
  bad.lda = 3;
  absl::Status s = GemmRowMajor(*h, nullptr, bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("lda"));
  bad = g;
  bad.m = int64_t{1} << 31;
  EXPECT_EQ(GemmRowMajor(*h, nullptr, bad).code(), absl::StatusCode::kInvalidArgument);
  bad = g;
  bad.b_dtype = DType::kBF16;
  EXPECT_EQ(GemmRowMajor(*h, nullptr, bad).code(), absl::StatusCode::kInvalidArgument);
  bad = g;
  bad.c_dtype = DType::kBF16;  // f32 inputs with a bf16 output are not offered
  EXPECT_EQ(GemmRowMajor(*h, nullptr, bad).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> host(16);
  bad = g;
  bad.a = host.data();
  s = GemmRowMajor(*h, nullptr, bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("GEMM A"));
}

TEST(CudaHelpersWithoutDevice, ReturnFailedPreconditionNotACrash) {
  std::string why;
  if (::gradsum::testing::CudaDeviceAvailable(&why)) GTEST_SKIP() << "a GPU is present";
  EXPECT_EQ(CublasHandle::Create().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(RequireCudaDevice().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(DeviceBuffer::Create(1024).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CudaStream::Create().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CudaErrorToStatus(cudaErrorMemoryAllocation, "x").code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CudaErrorToStatus(cudaErrorInvalidValue, "x").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaErrorToStatus(cudaErrorIllegalAddress, "x").code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(CudaErrorToStatus(cudaSuccess, "x").ok());
}

}  // namespace
}  // namespace gradsum::cuda
