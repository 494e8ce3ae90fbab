// Compares the CUDA router with the CPU router (moe/router.h) and the CPU aux losses
// (losses/router_losses.h) on the same inputs; the logits GEMM goes through cuBLAS
// (core/cuda/gemm.h). Skips without a GPU.
#include "moe/cuda/router_cuda.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda/device_buffer.h"
#include "core/cuda/gemm.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "losses/router_losses.h"
#include "moe/router.h"
#include "testing/gpu_compare.h"
#include "testing/gpu_test_util.h"

namespace gradsum::moe {
namespace {

using cuda::CublasHandle;
using cuda::DeviceBuffer;
using cuda::GemmRowMajor;
using ::gradsum::testing::Dev;
using ::gradsum::testing::DevZeros;
using ::gradsum::testing::ExpectAllNear;
using ::gradsum::testing::Host;
using ::gradsum::testing::RandomNormal;
using ::testing::HasSubstr;

std::vector<uint8_t> MaskWithPadding(int64_t T) {
  std::vector<uint8_t> m(T, 1);
  for (int64_t t = 0; t < T; t += 5) m[t] = 0;  // every fifth token is padding
  return m;
}

// Output buffers of RouterForwardCuda.
struct GpuRoute {
  DeviceBuffer probs, index, weight, lse, counts, routed, gsum;
};

absl::Status RunForward(const DeviceBuffer& logits, const DeviceBuffer* mask, int64_t T, int E,
                        int K, bool norm, float scale, GpuRoute* r, bool sigmoid = false,
                        const DeviceBuffer* bias = nullptr) {
  r->probs = DevZeros(sizeof(float) * T * E);
  r->index = DevZeros(sizeof(int32_t) * T * K);
  r->weight = DevZeros(sizeof(float) * T * K);
  r->lse = DevZeros(sizeof(float) * T);
  r->counts = DevZeros(sizeof(int64_t) * E);
  r->routed = DevZeros(sizeof(int64_t));
  r->gsum = DevZeros(sizeof(double) * E);
  RouterForwardCudaArgs f;
  f.logits = logits.as<float>();
  f.mask = mask ? mask->as<uint8_t>() : nullptr;
  f.tokens = T;
  f.experts = E;
  f.top_k = K;
  f.norm_topk_prob = norm;
  f.router_scale = scale;
  f.probs = r->probs.as<float>();
  f.expert_index = r->index.as<int32_t>();
  f.combine_weight = r->weight.as<float>();
  f.logsumexp = r->lse.as<float>();
  f.local_expert_counts = r->counts.as<int64_t>();
  f.local_routed_tokens = r->routed.as<int64_t>();
  f.local_gating_sums = r->gsum.as<double>();
  f.sigmoid_scores = sigmoid;
  f.expert_bias = bias ? bias->as<float>() : nullptr;
  return RouterForwardCuda(f, nullptr);
}

struct Case {
  int64_t T;
  int64_t D;
  int E;
  int K;
  bool norm;
  float scale;
};

class RouterCudaVsCpu : public ::testing::TestWithParam<Case> {};

TEST_P(RouterCudaVsCpu, ForwardMatchesCpuRouterAndCublasLogitsMatchCpuLogits) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  RouterConfig config{c.D, c.E, c.K, c.norm, c.scale};
  std::vector<float> a = RandomNormal(c.T * c.D, 1), wr = RandomNormal(c.D * c.E, 2, 0.3f);
  std::vector<uint8_t> mask = MaskWithPadding(c.T);
  absl::StatusOr<RouterOutput> cpu = RouterForward(config, a, wr, mask);
  ASSERT_TRUE(cpu.ok()) << cpu.status();

  // u = a @ Wr through cuBLAS (fp32, no TF32) against the CPU router's logits.
  absl::StatusOr<CublasHandle> blas = CublasHandle::Create();
  ASSERT_TRUE(blas.ok()) << blas.status();
  DeviceBuffer a_dev = Dev(a), wr_dev = Dev(wr), u_dev = DevZeros(sizeof(float) * c.T * c.E);
  ASSERT_TRUE(GemmRowMajor(*blas, nullptr, false, false, c.T, c.E, c.D, a_dev.get(), c.D,
                           wr_dev.get(), c.E, DType::kF32, u_dev.get(), c.E, DType::kF32)
                  .ok());
  std::vector<float> u_gpu = Host<float>(u_dev);
  for (int64_t t = 0; t < c.T; ++t) {
    if (!mask[t]) continue;  // the CPU router leaves padding rows at 0
    for (int e = 0; e < c.E; ++e) {
      ASSERT_NEAR(u_gpu[t * c.E + e], cpu->logits[t * c.E + e], 1e-4)
          << "u[" << t << "," << e << "]";
    }
  }

