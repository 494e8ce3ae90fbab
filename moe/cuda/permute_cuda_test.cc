// Checks the CUDA token permutation against a straightforward CPU reference: a stable sort
// of the copies c = t * K + k by expert (the send order of moe/dispatch.cc), and double-
// precision combine / combine-backward. Skips without a GPU.
#include "moe/cuda/permute_cuda.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "core/cuda/device_buffer.h"
#include "core/half.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/gpu_compare.h"
#include "testing/gpu_test_util.h"

namespace gradsum::moe {
namespace {

using cuda::DeviceBuffer;
using ::gradsum::testing::Dev;
using ::gradsum::testing::DownloadAsDouble;
using ::gradsum::testing::ExpectAllNear;
using ::gradsum::testing::Host;
using ::gradsum::testing::RandomNormal;
using ::gradsum::testing::UploadAs;
using ::testing::HasSubstr;

// Random expert indices: distinct experts per token (like top-K), some tokens unrouted
// (-1 in every slot), optionally skewed so that one expert gets most copies.
std::vector<int32_t> RandomIndices(int64_t T, int K, int E, uint32_t seed, bool skewed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> idx(T * K);
  std::vector<int32_t> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    if (t % 7 == 3) {
      for (int k = 0; k < K; ++k) idx[t * K + k] = -1;
      continue;
    }
    std::shuffle(experts.begin(), experts.end(), gen);
    if (skewed) std::swap(*std::find(experts.begin(), experts.end(), 0), experts[0]);
    for (int k = 0; k < K; ++k) idx[t * K + k] = experts[k];
  }
  return idx;
}

struct Plan {
  DeviceBuffer index, offsets, perm, pos;
  PermutePlanCudaArgs args;
};

absl::Status MakePlan(const std::vector<int32_t>& idx, int64_t T, int K, int E, Plan* p) {
  p->index = Dev(idx);
  p->offsets = *DeviceBuffer::Create(sizeof(int64_t) * (E + 1));
  p->perm = *DeviceBuffer::Create(sizeof(int64_t) * std::max<int64_t>(T * K, 1));
  p->pos = *DeviceBuffer::Create(sizeof(int64_t) * std::max<int64_t>(T * K, 1));
  p->args.expert_index = p->index.as<int32_t>();
  p->args.tokens = T;
  p->args.top_k = K;
  p->args.experts = E;
  p->args.expert_offsets = p->offsets.as<int64_t>();
  p->args.permuted_copy = p->perm.as<int64_t>();
  p->args.copy_position = p->pos.as<int64_t>();
  return PermutePlanCuda(p->args, nullptr);
}

struct Shape {
  int64_t T;
  int K;
  int E;
  int64_t D;
  bool skewed;
};

class PermuteCuda : public ::testing::TestWithParam<Shape> {};

TEST_P(PermuteCuda, PlanIsTheStableSortByExpert) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const Shape s = GetParam();
  std::vector<int32_t> idx = RandomIndices(s.T, s.K, s.E, 1, s.skewed);
  Plan p;
  ASSERT_TRUE(MakePlan(idx, s.T, s.K, s.E, &p).ok());
  // Reference: copies sorted by (expert, copy index), unrouted copies dropped.
  std::vector<int64_t> order;
  for (int64_t c = 0; c < s.T * s.K; ++c) {
    if (idx[c] >= 0) order.push_back(c);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return idx[x] < idx[y]; });
  std::vector<int64_t> want_offsets(s.E + 1, 0);
  for (int64_t c : order) ++want_offsets[idx[c] + 1];
  for (int e = 0; e < s.E; ++e) want_offsets[e + 1] += want_offsets[e];
  std::vector<int64_t> want_perm(s.T * s.K, -1), want_pos(s.T * s.K, -1);
  for (size_t i = 0; i < order.size(); ++i) {
    want_perm[i] = order[i];
    want_pos[order[i]] = static_cast<int64_t>(i);
  }
  EXPECT_EQ(Host<int64_t>(p.offsets), want_offsets);
  EXPECT_EQ(Host<int64_t>(p.perm), want_perm);
  EXPECT_EQ(Host<int64_t>(p.pos), want_pos);
}

