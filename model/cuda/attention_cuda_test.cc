// The GPU attention (model/cuda/attention_cuda.h) against the CPU kernel (model/attention.h,
// itself checked against a double reference in model/attention_test): forward and backward
// on the shapes of model/attention_testing.h (with and without GQA, kv_of_q subsets,
// head_dim 16 to 128, one document, many short ones, padding, which holds NaN here and must
// never be read, sequences that are not a multiple of the 64-token tile). Then: the same
// bits on a second run; the doc_start check (waited for, and through a flag); the argument
// errors. Cases that need a device skip without one; the argument checks that come before
// any CUDA call run anyway, and without a device a valid call is FailedPrecondition.
#include "model/cuda/attention_cuda.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/cuda/device_buffer.h"
#include "core/cuda/device_flag.h"
#include "gtest/gtest.h"
#include "model/attention.h"
#include "model/attention_testing.h"
#include "testing/gpu_compare.h"
#include "testing/gpu_test_util.h"

namespace gradsum::model {
namespace {

using ::gradsum::model::testing::Dims;
using ::gradsum::model::testing::ExpectNear;
using ::gradsum::model::testing::RandomTensor;
using ::gradsum::model::testing::SameBits;
using ::gradsum::testing::Dev;
using ::gradsum::testing::DevZeros;
using ::gradsum::testing::Host;

using Case = ::gradsum::model::testing::AttentionCase;

struct Tensors {
  std::vector<float> q, k, v, d_out;
};

// Random inputs; padding tokens' rows hold NaN, which no kernel may read.
Tensors MakeInputs(const Case& c, uint32_t seed) {
  const AttentionDims& dims = c.dims;
  const int64_t tokens = dims.num_seqs * dims.seq_len, d = dims.head_dim;
  Tensors in;
  in.q = RandomTensor(tokens * dims.q_heads * d, seed);
  in.k = RandomTensor(tokens * dims.kv_heads * d, seed + 1);
  in.v = RandomTensor(tokens * dims.kv_heads * d, seed + 2);
  in.d_out = RandomTensor(tokens * dims.q_heads * d, seed + 3);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t t = 0; t < tokens; ++t) {
    if (c.doc_start[t] >= 0) continue;
    for (int64_t x = 0; x < dims.q_heads * d; ++x) {
      in.q[t * dims.q_heads * d + x] = nan;
      in.d_out[t * dims.q_heads * d + x] = nan;
    }
    for (int64_t x = 0; x < dims.kv_heads * d; ++x) {
      in.k[t * dims.kv_heads * d + x] = nan;
      in.v[t * dims.kv_heads * d + x] = nan;
    }
  }
  return in;
}

struct Outputs {
  std::vector<float> out, lse, dq, dk, dv;
};

Outputs RunCpu(const Case& c, const Tensors& in) {
  const AttentionDims& dims = c.dims;
  const int64_t tokens = dims.num_seqs * dims.seq_len;
  Outputs o;
  o.out.resize(in.q.size());
  o.lse.resize(tokens * dims.q_heads);
  o.dq.resize(in.q.size());
  o.dk.resize(in.k.size());
  o.dv.resize(in.k.size());
  absl::Status s = AttentionForward(dims, in.q, in.k, in.v, c.doc_start, absl::MakeSpan(o.out),
                                    absl::MakeSpan(o.lse));
  EXPECT_TRUE(s.ok()) << s;
  s = AttentionBackward(dims, in.q, in.k, in.v, c.doc_start, o.out, o.lse, in.d_out,
                        absl::MakeSpan(o.dq), absl::MakeSpan(o.dk), absl::MakeSpan(o.dv));
  EXPECT_TRUE(s.ok()) << s;
  return o;
}

// Forward then backward on the device (outputs start as NaN: every element must be written).
Outputs RunGpu(const Case& c, const Tensors& in) {
  const AttentionDims& dims = c.dims;
  const int64_t tokens = dims.num_seqs * dims.seq_len;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto d_q = Dev(in.q), d_k = Dev(in.k), d_v = Dev(in.v), d_go = Dev(in.d_out);
  auto d_ds = Dev(c.doc_start);
  auto d_out = Dev(std::vector<float>(in.q.size(), nan));
  auto d_lse = Dev(std::vector<float>(tokens * dims.q_heads, nan));
  auto d_dq = Dev(std::vector<float>(in.q.size(), nan));
  auto d_dk = Dev(std::vector<float>(in.k.size(), nan));
  auto d_dv = Dev(std::vector<float>(in.k.size(), nan));
  cuda::CudaStream stream = *cuda::CudaStream::Create();
  absl::Status s =
      AttentionForwardCuda(dims, d_q.as<float>(), d_k.as<float>(), d_v.as<float>(),
                           d_ds.as<int32_t>(), d_out.as<float>(), d_lse.as<float>(), stream.get());
  EXPECT_TRUE(s.ok()) << s;
  s = AttentionBackwardCuda(dims, d_q.as<float>(), d_k.as<float>(), d_v.as<float>(),
                            d_ds.as<int32_t>(), d_out.as<float>(), d_lse.as<float>(),
                            d_go.as<float>(), d_dq.as<float>(), d_dk.as<float>(), d_dv.as<float>(),
                            stream.get());
  EXPECT_TRUE(s.ok()) << s;
  s = stream.Synchronize();
  EXPECT_TRUE(s.ok()) << s;
  Outputs o;
  o.out = Host<float>(d_out);
  o.lse = Host<float>(d_lse);
  o.dq = Host<float>(d_dq);
  o.dk = Host<float>(d_dk);
  o.dv = Host<float>(d_dv);
  return o;
}

// Another summation order than the CPU's: fp32 rounding, well inside the CPU kernel's own
// 1e-5 against double.
constexpr double kTol = 2e-5;

TEST(AttentionCuda, MatchesTheCpuKernel) {
  GRADSUM_SKIP_WITHOUT_GPU();
  for (const Case& c : ::gradsum::model::testing::AttentionCases()) {
    SCOPED_TRACE(c.name);
    const Tensors in = MakeInputs(c, 7);
    const Outputs want = RunCpu(c, in), got = RunGpu(c, in);
    ExpectNear(got.out, want.out, kTol, "out");
    ExpectNear(got.lse, want.lse, kTol, "lse");
    ExpectNear(got.dq, want.dq, kTol, "dq");
    ExpectNear(got.dk, want.dk, kTol, "dk");
    ExpectNear(got.dv, want.dv, kTol, "dv");
    // Padding: exact zeros, as on the CPU.
    for (int64_t t = 0; t < c.dims.num_seqs * c.dims.seq_len; ++t) {
      if (c.doc_start[t] >= 0) continue;
      for (int h = 0; h < c.dims.q_heads; ++h) {
        ASSERT_EQ(got.lse[t * c.dims.q_heads + h], 0.0f) << t;
        for (int64_t x = 0; x < c.dims.head_dim; ++x) {
          ASSERT_EQ(got.out[(t * c.dims.q_heads + h) * c.dims.head_dim + x], 0.0f) << t;
          ASSERT_EQ(got.dq[(t * c.dims.q_heads + h) * c.dims.head_dim + x], 0.0f) << t;
        }
      }
    }
  }
}

TEST(AttentionCuda, SameBitsOnEveryRun) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const Case c =
      ::gradsum::model::testing::AttentionCaseNamed("gqa_documents_across_blocks_padding_tail");
  const Tensors in = MakeInputs(c, 3);
  const Outputs a = RunGpu(c, in), b = RunGpu(c, in);
  EXPECT_TRUE(SameBits(a.out, b.out));
  EXPECT_TRUE(SameBits(a.lse, b.lse));
  EXPECT_TRUE(SameBits(a.dq, b.dq));
  EXPECT_TRUE(SameBits(a.dk, b.dk));
  EXPECT_TRUE(SameBits(a.dv, b.dv));
}