  // The router kernel on exactly the CPU's logits.
  DeviceBuffer logits = Dev(cpu->logits), mask_dev = Dev(mask);
  GpuRoute r;
  absl::Status s = RunForward(logits, &mask_dev, c.T, c.E, c.K, c.norm, c.scale, &r);
  ASSERT_TRUE(s.ok()) << s;
  ExpectAllNear(Host<float>(r.probs), cpu->probs, 1e-7, 1e-5, "probs");
  EXPECT_EQ(Host<int32_t>(r.index), cpu->expert_index);
  ExpectAllNear(Host<float>(r.weight), cpu->combine_weight, 1e-7, 1e-5, "combine_weight");
  EXPECT_EQ(Host<int64_t>(r.counts), cpu->local_expert_counts);
  EXPECT_EQ(Host<int64_t>(r.routed)[0], cpu->local_routed_tokens);
  ExpectAllNear(Host<double>(r.gsum), cpu->local_gating_sums, 1e-9, 1e-5, "gating sums");
  std::vector<float> lse = Host<float>(r.lse);
  for (int64_t t = 0; t < c.T; ++t) {
    double want = 0;
    if (mask[t]) {
      double mx = -INFINITY, sum = 0;
      for (int e = 0; e < c.E; ++e) mx = std::max<double>(mx, cpu->logits[t * c.E + e]);
      for (int e = 0; e < c.E; ++e) sum += std::exp(cpu->logits[t * c.E + e] - mx);
      want = mx + std::log(sum);
    }
    ASSERT_NEAR(lse[t], want, 1e-5 * (1 + std::abs(want))) << "lse[" << t << "]";
  }
}

// z-loss and balancing loss values and their logit gradient against losses/router_losses.h.
TEST_P(RouterCudaVsCpu, AuxLossesAndGradientMatchCpuRouterLosses) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  std::vector<float> u = RandomNormal(c.T * c.E, 3, 2.0f);
  std::vector<uint8_t> mask = MaskWithPadding(c.T);
  DeviceBuffer u_dev = Dev(u), mask_dev = Dev(mask);
  GpuRoute r;
  ASSERT_TRUE(RunForward(u_dev, &mask_dev, c.T, c.E, c.K, c.norm, c.scale, &r).ok());
  // "Other ranks" add routed tokens and assignments: global counts are larger than local.
  std::vector<int64_t> counts = Host<int64_t>(r.counts);
  const int64_t local_routed = Host<int64_t>(r.routed)[0];
  std::vector<int64_t> global_counts = counts;
  for (int e = 0; e < c.E; ++e) global_counts[e] += (e % 3) * c.K;
  const int64_t global_routed_step = 3 * local_routed + 11;  // N of §4: all micro-batches
  const int G = 3;
  const double alpha_z = 0.05, alpha_b = 0.2;

  std::vector<float> du_cpu(c.T * c.E, 0.0f);
  TensorView uv = *TensorView::Create(u.data(), DType::kF32, {c.T, c.E});
  TensorView gv = *TensorView::Create(du_cpu.data(), DType::kF32, {c.T, c.E});
  absl::StatusOr<double> z_cpu =
      losses::RouterZLossForwardBackward(uv, mask, global_routed_step, alpha_z, gv);
  ASSERT_TRUE(z_cpu.ok()) << z_cpu.status();
  absl::StatusOr<double> b_cpu =
      losses::LoadBalancingLossForwardBackward(uv, mask, global_counts, c.K, G, alpha_b, gv);
  ASSERT_TRUE(b_cpu.ok()) << b_cpu.status();

