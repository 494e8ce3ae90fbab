// Checks the CUDA RMSNorm and SwiGLU kernels against double-precision CPU references of
// SEMANTICS.md §10; the backward references are central finite differences of the forward
// reference (independent of the analytic formulas in the kernels). Skips without a GPU.
#include "moe/cuda/layers_cuda.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/cuda/device_buffer.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "testing/gpu_compare.h"
#include "testing/gpu_test_util.h"

namespace gradsum::moe {
namespace {

using cuda::DeviceBuffer;
using ::gradsum::testing::DownloadAsDouble;
using ::gradsum::testing::ExpectAllNear;
using ::gradsum::testing::RandomNormal;
using ::gradsum::testing::RoundTo;
using ::gradsum::testing::UploadAs;

// y = x / sqrt(mean(x^2) + eps) * g, one row, double.
std::vector<double> RmsNormRow(const double* x, const std::vector<double>& g, double eps) {
  const size_t n = g.size();
  double ss = 0;
  for (size_t j = 0; j < n; ++j) ss += x[j] * x[j];
  const double r = 1.0 / std::sqrt(ss / n + eps);
  std::vector<double> y(n);
  for (size_t j = 0; j < n; ++j) y[j] = x[j] * r * g[j];
  return y;
}

// Central difference of f at x[i] (x is restored).
double CentralDiff(const std::function<double()>& f, double* x, double h) {
  const double old = *x;
  *x = old + h;
  const double up = f();
  *x = old - h;
  const double down = f();
  *x = old;
  return (up - down) / (2 * h);
}

struct RmsCase {
  DType dtype;
  int64_t rows;
  int64_t width;
};

class RmsNormCuda : public ::testing::TestWithParam<RmsCase> {};

TEST_P(RmsNormCuda, ForwardAndBackwardMatchDoubleReferenceAndFiniteDifferences) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const RmsCase c = GetParam();
  const double eps = 1e-6;
  std::vector<float> x = RandomNormal(c.rows * c.width, 1, 2.0f),
                     dy = RandomNormal(c.rows * c.width, 2);
  std::vector<float> gamma = RandomNormal(c.width, 3);
  std::vector<float> dx0 = RandomNormal(c.rows * c.width, 4);  // residual gradient to add onto
  RoundTo(c.dtype, &x);
  RoundTo(c.dtype, &dy);
  RoundTo(c.dtype, &dx0);
  std::vector<float> dgamma0 = RandomNormal(c.width, 5);

  DeviceBuffer x_dev = UploadAs(x, c.dtype),
               y_dev = UploadAs(std::vector<float>(x.size()), c.dtype);
  DeviceBuffer g_dev = *DeviceBuffer::FromHost(gamma),
               rstd_dev = *DeviceBuffer::Create(sizeof(float) * c.rows);
  DeviceBuffer dy_dev = UploadAs(dy, c.dtype), dx_dev = UploadAs(dx0, c.dtype);
  DeviceBuffer dg_dev = *DeviceBuffer::FromHost(dgamma0);
  RmsNormArgs a;
  a.dtype = c.dtype;
  a.rows = c.rows;
  a.width = c.width;
  a.eps = static_cast<float>(eps);
  a.x = x_dev.get();
  a.gamma = g_dev.as<float>();
  a.y = y_dev.get();
  a.rstd = rstd_dev.as<float>();
  ASSERT_TRUE(RmsNormForwardCuda(a, nullptr).ok());
  a.dy = dy_dev.get();
  a.dx = dx_dev.get();
  a.accumulate_dx = true;
  a.dgamma = dg_dev.as<float>();
  ASSERT_TRUE(RmsNormBackwardCuda(a, nullptr).ok());

  std::vector<double> gd(gamma.begin(), gamma.end());
  std::vector<double> want_y, want_dx(x.size()), want_dg(dgamma0.begin(), dgamma0.end());
  for (int64_t t = 0; t < c.rows; ++t) {
    std::vector<double> xr(x.begin() + t * c.width, x.begin() + (t + 1) * c.width);
    std::vector<double> yr = RmsNormRow(xr.data(), gd, eps);
    want_y.insert(want_y.end(), yr.begin(), yr.end());
    // L = sum_j dy_j y_j: dL/dx by central differences, dL/dg exactly (y is linear in g).
    auto loss = [&]() {
      std::vector<double> y = RmsNormRow(xr.data(), gd, eps);
      double l = 0;
      for (int64_t j = 0; j < c.width; ++j) l += dy[t * c.width + j] * y[j];
      return l;
    };
    for (int64_t j = 0; j < c.width; ++j) {
      want_dx[t * c.width + j] = dx0[t * c.width + j] + CentralDiff(loss, &xr[j], 1e-4);
      want_dg[j] += dy[t * c.width + j] * yr[j] / gd[j];
    }
  }
  const double rtol = c.dtype == DType::kBF16 ? 1.0 / 128 : 1e-4;
  ExpectAllNear(DownloadAsDouble(y_dev, c.dtype), want_y, 1e-5, rtol, "y");
  ExpectAllNear(DownloadAsDouble(dx_dev, c.dtype), want_dx, 1e-4, rtol, "dx");
  ExpectAllNear(*dg_dev.ToHost<float>(), want_dg, 1e-3, 1e-4, "dgamma");