TEST(AttentionCuda, BadDocStartIsTheCpuKernelsError) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const AttentionDims dims = Dims(2, 8, 2, 1, 16);
  const std::vector<float> q = RandomTensor(16 * 2 * 16, 1), kv = RandomTensor(16 * 16, 2);
  // Sequence 1, token 4 continues a document that token 3 (padding) is not in.
  const std::vector<int32_t> bad = {0, 0, 0, 0, 0, -1, -1, -1, 0, 0, 0, -1, 0, 0, 0, 0};
  std::vector<float> out(q.size()), lse(32);
  const absl::Status want =
      AttentionForward(dims, q, kv, kv, bad, absl::MakeSpan(out), absl::MakeSpan(lse));
  ASSERT_EQ(want.code(), absl::StatusCode::kInvalidArgument);
  auto d_q = Dev(q), d_kv = Dev(kv), d_ds = Dev(bad);
  auto d_out = DevZeros(q.size() * 4), d_lse = DevZeros(32 * 4);
  cuda::CudaStream stream = *cuda::CudaStream::Create();
  const absl::Status got =
      AttentionForwardCuda(dims, d_q.as<float>(), d_kv.as<float>(), d_kv.as<float>(),
                           d_ds.as<int32_t>(), d_out.as<float>(), d_lse.as<float>(), stream.get());
  EXPECT_EQ(got, want);
  // Through a flag: the call computes (in bounds) and the flag holds the token.
  absl::StatusOr<cuda::DeviceIndexFlag> flag = cuda::DeviceIndexFlag::Create();
  ASSERT_TRUE(flag.ok()) << flag.status();
  EXPECT_TRUE(AttentionForwardCuda(dims, d_q.as<float>(), d_kv.as<float>(), d_kv.as<float>(),
                                   d_ds.as<int32_t>(), d_out.as<float>(), d_lse.as<float>(),
                                   stream.get(), &*flag)
                  .ok());
  absl::StatusOr<std::optional<int64_t>> index = flag->ReadAndReset(stream.get());
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_TRUE(index->has_value());
  EXPECT_EQ(**index, 12);
}