  DeviceBuffer n_dev = Dev(std::vector<double>{static_cast<double>(global_routed_step)});
  DeviceBuffer c_dev = Dev(global_counts);
  DeviceBuffer z_dev = Dev(std::vector<double>{0.5}), b_dev = Dev(std::vector<double>{0.25});
  DeviceBuffer du_dev = Dev(std::vector<float>(c.T * c.E, std::nanf("")));  // overwritten
  RouterAuxCudaArgs x;
  x.probs = r.probs.as<float>();
  x.logsumexp = r.lse.as<float>();
  x.mask = mask_dev.as<uint8_t>();
  x.tokens = c.T;
  x.experts = c.E;
  x.top_k = c.K;
  x.alpha_z = static_cast<float>(alpha_z);
  x.alpha_b = static_cast<float>(alpha_b);
  x.num_micro_batches = G;
  x.global_routed_tokens = n_dev.as<double>();
  x.global_expert_counts = c_dev.as<int64_t>();
  x.local_gating_sums = r.gsum.as<double>();
  x.z_loss = z_dev.as<double>();
  x.balance_loss = b_dev.as<double>();
  x.accumulate_loss = true;  // adds to 0.5 and 0.25
  x.d_logits = du_dev.as<float>();
  ASSERT_TRUE(RouterAuxLossCuda(x, nullptr).ok());
  ASSERT_TRUE(RouterBackwardCuda(x, nullptr).ok());
  EXPECT_NEAR(Host<double>(z_dev)[0] - 0.5, *z_cpu, 1e-5 * std::abs(*z_cpu));
  EXPECT_NEAR(Host<double>(b_dev)[0] - 0.25, *b_cpu, 1e-5 * std::abs(*b_cpu));
  std::vector<float> du_gpu = Host<float>(du_dev);
  double max_grad = 0;
  for (float v : du_cpu) max_grad = std::max(max_grad, static_cast<double>(std::abs(v)));
  ExpectAllNear(du_gpu, du_cpu, 1e-5 * max_grad, 1e-4, "d_logits (aux)");
}

// Gradient through the combine weights (incl. renormalisation and router_scale), taken to
// d_Wr and d_a with cuBLAS, against moe::RouterBackward.
TEST_P(RouterCudaVsCpu, CombineWeightGradientMatchesCpuRouterBackward) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  RouterConfig config{c.D, c.E, c.K, c.norm, c.scale};
  std::vector<float> a = RandomNormal(c.T * c.D, 4), wr = RandomNormal(c.D * c.E, 5, 0.3f);
  std::vector<uint8_t> mask = MaskWithPadding(c.T);
  absl::StatusOr<RouterOutput> cpu = RouterForward(config, a, wr, mask);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<float> dw = RandomNormal(c.T * c.K, 6);
  std::vector<float> dwr_cpu(c.D * c.E, 0.0f), da_cpu(c.T * c.D, 0.0f);
  RouterOutputGrads grads;
  grads.d_combine_weight = dw;
  ASSERT_TRUE(
      RouterBackward(config, a, wr, *cpu, grads, absl::MakeSpan(dwr_cpu), absl::MakeSpan(da_cpu))
          .ok());

  DeviceBuffer logits = Dev(cpu->logits), mask_dev = Dev(mask);
  GpuRoute r;
  ASSERT_TRUE(RunForward(logits, &mask_dev, c.T, c.E, c.K, c.norm, c.scale, &r).ok());
  DeviceBuffer dw_dev = Dev(dw), du_dev = DevZeros(sizeof(float) * c.T * c.E);
  RouterAuxCudaArgs x;
  x.probs = r.probs.as<float>();
  x.mask = mask_dev.as<uint8_t>();
  x.tokens = c.T;
  x.experts = c.E;
  x.top_k = c.K;
  x.expert_index = r.index.as<int32_t>();
  x.d_combine_weight = dw_dev.as<float>();
  x.norm_topk_prob = c.norm;
  x.router_scale = c.scale;
  x.d_logits = du_dev.as<float>();
  ASSERT_TRUE(RouterBackwardCuda(x, nullptr).ok());

  absl::StatusOr<CublasHandle> blas = CublasHandle::Create();
  ASSERT_TRUE(blas.ok());
  DeviceBuffer a_dev = Dev(a), wr_dev = Dev(wr);
  DeviceBuffer dwr_dev = DevZeros(sizeof(float) * c.D * c.E),
               da_dev = DevZeros(sizeof(float) * c.T * c.D);
  // d_Wr[D, E] = a^T du ;  d_a[T, D] = du Wr^T
  ASSERT_TRUE(GemmRowMajor(*blas, nullptr, true, false, c.D, c.E, c.T, a_dev.get(), c.D,
                           du_dev.get(), c.E, DType::kF32, dwr_dev.get(), c.E, DType::kF32)
                  .ok());
  ASSERT_TRUE(GemmRowMajor(*blas, nullptr, false, true, c.T, c.D, c.E, du_dev.get(), c.E,
                           wr_dev.get(), c.E, DType::kF32, da_dev.get(), c.D, DType::kF32)
                  .ok());
  double max_dwr = 0, max_da = 0;
  for (float v : dwr_cpu) max_dwr = std::max(max_dwr, static_cast<double>(std::abs(v)));
  for (float v : da_cpu) max_da = std::max(max_da, static_cast<double>(std::abs(v)));
  ExpectAllNear(Host<float>(dwr_dev), dwr_cpu, 1e-5 * max_dwr, 1e-4, "d_router_weight");
  ExpectAllNear(Host<float>(da_dev), da_cpu, 1e-5 * max_da, 1e-4, "d_a");
}