  // Backward without the saved rstd (recomputed from x) gives the same dx.
  DeviceBuffer dx2 = UploadAs(dx0, c.dtype);
  a.rstd = nullptr;
  a.dx = dx2.get();
  a.dgamma = nullptr;
  ASSERT_TRUE(RmsNormBackwardCuda(a, nullptr).ok());
  ExpectAllNear(DownloadAsDouble(dx2, c.dtype), want_dx, 1e-4, rtol, "dx (recomputed rstd)");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RmsNormCuda,
    ::testing::Values(RmsCase{DType::kF32, 5, 64}, RmsCase{DType::kF32, 300, 1000},
                      RmsCase{DType::kBF16, 64, 4096},
                      RmsCase{DType::kBF16, 3, 20000}));  // > 48 KiB dgamma smem

TEST(RmsNormCuda, BadArgumentsAreInvalidArgument) {
  GRADSUM_SKIP_WITHOUT_GPU();
  DeviceBuffer x = *DeviceBuffer::Create(64 * 4), g = *DeviceBuffer::Create(64 * 4);
  RmsNormArgs a;
  a.rows = 1;
  a.width = 64;
  a.x = x.get();
  a.gamma = g.as<float>();
  a.y = x.get();
  ASSERT_TRUE(RmsNormForwardCuda(a, nullptr).ok());
  RmsNormArgs bad = a;
  bad.width = 0;
  EXPECT_EQ(RmsNormForwardCuda(bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
  bad = a;
  bad.width = 30000;
  EXPECT_EQ(RmsNormForwardCuda(bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
  bad = a;
  bad.eps = 0;
  EXPECT_EQ(RmsNormForwardCuda(bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
  bad = a;
  bad.dtype = DType::kI32;
  EXPECT_EQ(RmsNormForwardCuda(bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> host(64);
  bad = a;
  bad.gamma = host.data();
  EXPECT_EQ(RmsNormForwardCuda(bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RmsNormBackwardCuda(a, nullptr).code(), absl::StatusCode::kInvalidArgument);  // no dy
}

class SwiGluCuda : public ::testing::TestWithParam<DType> {};

TEST_P(SwiGluCuda, ForwardAndInPlaceBackwardMatchReference) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const DType dtype = GetParam();
  const int64_t n = 100003;  // odd: not a multiple of any vector width
  std::vector<float> g = RandomNormal(n, 1, 3.0f), u = RandomNormal(n, 2), dh = RandomNormal(n, 3);
  RoundTo(dtype, &g);
  RoundTo(dtype, &u);
  RoundTo(dtype, &dh);
  DeviceBuffer g_dev = UploadAs(g, dtype), u_dev = UploadAs(u, dtype),
               h_dev = UploadAs(std::vector<float>(n), dtype);
  DeviceBuffer dh_dev = UploadAs(dh, dtype);
  SwiGluArgs s;
  s.dtype = dtype;
  s.n = n;
  s.gate = g_dev.get();
  s.up = u_dev.get();
  s.out = h_dev.get();
  ASSERT_TRUE(SwiGluForwardCuda(s, nullptr).ok());
  s.d_out = dh_dev.get();
  s.d_gate = g_dev.get();  // in place: gradients overwrite the saved activations
  s.d_up = u_dev.get();
  ASSERT_TRUE(SwiGluBackwardCuda(s, nullptr).ok());

  auto silu = [](double x) { return x / (1.0 + std::exp(-x)); };
  std::vector<double> want_h(n), want_dg(n), want_du(n);
  for (int64_t i = 0; i < n; ++i) {
    want_h[i] = silu(g[i]) * u[i];
    // d/dg of silu(g) * u by central differences; d/du exactly.
    const double h = 1e-5 * std::max(1.0, std::abs(static_cast<double>(g[i])));
    want_dg[i] = dh[i] * u[i] * (silu(g[i] + h) - silu(g[i] - h)) / (2 * h);
    want_du[i] = dh[i] * silu(g[i]);
  }
  const double rtol = dtype == DType::kBF16 ? 1.0 / 128 : 1e-5;
  ExpectAllNear(DownloadAsDouble(h_dev, dtype), want_h, 1e-6, rtol, "h");
  ExpectAllNear(DownloadAsDouble(g_dev, dtype), want_dg, 1e-5, rtol, "d_gate");
  ExpectAllNear(DownloadAsDouble(u_dev, dtype), want_du, 1e-6, rtol, "d_up");
}

INSTANTIATE_TEST_SUITE_P(DTypes, SwiGluCuda, ::testing::Values(DType::kF32, DType::kBF16));

TEST(SwiGluCuda, BadArgumentsAreInvalidArgument) {
  GRADSUM_SKIP_WITHOUT_GPU();
  SwiGluArgs s;
  s.n = -1;
  EXPECT_EQ(SwiGluForwardCuda(s, nullptr).code(), absl::StatusCode::kInvalidArgument);
  s.n = 4;
  EXPECT_EQ(SwiGluForwardCuda(s, nullptr).code(), absl::StatusCode::kInvalidArgument);  // null
}

TEST(LayersCudaWithoutDevice, ReturnsFailedPreconditionNotACrash) {
  std::string why;
  if (::gradsum::testing::CudaDeviceAvailable(&why)) GTEST_SKIP() << "a GPU is present";
  RmsNormArgs a;
  a.rows = 1;
  a.width = 4;
  EXPECT_EQ(RmsNormForwardCuda(a, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  SwiGluArgs s;
  s.n = 4;
  EXPECT_EQ(SwiGluBackwardCuda(s, nullptr).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace gradsum::moe
