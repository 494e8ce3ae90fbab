// The model's own CUDA kernels (model/cuda/model_kernels.h) against the CPU: embedding gather
// and scatter-add against model/layers.h, the residual add, and the bf16 conversions against
// core/half.h for every bf16 bit pattern and a sweep of floats (ties, NaN, inf, subnormals).
// Skips without a GPU; the no-device case checks the FailedPrecondition path.
#include "model/cuda/model_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/cuda/device_buffer.h"
#include "core/half.h"
#include "gtest/gtest.h"
#include "model/layers.h"
#include "testing/gpu_compare.h"
#include "testing/gpu_test_util.h"

namespace gradsum::model {
namespace {

using ::gradsum::testing::Dev;
using ::gradsum::testing::DevZeros;
using ::gradsum::testing::Host;
using ::gradsum::testing::RandomNormal;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(ModelKernelsCuda, EmbeddingGatherAndScatterAddMatchTheCpu) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t V = 37, D = 24, T = 1000;
  std::mt19937 gen(5);
  std::vector<int32_t> tokens(T);
  for (int32_t& t : tokens) t = static_cast<int32_t>(gen() % V);  // many repeats
  const std::vector<float> emb = RandomNormal(V * D, 1), dh = RandomNormal(T * D, 2);
  std::vector<float> h_cpu(T * D), demb_cpu(V * D, 0.5f);
  EmbeddingForward(emb, tokens, D, absl::MakeSpan(h_cpu));
  EmbeddingBackward(tokens, dh, D, absl::MakeSpan(demb_cpu));

  auto d_emb = Dev(emb), d_tokens = Dev(tokens), d_dh = Dev(dh);
  auto d_h = DevZeros(T * D * 4);
  auto d_demb = Dev(std::vector<float>(V * D, 0.5f));  // accumulates onto existing values
  cuda::CudaStream stream = *cuda::CudaStream::Create();
  ASSERT_TRUE(EmbeddingForwardCuda(d_emb.as<float>(), d_tokens.as<int32_t>(), T, D, d_h.as<float>(),
                                   stream.get())
                  .ok());
  ASSERT_TRUE(EmbeddingBackwardCuda(d_tokens.as<int32_t>(), d_dh.as<float>(), T, D,
                                    d_demb.as<float>(), stream.get())
                  .ok());
  ASSERT_TRUE(stream.Synchronize().ok());
  EXPECT_EQ(Host<float>(d_h), h_cpu);  // a gather is exact
  // Atomics add in another order than the CPU's token order: fp32 rounding of ~T/V terms.
  const std::vector<float> demb_gpu = Host<float>(d_demb);
  ASSERT_EQ(demb_gpu.size(), demb_cpu.size());
  for (size_t i = 0; i < demb_cpu.size(); ++i) {
    EXPECT_NEAR(demb_gpu[i], demb_cpu[i], 1e-5 * (1 + std::abs(demb_cpu[i]))) << i;
  }
}

TEST(ModelKernelsCuda, AddIsExactAndMayWorkInPlace) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t n = 100003;
  const std::vector<float> a = RandomNormal(n, 3), b = RandomNormal(n, 4);
  auto d_a = Dev(a), d_b = Dev(b);
  cuda::CudaStream stream = *cuda::CudaStream::Create();
  ASSERT_TRUE(AddCuda(d_a.as<float>(), d_b.as<float>(), d_a.as<float>(), n, stream.get()).ok());
  ASSERT_TRUE(stream.Synchronize().ok());
  const std::vector<float> got = Host<float>(d_a);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], a[i] + b[i]) << i;
}

TEST(ModelKernelsCuda, Bf16ConversionsMatchCoreHalfBitForBit) {
  GRADSUM_SKIP_WITHOUT_GPU();
  // Widening: all 65536 patterns.
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  auto d_all = Dev(all);
  auto d_wide = DevZeros(65536 * 4);
  cuda::CudaStream stream = *cuda::CudaStream::Create();
  ASSERT_TRUE(Bf16ToF32Cuda(d_all.as<uint16_t>(), d_wide.as<float>(), 65536, stream.get()).ok());
  // Narrowing: ties at every exponent, NaN, infinities, subnormals and random floats.
  std::vector<float> f;
  for (int e = -140; e <= 127; e += 3) {
    const float base = std::ldexp(1.0f, e);
    f.push_back(base * (1.0f + 1.0f / 256.0f));           // exactly half an ulp above 1: tie
    f.push_back(base * (1.0f + 3.0f / 256.0f));           // tie with an odd neighbour
    f.push_back(-base * (1.0f + 1.0f / 256.0f + 1e-6f));  // just above a tie
  }
  for (float x : {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::nanf(""), -std::nanf("1"),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()}) {
    f.push_back(x);
  }
  for (float x : RandomNormal(4096, 9, 1e3f)) f.push_back(x);
  auto d_f = Dev(f);
  auto d_narrow = DevZeros(f.size() * 2);
  ASSERT_TRUE(F32ToBf16Cuda(d_f.as<float>(), d_narrow.as<uint16_t>(),
                            static_cast<int64_t>(f.size()), stream.get())
                  .ok());
  ASSERT_TRUE(stream.Synchronize().ok());
  const std::vector<float> wide = Host<float>(d_wide);
  for (uint32_t i = 0; i < 65536; ++i) {
    ASSERT_EQ(Bits(wide[i]), Bits(BF16{static_cast<uint16_t>(i)}.ToFloat())) << "pattern " << i;
  }
  const std::vector<uint16_t> narrow = Host<uint16_t>(d_narrow);
  for (size_t i = 0; i < f.size(); ++i) {
    const BF16 want = BF16::FromFloat(f[i]);
    if (std::isnan(f[i])) {
      EXPECT_TRUE(std::isnan(BF16{narrow[i]}.ToFloat())) << "NaN stays NaN, input " << i;
      EXPECT_EQ(narrow[i] & 0x8000, want.bits & 0x8000) << "NaN sign, input " << i;
    } else {
      EXPECT_EQ(narrow[i], want.bits) << "input " << f[i];
    }
  }
}

TEST(ModelKernelsCuda, BadArgumentsAreInvalidArgument) {
  GRADSUM_SKIP_WITHOUT_GPU();
  std::vector<float> host(8);
  auto d = DevZeros(64);
  cuda::CudaStream stream = *cuda::CudaStream::Create();
  EXPECT_EQ(AddCuda(host.data(), d.as<float>(), d.as<float>(), 8, stream.get()).code(),
            absl::StatusCode::kInvalidArgument);  // host pointer
  EXPECT_EQ(
      EmbeddingForwardCuda(nullptr, d.as<int32_t>(), 2, 4, d.as<float>(), stream.get()).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(F32ToBf16Cuda(d.as<float>(), d.as<uint16_t>(), -1, stream.get()).code(),
            absl::StatusCode::kInvalidArgument);
  // Zero sizes are no-ops, whatever the pointers.
  EXPECT_TRUE(EmbeddingBackwardCuda(nullptr, nullptr, 0, 4, nullptr, stream.get()).ok());
}

TEST(ModelKernelsCudaWithoutDevice, ReturnsFailedPreconditionNotACrash) {
  std::string why;
  if (::gradsum::testing::CudaDeviceAvailable(&why)) GTEST_SKIP() << "a GPU is present";
  EXPECT_EQ(AddCuda(nullptr, nullptr, nullptr, 4, nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Bf16ToF32Cuda(nullptr, nullptr, 4, nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace gradsum::model