// ---- SEMANTICS.md §5.1: sigmoid scores and the expert bias, against the CPU router. ----

// An expert bias of the size of the scores' differences, so that it changes some
// selections: b_e = 0.3 * N(0, 1).
std::vector<float> RandomBias(int E, uint32_t seed) { return RandomNormal(E, seed, 0.3f); }

// Forward with sigmoid scores, an expert bias, or both, on the CPU router's logits: the
// scores, the choice (by p + b), the weights (of the unbiased p), counts and gating sums.
TEST_P(RouterCudaVsCpu, SigmoidScoresAndExpertBiasMatchCpuRouter) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  for (const auto& [sigmoid, with_bias] :
       {std::pair<bool, bool>{true, false}, {false, true}, {true, true}}) {
    SCOPED_TRACE(std::string(sigmoid ? "sigmoid" : "softmax") + (with_bias ? " + bias" : ""));
    RouterConfig config{c.D, c.E, c.K, c.norm, c.scale};
    if (sigmoid) config.score = RouterScore::kSigmoid;
    std::vector<float> a = RandomNormal(c.T * c.D, 11), wr = RandomNormal(c.D * c.E, 12, 0.3f);
    std::vector<uint8_t> mask = MaskWithPadding(c.T);
    const std::vector<float> bias = with_bias ? RandomBias(c.E, 13) : std::vector<float>();
    absl::StatusOr<RouterOutput> cpu = RouterForward(config, a, wr, mask, bias);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    DeviceBuffer logits = Dev(cpu->logits), mask_dev = Dev(mask);
    DeviceBuffer bias_dev;
    if (with_bias) bias_dev = Dev(bias);
    GpuRoute r;
    absl::Status s = RunForward(logits, &mask_dev, c.T, c.E, c.K, c.norm, c.scale, &r, sigmoid,
                                with_bias ? &bias_dev : nullptr);
    ASSERT_TRUE(s.ok()) << s;
    ExpectAllNear(Host<float>(r.probs), cpu->probs, 1e-7, 1e-5, "probs");
    EXPECT_EQ(Host<int32_t>(r.index), cpu->expert_index);
    ExpectAllNear(Host<float>(r.weight), cpu->combine_weight, 1e-7, 1e-5, "combine_weight");
    EXPECT_EQ(Host<int64_t>(r.counts), cpu->local_expert_counts);
    ExpectAllNear(Host<double>(r.gsum), cpu->local_gating_sums, 1e-9, 1e-5, "gating sums");
    // lse stays the logits' (the z-loss's), whatever the scores.
    std::vector<float> lse = Host<float>(r.lse);
    for (int64_t t = 0; t < c.T; ++t) {
      if (!mask[t]) continue;
      double mx = -INFINITY, sum = 0;
      for (int e = 0; e < c.E; ++e) mx = std::max<double>(mx, cpu->logits[t * c.E + e]);
      for (int e = 0; e < c.E; ++e) sum += std::exp(cpu->logits[t * c.E + e] - mx);
      ASSERT_NEAR(lse[t], mx + std::log(sum), 1e-5 * (1 + std::abs(mx + std::log(sum)))) << t;
    }
  }
}

