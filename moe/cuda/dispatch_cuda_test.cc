// The dispatch kernels (permute plan, gather, grouped experts through cuBLAS + SwiGLU,
// weighted combine, and their backward) on a fixed routing, in f32 and bf16 activations,
// against the CPU dispatch/combine (moe/dispatch.h) on one EP rank: same send order,
// outputs, input and combine-weight gradients, expert weight gradients. The layer that
// ships (router, NCCL exchange and these kernels: moe/cuda/moe_layer_cuda.h) is checked
// against the CPU's through the model's ops, model/cuda/cuda_ops_test.cc. Skips without a
// GPU.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/cuda/device_buffer.h"
#include "core/cuda/gemm.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "moe/cuda/experts_cuda.h"
#include "moe/cuda/permute_cuda.h"
#include "moe/dispatch.h"
#include "moe/experts.h"
#include "testing/gpu_compare.h"
#include "testing/gpu_test_util.h"
#include "testing/run_ranks.h"

namespace gradsum::moe {
namespace {

using cuda::CublasHandle;
using cuda::DeviceBuffer;
using ::gradsum::testing::Dev;
using ::gradsum::testing::DevZeros;
using ::gradsum::testing::DownloadAsDouble;
using ::gradsum::testing::ExpectAllNear;
using ::gradsum::testing::Host;
using ::gradsum::testing::RandomNormal;
using ::gradsum::testing::RoundTo;
using ::gradsum::testing::UploadAs;

double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float f : v) m = std::max(m, static_cast<double>(std::abs(f)));
  return m;
}

struct LayerCase {
  int64_t T, D, H;
  int E, K;
  DType dtype;  // activations and expert weights on the GPU; the CPU reference is fp32
};

class DispatchCuda : public ::testing::TestWithParam<LayerCase> {};