// Runs with or without a device: the dims checks come before any CUDA call.
TEST(AttentionCuda, BadArgumentsAreInvalidArgumentAndNoDeviceIsFailedPrecondition) {
  const float* none = nullptr;
  float* out = nullptr;
  struct Bad {
    AttentionDims dims;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {Dims(1, 8, 4, 3, 16), "q_heads = 4 is not a multiple of kv_heads = 3"},
      {Dims(1, 8, 4, 2, 16, {0, 2, 1, 1}), "kv_of_q[1] = 2"},
      {Dims(1, 8, 2, 2, 129), "head_dim = 129 is above the limit of 128"},
      {Dims(1, 8, 512, 2, 16), "q_heads = 512 and kv_heads = 2 must be at most 256"},
      {Dims(int64_t{1} << 30, 1 << 20, 1, 1, 16), "thread blocks"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.message);
    absl::Status s = AttentionForwardCuda(b.dims, none, none, none, nullptr, out, out, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(b.message), std::string::npos) << s;
    s = AttentionBackwardCuda(b.dims, none, none, none, nullptr, none, none, none, out, out, out,
                              nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(b.message), std::string::npos) << s;
  }
  std::string why;
  const absl::Status s =
      AttentionForwardCuda(Dims(1, 8, 2, 2, 16), none, none, none, nullptr, out, out, nullptr);
  if (!::gradsum::testing::CudaDeviceAvailable(&why)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  } else {
    // Host (here: null) pointers are InvalidArgument naming the argument.
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("q"), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace gradsum::model