// Backward through the combine weights with sigmoid scores and a bias (the bias takes no
// gradient; the weights are of the unbiased scores), to d_Wr and d_a, against
// moe::RouterBackward.
TEST_P(RouterCudaVsCpu, SigmoidAndBiasCombineGradientMatchesCpuRouterBackward) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  for (const auto& [sigmoid, with_bias] :
       {std::pair<bool, bool>{true, false}, {false, true}, {true, true}}) {
    SCOPED_TRACE(std::string(sigmoid ? "sigmoid" : "softmax") + (with_bias ? " + bias" : ""));
    RouterConfig config{c.D, c.E, c.K, c.norm, c.scale};
    if (sigmoid) config.score = RouterScore::kSigmoid;
    std::vector<float> a = RandomNormal(c.T * c.D, 14), wr = RandomNormal(c.D * c.E, 15, 0.3f);
    std::vector<uint8_t> mask = MaskWithPadding(c.T);
    const std::vector<float> bias = with_bias ? RandomBias(c.E, 16) : std::vector<float>();
    absl::StatusOr<RouterOutput> cpu = RouterForward(config, a, wr, mask, bias);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    std::vector<float> dw = RandomNormal(c.T * c.K, 17);
    std::vector<float> dwr_cpu(c.D * c.E, 0.0f), da_cpu(c.T * c.D, 0.0f);
    RouterOutputGrads grads;
    grads.d_combine_weight = dw;
    ASSERT_TRUE(
        RouterBackward(config, a, wr, *cpu, grads, absl::MakeSpan(dwr_cpu), absl::MakeSpan(da_cpu))
            .ok());

    DeviceBuffer logits = Dev(cpu->logits), mask_dev = Dev(mask);
    DeviceBuffer bias_dev;
    if (with_bias) bias_dev = Dev(bias);
    GpuRoute r;
    ASSERT_TRUE(RunForward(logits, &mask_dev, c.T, c.E, c.K, c.norm, c.scale, &r, sigmoid,
                           with_bias ? &bias_dev : nullptr)
                    .ok());
    ASSERT_EQ(Host<int32_t>(r.index), cpu->expert_index);  // the same choices to differentiate
    DeviceBuffer dw_dev = Dev(dw), du_dev = DevZeros(sizeof(float) * c.T * c.E);
    RouterAuxCudaArgs x;
    x.probs = r.probs.as<float>();
    x.mask = mask_dev.as<uint8_t>();
    x.tokens = c.T;
    x.experts = c.E;
    x.top_k = c.K;
    x.expert_index = r.index.as<int32_t>();
    x.d_combine_weight = dw_dev.as<float>();
    x.norm_topk_prob = c.norm;
    x.router_scale = c.scale;
    x.sigmoid_scores = sigmoid;
    x.logits = logits.as<float>();
    x.d_logits = du_dev.as<float>();
    ASSERT_TRUE(RouterBackwardCuda(x, nullptr).ok());

    absl::StatusOr<CublasHandle> blas = CublasHandle::Create();
    ASSERT_TRUE(blas.ok());
    DeviceBuffer a_dev = Dev(a), wr_dev = Dev(wr);
    DeviceBuffer dwr_dev = DevZeros(sizeof(float) * c.D * c.E);
    DeviceBuffer da_dev = DevZeros(sizeof(float) * c.T * c.D);
    ASSERT_TRUE(GemmRowMajor(*blas, nullptr, true, false, c.D, c.E, c.T, a_dev.get(), c.D,
                             du_dev.get(), c.E, DType::kF32, dwr_dev.get(), c.E, DType::kF32)
                    .ok());
    ASSERT_TRUE(GemmRowMajor(*blas, nullptr, false, true, c.T, c.D, c.E, du_dev.get(), c.E,
                             wr_dev.get(), c.E, DType::kF32, da_dev.get(), c.D, DType::kF32)
                    .ok());
    double max_dwr = 0, max_da = 0;
    for (float v : dwr_cpu) max_dwr = std::max(max_dwr, static_cast<double>(std::abs(v)));
    for (float v : da_cpu) max_da = std::max(max_da, static_cast<double>(std::abs(v)));
    ExpectAllNear(Host<float>(dwr_dev), dwr_cpu, 1e-5 * max_dwr, 1e-4, "d_router_weight");
    ExpectAllNear(Host<float>(da_dev), da_cpu, 1e-5 * max_da, 1e-4, "d_a");
  }
}