TEST_P(DispatchCuda, ForwardAndBackwardMatchCpuDispatchOnOneRank) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const LayerCase c = GetParam();
  const int64_t T = c.T, D = c.D, H = c.H, copies = T * c.K;
  const int E = c.E, K = c.K;
  // Routing: distinct experts per token, every 7th token unrouted (padding).
  std::mt19937 gen(1);
  std::vector<int32_t> idx(copies);
  std::vector<int32_t> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(experts.begin(), experts.end(), gen);
    for (int k = 0; k < K; ++k) idx[t * K + k] = t % 7 == 3 ? -1 : experts[k];
  }
  std::vector<float> a = RandomNormal(T * D, 2), cw = RandomNormal(copies, 3);
  std::vector<float> wg = RandomNormal(E * D * H, 4, 0.2f), wu = RandomNormal(E * D * H, 5, 0.2f);
  std::vector<float> wd = RandomNormal(E * H * D, 6, 0.2f), dy = RandomNormal(T * D, 7);
  // The CPU sees exactly the values the GPU stores (bf16 rounding of inputs and weights);
  // the remaining differences are the GPU's bf16 intermediates.
  const DType dt = c.dtype;
  for (auto* v : {&a, &wg, &wu, &wd, &dy}) RoundTo(dt, v);
  // fp32: fp32 rounding only; bf16: a few bf16 roundings of intermediates (2^-9 each).
  const double rtol = dt == DType::kBF16 ? 3e-2 : 1e-4,
               atol_frac = dt == DType::kBF16 ? 2e-2 : 1e-5;
  for (int64_t t = 0; t < T; ++t) {
    if (t % 7 == 3) std::fill(cw.begin() + t * K, cw.begin() + (t + 1) * K, 0.0f);
  }

  // CPU: dispatch/combine over a one-rank EP group.
  DispatchConfig config{D, H, E, K};
  ExpertWeights cpu_w{wg, wu, wd};
  std::vector<float> y_cpu(T * D), da_cpu(T * D, 0.0f), dcw_cpu(copies);
  std::vector<float> dwg_cpu(E * D * H, 0.0f), dwu_cpu(E * D * H, 0.0f), dwd_cpu(E * H * D, 0.0f);
  DispatchState state;
  absl::Status cpu = ::gradsum::testing::RunRanks(1, [&](Communicator& ep) -> absl::Status {
    absl::Status s =
        DispatchCombineForward(ep, config, cpu_w, a, idx, cw, absl::MakeSpan(y_cpu), &state);
    if (!s.ok()) return s;
    ExpertWeightGrads g{absl::MakeSpan(dwg_cpu), absl::MakeSpan(dwu_cpu), absl::MakeSpan(dwd_cpu)};
    return DispatchCombineBackward(ep, config, cpu_w, state, dy, absl::MakeSpan(da_cpu),
                                   absl::MakeSpan(dcw_cpu), g);
  });
  ASSERT_TRUE(cpu.ok()) << cpu;

  // GPU: plan, gather, experts, combine.
  absl::StatusOr<CublasHandle> blas = CublasHandle::Create();
  ASSERT_TRUE(blas.ok()) << blas.status();
  DeviceBuffer idx_dev = Dev(idx), offsets = DevZeros(sizeof(int64_t) * (E + 1));
  DeviceBuffer perm = DevZeros(sizeof(int64_t) * copies), pos = DevZeros(sizeof(int64_t) * copies);
  PermutePlanCudaArgs plan;
  plan.expert_index = idx_dev.as<int32_t>();
  plan.tokens = T;
  plan.top_k = K;
  plan.experts = E;
  plan.expert_offsets = offsets.as<int64_t>();
  plan.permuted_copy = perm.as<int64_t>();
  plan.copy_position = pos.as<int64_t>();
  ASSERT_TRUE(PermutePlanCuda(plan, nullptr).ok());
  const size_t es = DTypeSize(dt);
  DeviceBuffer a_dev = UploadAs(a, dt), send = DevZeros(es * copies * D);
  ASSERT_TRUE(PermuteRowsCuda({a_dev.get(), dt, D, send.get()}, plan, nullptr).ok());
  const std::vector<int64_t> host_offsets = Host<int64_t>(offsets);
  const int64_t routed = host_offsets[E];
  std::vector<int64_t> perm_host = Host<int64_t>(perm);
  perm_host.resize(routed);
  EXPECT_EQ(perm_host, state.send_copy);  // the same send order as the CPU dispatch

  DeviceBuffer wg_dev = UploadAs(wg, dt), wu_dev = UploadAs(wu, dt), wd_dev = UploadAs(wd, dt);
  ExpertsCudaConfig ec{D, H, E, dt};
  ExpertsCudaWeights ew{wg_dev.get(), wu_dev.get(), wd_dev.get()};
  DeviceBuffer gate_pre = DevZeros(es * copies * H), up_pre = DevZeros(es * copies * H);
  DeviceBuffer hidden = DevZeros(es * copies * H), expert_out = DevZeros(es * copies * D);
  ExpertsCudaSaved saved{gate_pre.get(), up_pre.get(), hidden.get()};
  absl::Status s =
      ExpertsForwardCuda(*blas, nullptr, ec, ew, send.get(), host_offsets, expert_out.get(), saved);
  ASSERT_TRUE(s.ok()) << s;
  DeviceBuffer cw_dev = Dev(cw), y_dev = DevZeros(es * T * D);
  CombineCudaArgs cmb;
  cmb.dtype = dt;
  cmb.width = D;
  cmb.rows = expert_out.get();
  cmb.weights = cw_dev.as<float>();
  cmb.out = y_dev.get();
  ASSERT_TRUE(CombineCuda(cmb, plan, nullptr).ok());
  ExpectAllNear(DownloadAsDouble(y_dev, dt), y_cpu, atol_frac * MaxAbs(y_cpu), rtol, "y");

  // Backward: combine, experts, gather.
  DeviceBuffer dy_dev = UploadAs(dy, dt), d_rows = DevZeros(es * copies * D);
  DeviceBuffer dcw_dev = DevZeros(sizeof(float) * copies);
  cmb.d_out = dy_dev.get();
  cmb.d_rows = d_rows.get();
  cmb.d_weights = dcw_dev.as<float>();
  ASSERT_TRUE(CombineBackwardCuda(cmb, plan, nullptr).ok());
  DeviceBuffer dx_rows = DevZeros(es * copies * D);
  DeviceBuffer dwg = DevZeros(sizeof(float) * E * D * H), dwu = DevZeros(sizeof(float) * E * D * H);
  DeviceBuffer dwd = DevZeros(sizeof(float) * E * H * D);
  ExpertsCudaWeightGrads eg{dwg.as<float>(), dwu.as<float>(), dwd.as<float>()};
  s = ExpertsBackwardCuda(*blas, nullptr, ec, ew, send.get(), host_offsets, saved, d_rows.get(),
                          dx_rows.get(), eg);
  ASSERT_TRUE(s.ok()) << s;
  DeviceBuffer da_dev = DevZeros(es * T * D);
  CombineCudaArgs back;
  back.dtype = dt;
  back.width = D;
  back.rows = dx_rows.get();
  back.out = da_dev.get();
  ASSERT_TRUE(CombineCuda(back, plan, nullptr).ok());

  ExpectAllNear(Host<float>(dcw_dev), dcw_cpu, atol_frac * MaxAbs(dcw_cpu), rtol,
                "d_combine_weight");
  ExpectAllNear(DownloadAsDouble(da_dev, dt), da_cpu, atol_frac * MaxAbs(da_cpu), rtol, "d_a");
  ExpectAllNear(Host<float>(dwg), dwg_cpu, atol_frac * MaxAbs(dwg_cpu), rtol, "d_gate");
  ExpectAllNear(Host<float>(dwu), dwu_cpu, atol_frac * MaxAbs(dwu_cpu), rtol, "d_up");
  ExpectAllNear(Host<float>(dwd), dwd_cpu, atol_frac * MaxAbs(dwd_cpu), rtol, "d_down");
}

INSTANTIATE_TEST_SUITE_P(Shapes, DispatchCuda,
                         ::testing::Values(LayerCase{40, 16, 24, 4, 2, DType::kF32},  // small
                                           LayerCase{600, 64, 96, 16, 4,
                                                     DType::kF32},  // many chunks
                                           LayerCase{600, 64, 96, 16, 4, DType::kBF16}));

TEST(ExpertsCuda, BadOffsetsAreInvalidArgument) {
  GRADSUM_SKIP_WITHOUT_GPU();
  absl::StatusOr<CublasHandle> blas = CublasHandle::Create();
  ASSERT_TRUE(blas.ok());
  DeviceBuffer buf = DevZeros(4096);
  ExpertsCudaConfig ec{4, 4, 2, DType::kF32};
  ExpertsCudaWeights ew{buf.get(), buf.get(), buf.get()};
  ExpertsCudaSaved saved{buf.get(), buf.get(), buf.get()};
  const std::vector<int64_t> short_offsets = {0, 2}, decreasing = {0, 3, 2}, not_zero = {1, 2, 3};
  for (const auto& offs : {short_offsets, decreasing, not_zero}) {
    EXPECT_EQ(ExpertsForwardCuda(*blas, nullptr, ec, ew, buf.get(), offs, buf.get(), saved).code(),
              absl::StatusCode::kInvalidArgument);
  }
  ExpertsCudaConfig f16 = ec;
  f16.dtype = DType::kF16;
  EXPECT_EQ(
      ExpertsForwardCuda(*blas, nullptr, f16, ew, buf.get(), {0, 1, 2}, buf.get(), saved).code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gradsum::moe