TEST_P(PermuteCuda, GatherCombineAndBackwardMatchReference) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const Shape s = GetParam();
  const int64_t copies = s.T * s.K;
  std::vector<int32_t> idx = RandomIndices(s.T, s.K, s.E, 2, s.skewed);
  Plan p;
  ASSERT_TRUE(MakePlan(idx, s.T, s.K, s.E, &p).ok());
  const std::vector<int64_t> perm = Host<int64_t>(p.perm), pos = Host<int64_t>(p.pos);
  const int64_t routed = Host<int64_t>(p.offsets)[s.E];

  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    // Values exactly representable in bf16, so both dtypes share one reference.
    std::vector<float> x = RandomNormal(s.T * s.D, 3), rows = RandomNormal(copies * s.D, 4);
    std::vector<float> dy = RandomNormal(s.T * s.D, 5), w = RandomNormal(copies, 6);
    for (auto* v : {&x, &rows, &dy}) {
      for (float& f : *v) f = BF16::FromFloat(f).ToFloat();
    }
    auto upload = [&](const std::vector<float>& v) { return UploadAs(v, dtype); };
    auto download = [&](const DeviceBuffer& d) { return DownloadAsDouble(d, dtype); };
    const double rtol = dtype == DType::kBF16 ? 1.0 / 128 : 1e-5;

    // Gather: bit-exact copies of the token rows.
    DeviceBuffer x_dev = upload(x), send = upload(std::vector<float>(copies * s.D, 0.0f));
    ASSERT_TRUE(PermuteRowsCuda({x_dev.get(), dtype, s.D, send.get()}, p.args, nullptr).ok());
    std::vector<double> sent = download(send);
    for (int64_t r = 0; r < routed; ++r) {
      for (int64_t j = 0; j < s.D; ++j) {
        ASSERT_EQ(sent[r * s.D + j], x[(perm[r] / s.K) * s.D + j]) << "row " << r;
      }
    }

    // Combine: y[t] = sum_k w_tk rows[pos(t, k)], added onto y's old value (accumulate).
    std::vector<float> y0 = RandomNormal(s.T * s.D, 7);
    for (float& f : y0) f = BF16::FromFloat(f).ToFloat();
    DeviceBuffer rows_dev = upload(rows), w_dev = Dev(w), y_dev = upload(y0);
    CombineCudaArgs cmb;
    cmb.dtype = dtype;
    cmb.width = s.D;
    cmb.rows = rows_dev.get();
    cmb.weights = w_dev.as<float>();
    cmb.out = y_dev.get();
    cmb.accumulate = true;
    ASSERT_TRUE(CombineCuda(cmb, p.args, nullptr).ok());
    std::vector<double> want_y(s.T * s.D);
    for (int64_t t = 0; t < s.T; ++t) {
      for (int64_t j = 0; j < s.D; ++j) {
        double acc = y0[t * s.D + j];
        for (int k = 0; k < s.K; ++k) {
          const int64_t q = pos[t * s.K + k];
          if (q >= 0) acc += static_cast<double>(w[t * s.K + k]) * rows[q * s.D + j];
        }
        want_y[t * s.D + j] = acc;
      }
    }
    ExpectAllNear(download(y_dev), want_y, 1e-5, rtol, "combine");

    // Backward: d_rows = w * dy at each copy's position; dw = <dy_t, rows[pos]>.
    DeviceBuffer dy_dev = upload(dy), drows_dev = upload(std::vector<float>(copies * s.D, 0.0f));
    DeviceBuffer dw_dev = Dev(std::vector<float>(copies, 99.0f));
    cmb.d_out = dy_dev.get();
    cmb.d_rows = drows_dev.get();
    cmb.d_weights = dw_dev.as<float>();
    ASSERT_TRUE(CombineBackwardCuda(cmb, p.args, nullptr).ok());
    std::vector<double> want_drows(copies * s.D, 0.0), want_dw(copies, 0.0);
    for (int64_t c = 0; c < copies; ++c) {
      const int64_t q = pos[c], t = c / s.K;
      if (q < 0) continue;
      for (int64_t j = 0; j < s.D; ++j) {
        want_drows[q * s.D + j] = static_cast<double>(w[c]) * dy[t * s.D + j];
        want_dw[c] += static_cast<double>(dy[t * s.D + j]) * rows[q * s.D + j];
      }
    }
    ExpectAllNear(download(drows_dev), want_drows, 1e-6, rtol, "d_rows");
    ExpectAllNear(Host<float>(dw_dev), want_dw, 1e-4, 1e-4, "d_weights");

    // The gather's backward: d_x = sum_k d_send[pos(t, k)] (combine with unit weights).
    DeviceBuffer dx_dev = upload(std::vector<float>(s.T * s.D, 0.0f));
    CombineCudaArgs back;
    back.dtype = dtype;
    back.width = s.D;
    back.rows = drows_dev.get();
    back.out = dx_dev.get();
    ASSERT_TRUE(CombineCuda(back, p.args, nullptr).ok());
    const std::vector<double> drows_got = download(drows_dev);
    std::vector<double> want_dx(s.T * s.D, 0.0);
    for (int64_t c = 0; c < copies; ++c) {
      if (pos[c] < 0) continue;
      for (int64_t j = 0; j < s.D; ++j) want_dx[(c / s.K) * s.D + j] += drows_got[pos[c] * s.D + j];
    }
    ExpectAllNear(download(dx_dev), want_dx, 1e-6, rtol, "d_x");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PermuteCuda,
                         ::testing::Values(Shape{1, 1, 1, 8, false},          // minimal
                                           Shape{50, 2, 8, 64, false},        // one chunk
                                           Shape{700, 4, 60, 96, false},      // many chunks
                                           Shape{513, 8, 16, 33, true},       // skewed, odd width
                                           Shape{300, 2, 1024, 16, false}));  // E at the limit

TEST(PermuteCuda, ExpertIndexOutOfRangeIsInvalidArgumentNamingTokenAndSlot) {
  GRADSUM_SKIP_WITHOUT_GPU();
  std::vector<int32_t> idx = {0, 1, 2, 3, 1, 9, -2, 0};  // T = 4, K = 2, E = 4
  Plan p;
  absl::Status s = MakePlan(idx, 4, 2, 4, &p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("token 2 slot 1"));
}

TEST(PermuteCuda, ZeroTokensAndBadShapes) {
  GRADSUM_SKIP_WITHOUT_GPU();
  Plan p;
  ASSERT_TRUE(MakePlan({}, 0, 2, 4, &p).ok());
  EXPECT_EQ(Host<int64_t>(p.offsets), std::vector<int64_t>(5, 0));
  EXPECT_EQ(MakePlan({0}, 1, 1, 0, &p).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakePlan({0}, 1, 1, 5000, &p).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakePlan({0}, 1, 0, 4, &p).code(), absl::StatusCode::kInvalidArgument);
}

TEST(PermuteCudaWithoutDevice, ReturnsFailedPreconditionNotACrash) {
  std::string why;
  if (::gradsum::testing::CudaDeviceAvailable(&why)) GTEST_SKIP() << "a GPU is present";
  PermutePlanCudaArgs a;
  a.tokens = 1;
  a.top_k = 1;
  a.experts = 1;
  EXPECT_EQ(PermutePlanCuda(a, nullptr).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace gradsum::moe