// With sigmoid scores the z-loss is still of the logits (§4): its value and its logit
// gradient 2 alpha_z lse softmax(u) / N against losses/router_losses.h, computed from the
// logits alone; the balancing loss must be off (alpha_b != 0 is refused, naming it).
TEST_P(RouterCudaVsCpu, SigmoidScoresKeepTheZLossOfTheLogits) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  std::vector<float> u = RandomNormal(c.T * c.E, 18, 2.0f);
  std::vector<uint8_t> mask = MaskWithPadding(c.T);
  DeviceBuffer u_dev = Dev(u), mask_dev = Dev(mask);
  GpuRoute r;
  ASSERT_TRUE(
      RunForward(u_dev, &mask_dev, c.T, c.E, c.K, c.norm, c.scale, &r, /*sigmoid=*/true).ok());
  const int64_t global_routed_step = 2 * Host<int64_t>(r.routed)[0] + 5;
  const double alpha_z = 0.05;
  std::vector<float> du_cpu(c.T * c.E, 0.0f);
  TensorView uv = *TensorView::Create(u.data(), DType::kF32, {c.T, c.E});
  TensorView gv = *TensorView::Create(du_cpu.data(), DType::kF32, {c.T, c.E});
  absl::StatusOr<double> z_cpu =
      losses::RouterZLossForwardBackward(uv, mask, global_routed_step, alpha_z, gv);
  ASSERT_TRUE(z_cpu.ok()) << z_cpu.status();

  DeviceBuffer n_dev = Dev(std::vector<double>{static_cast<double>(global_routed_step)});
  DeviceBuffer z_dev = Dev(std::vector<double>{0.0}), b_dev = Dev(std::vector<double>{0.0});
  DeviceBuffer du_dev = Dev(std::vector<float>(c.T * c.E, std::nanf("")));  // overwritten
  RouterAuxCudaArgs x;
  x.probs = r.probs.as<float>();
  x.logsumexp = r.lse.as<float>();
  x.mask = mask_dev.as<uint8_t>();
  x.tokens = c.T;
  x.experts = c.E;
  x.top_k = c.K;
  x.alpha_z = static_cast<float>(alpha_z);
  x.alpha_b = 0.0f;
  x.global_routed_tokens = n_dev.as<double>();
  x.z_loss = z_dev.as<double>();
  x.balance_loss = b_dev.as<double>();
  x.sigmoid_scores = true;
  x.logits = u_dev.as<float>();
  x.d_logits = du_dev.as<float>();
  ASSERT_TRUE(RouterAuxLossCuda(x, nullptr).ok());
  ASSERT_TRUE(RouterBackwardCuda(x, nullptr).ok());
  EXPECT_NEAR(Host<double>(z_dev)[0], *z_cpu, 1e-5 * std::abs(*z_cpu));
  EXPECT_EQ(Host<double>(b_dev)[0], 0.0);
  double max_grad = 0;
  for (float v : du_cpu) max_grad = std::max(max_grad, static_cast<double>(std::abs(v)));
  ExpectAllNear(Host<float>(du_dev), du_cpu, 1e-5 * max_grad, 1e-4, "d_logits (z, sigmoid)");

  RouterAuxCudaArgs bal = x;
  bal.alpha_b = 0.01f;
  DeviceBuffer counts = Dev(std::vector<int64_t>(c.E, 1));
  bal.global_expert_counts = counts.as<int64_t>();
  bal.local_gating_sums = r.gsum.as<double>();
  absl::Status s = RouterAuxLossCuda(bal, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("alpha_b"));
  EXPECT_EQ(RouterBackwardCuda(bal, nullptr).code(), absl::StatusCode::kInvalidArgument);
  // The backward with sigmoid scores and the z-loss needs the logits.
  RouterAuxCudaArgs no_logits = x;
  no_logits.logits = nullptr;
  EXPECT_EQ(RouterBackwardCuda(no_logits, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RouterCudaVsCpu,
                         ::testing::Values(Case{37, 16, 8, 2, false, 1.0f},    // 1 expert per lane
                                           Case{300, 32, 64, 6, true, 1.5f},   // 2 per lane
                                           Case{129, 24, 200, 8, true, 0.5f},  // 7 per lane
                                           Case{20, 8, 1024, 32, false, 1.0f}));  // limits

TEST(RouterCuda, EqualProbabilitiesGoToTheLowerExpertIndex) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int E = 40, K = 3;
  std::vector<float> u(2 * E, 0.0f);  // token 0: all equal
  for (int e = 0; e < E; ++e) u[E + e] = (e == 5 || e == 33 || e == 37) ? 2.0f : 0.0f;
  u[E + 2] = 1.0f;  // token 1: three tied maxima at 5, 33, 37 (lane 5 and lane 1 / 5 again)
  DeviceBuffer u_dev = Dev(u);
  GpuRoute r;
  ASSERT_TRUE(RunForward(u_dev, nullptr, 2, E, K, false, 1.0f, &r).ok());
  EXPECT_EQ(Host<int32_t>(r.index), (std::vector<int32_t>{0, 1, 2, 5, 33, 37}));
  const std::vector<int64_t> counts = Host<int64_t>(r.counts);
  EXPECT_EQ(counts[0] + counts[1] + counts[2] + counts[5] + counts[33] + counts[37], 6);
}

// The bias moves the selection only, worked by hand: with u = (3, 2, 1, 0, ...) the top 2
// by p are experts 0 and 1; a bias of +1 on expert 7 makes it the first choice, and the
// weights are the UNBIASED p of the chosen experts, renormalised. A bias below -1 on every
// expert (keys all negative) chooses as no bias does.
TEST(RouterCuda, ExpertBiasMovesTheSelectionAndNotTheWeights) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int E = 8, K = 2;
  std::vector<float> u(E, 0.0f);
  u[0] = 3.0f;
  u[1] = 2.0f;
  u[2] = 1.0f;
  double z = 0;
  for (float v : u) z += std::exp(static_cast<double>(v));
  auto p = [&](int e) { return std::exp(static_cast<double>(u[e])) / z; };
  DeviceBuffer u_dev = Dev(u);
  std::vector<float> plus(E, 0.0f);
  plus[7] = 1.0f;
  DeviceBuffer plus_dev = Dev(plus);
  GpuRoute r;
  ASSERT_TRUE(RunForward(u_dev, nullptr, 1, E, K, /*norm=*/true, 1.0f, &r, false, &plus_dev).ok());
  EXPECT_EQ(Host<int32_t>(r.index), (std::vector<int32_t>{7, 0}));
  std::vector<float> w = Host<float>(r.weight);
  EXPECT_NEAR(w[0], p(7) / (p(7) + p(0)), 1e-6);
  EXPECT_NEAR(w[1], p(0) / (p(7) + p(0)), 1e-6);
  const std::vector<int64_t> counts = Host<int64_t>(r.counts);
  EXPECT_EQ(counts[7], 1);
  EXPECT_EQ(counts[0], 1);
  EXPECT_EQ(counts[1], 0);

  DeviceBuffer minus_dev = Dev(std::vector<float>(E, -5.0f));
  ASSERT_TRUE(
      RunForward(u_dev, nullptr, 1, E, K, /*norm=*/false, 2.0f, &r, false, &minus_dev).ok());
  EXPECT_EQ(Host<int32_t>(r.index), (std::vector<int32_t>{0, 1}));
  w = Host<float>(r.weight);
  EXPECT_NEAR(w[0], 2.0 * p(0), 1e-6);
  EXPECT_NEAR(w[1], 2.0 * p(1), 1e-6);

  // Sigmoid scores, worked by hand: keys sigmoid(0) + 1 = 1.5 (expert 7), sigmoid(3) =
  // 0.953 (expert 0), sigmoid(2) = 0.881 (expert 1); the weights are sigmoid(u) of the
  // chosen, renormalised.
  ASSERT_TRUE(RunForward(u_dev, nullptr, 1, E, K, /*norm=*/true, 1.0f, &r, true, &plus_dev).ok());
  EXPECT_EQ(Host<int32_t>(r.index), (std::vector<int32_t>{7, 0}));
  auto sig = [&](int e) { return 1.0 / (1.0 + std::exp(-static_cast<double>(u[e]))); };
  const std::vector<float> probs = Host<float>(r.probs);
  for (int e = 0; e < E; ++e) EXPECT_NEAR(probs[e], sig(e), 1e-6) << e;
  w = Host<float>(r.weight);
  EXPECT_NEAR(w[0], sig(7) / (sig(7) + sig(0)), 1e-6);
  EXPECT_NEAR(w[1], sig(0) / (sig(7) + sig(0)), 1e-6);
}

TEST(RouterCuda, NonFiniteLogitAndBadMaskAreInvalidArgumentNamingTheToken) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int E = 4, K = 2;
  std::vector<float> u = RandomNormal(6 * E, 7);
  u[3 * E + 1] = std::numeric_limits<float>::infinity();
  DeviceBuffer u_dev = Dev(u);
  GpuRoute r;
  absl::Status s = RunForward(u_dev, nullptr, 6, E, K, false, 1.0f, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("token 3"));

  std::vector<float> good = RandomNormal(6 * E, 8);
  DeviceBuffer good_dev = Dev(good), bad_mask = Dev(std::vector<uint8_t>{1, 1, 0, 1, 2, 1});
  s = RunForward(good_dev, &bad_mask, 6, E, K, false, 1.0f, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("token 4"));

  // With a caller-owned flag the call does not sync; the flag holds the token.
  absl::StatusOr<cuda::DeviceIndexFlag> flag = cuda::DeviceIndexFlag::Create();
  ASSERT_TRUE(flag.ok());
  RouterForwardCudaArgs f;
  f.logits = u_dev.as<float>();
  f.tokens = 6;
  f.experts = E;
  f.top_k = K;
  f.probs = r.probs.as<float>();
  f.expert_index = r.index.as<int32_t>();
  f.combine_weight = r.weight.as<float>();
  f.local_expert_counts = r.counts.as<int64_t>();
  f.error = &*flag;
  ASSERT_TRUE(RouterForwardCuda(f, nullptr).ok());
  absl::StatusOr<std::optional<int64_t>> bad = flag->ReadAndReset(nullptr);
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(*bad, std::optional<int64_t>(3));
}

TEST(RouterCuda, BadShapesAndHostPointersAreRejected) {
  GRADSUM_SKIP_WITHOUT_GPU();
  DeviceBuffer u = DevZeros(sizeof(float) * 4 * 8);
  GpuRoute r;
  EXPECT_EQ(RunForward(u, nullptr, 4, 8, 9, false, 1.0f, &r).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RunForward(u, nullptr, 4, 0, 1, false, 1.0f, &r).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RunForward(u, nullptr, 4, 2000, 2, false, 1.0f, &r).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RunForward(u, nullptr, 4, 8, 2, false, std::nanf(""), &r).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> host(4 * 8);
  RouterForwardCudaArgs f;
  f.logits = host.data();
  f.tokens = 4;
  f.experts = 8;
  f.top_k = 2;
  f.probs = r.probs.as<float>();
  f.expert_index = r.index.as<int32_t>();
  f.combine_weight = r.weight.as<float>();
  f.local_expert_counts = r.counts.as<int64_t>();
  absl::Status s = RouterForwardCuda(f, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("logits"));
  RouterAuxCudaArgs x;
  x.tokens = 4;
  x.experts = 8;
  x.top_k = 2;
  x.num_micro_batches = 0;
  EXPECT_EQ(RouterAuxLossCuda(x, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RouterCudaWithoutDevice, ReturnsFailedPreconditionNotACrash) {
  std::string why;
  if (::gradsum::testing::CudaDeviceAvailable(&why)) GTEST_SKIP() << "a GPU is present";
  RouterForwardCudaArgs f;
  f.tokens = 1;
  f.experts = 2;
  f.top_k = 1;
  EXPECT_EQ(RouterForwardCuda(f, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CublasHandle::Create().status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace gradsum::moe
