// The GPU's ops against the host's (model/ops.h, the one declaration of the model's layers):
// every op of model/cuda/cuda_ops.h on the same inputs as model/cpu_ops.h, one rank (the
// thread backend's world of 1 on the host, an NCCL world of 1 on device 0): embedding,
// RMSNorm, the whole MoE layer (router, counts, exchange, experts, combine; forward and
// backward with the router losses), the fused LM head + CE, and the loss values and expert
// counts End() reports. Skips without a GPU.
#include "model/cuda/cuda_ops.h"

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/mesh.h"
#include "collectives/nccl_backend.h"
#include "collectives/thread_backend.h"
#include "core/cuda/compute_context.h"
#include "core/cuda/device_buffer.h"
#include "data/streams.h"
#include "gtest/gtest.h"
#include "model/cpu_ops.h"
#include "model/moe_lm_spec.h"
#include "testing/gpu_compare.h"
#include "testing/gpu_test_util.h"

namespace gradsum::model {
namespace {

using cuda::DeviceBuffer;
using ::gradsum::testing::Dev;
using ::gradsum::testing::DevZeros;
using ::gradsum::testing::ExpectAllNear;
using ::gradsum::testing::Host;
using ::gradsum::testing::RandomNormal;

double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float f : v) m = std::max(m, static_cast<double>(std::abs(f)));
  return m;
}

// fp32 on both devices with TF32 off: only the summation orders differ.
void ExpectClose(const std::vector<float>& gpu, const std::vector<float>& cpu,
                 const std::string& what) {
  ExpectAllNear(gpu, cpu, 1e-5 * std::max(1.0, MaxAbs(cpu)), 1e-4, what);
}

// The model of the every-op comparison.
MoeLmConfig EveryOpConfig() {
  MoeLmConfig c;
  c.vocab = 50;
  c.dim = 16;
  c.layers = 1;
  c.experts = 4;
  c.top_k = 2;
  c.expert_dim = 24;
  return c;
}

// Every op of the two devices on the same inputs, for the model `c`; with `sample_weights`
// the CE gets per-token weights (w_t = 1 / (1 + t % 3), D their sum) instead of token mode;
// a non-empty `expert_bias` [E] is the layer's bias of SEMANTICS.md §5.1 (host memory, as
// the model passes it to both devices).
void ExpectEveryOpMatchesTheHostOps(const MoeLmConfig& c, bool sample_weights,
                                    const std::vector<float>& expert_bias = {}) {
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const int64_t T = 40, D = c.dim, V = c.vocab, E = c.experts, H = c.expert_dim;

  // One rank: the host world, and NCCL over it on device 0.
  auto host = CreateThreadCommunicators(1);
  ASSERT_TRUE(host.ok()) << host.status();
  Communicator* world = (*host)[0].get();
  NcclBackendOptions nccl_options;
  nccl_options.device = 0;
  absl::StatusOr<std::unique_ptr<Communicator>> nccl = CreateNcclCommunicator(*world, nccl_options);
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  absl::StatusOr<std::shared_ptr<cuda::ComputeContext>> ctx = cuda::ComputeContext::Create(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  // One mesh: the host groups for the CPU ops, its NCCL device view for the GPU ops.
  absl::StatusOr<std::unique_ptr<Mesh>> mesh = Mesh::Create(world, MeshShape{});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  auto cpu = MakeCpuOps(*spec, **mesh, {});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE((*mesh)->AttachDeviceView(*std::move(nccl)).ok());
  auto gpu = MakeCudaOps(*spec, *ctx, **mesh);
  ASSERT_TRUE(gpu.ok()) << gpu.status();

  // The micro-batch: every 9th token padding (label ignored), every 7th label ignored.
  std::vector<int32_t> tokens(T), labels(T), mask(T);
  double valid = 0;
  int64_t routed = 0;
  for (int64_t t = 0; t < T; ++t) {
    tokens[t] = static_cast<int32_t>((t * 13 + 5) % V);
    mask[t] = t % 9 == 4 ? 0 : 1;
    labels[t] =
        (mask[t] == 0 || t % 7 == 2) ? data::kIgnoreIndex : static_cast<int32_t>((t * 7 + 1) % V);
    valid += labels[t] != data::kIgnoreIndex;
    routed += mask[t];
  }
  std::vector<float> ce_weights;
  if (sample_weights) {
    valid = 0;
    for (int64_t t = 0; t < T; ++t) {
      ce_weights.push_back(labels[t] == data::kIgnoreIndex ? 0.0f
                                                           : 1.0f / static_cast<float>(1 + t % 3));
      valid += ce_weights.back();
    }
  }
  MicroBatchInputs in;
  in.rows = T;
  in.tokens = tokens;
  in.labels = labels;
  in.mask = mask;
  in.ce_weights = ce_weights;
  in.global_ce_weight_sum = valid;
  in.global_routed_tokens = routed;
  in.num_micro_batches = 1;
  ASSERT_TRUE((*cpu)->Begin(in).ok());
  ASSERT_TRUE((*gpu)->Begin(in).ok());

  const std::vector<float> emb = RandomNormal(V * D, 1);
  std::vector<float> gain = RandomNormal(D, 2, 0.3f);
  for (float& g : gain) g += 1.0f;
  const std::vector<float> router = RandomNormal(D * E, 3, 0.3f);
  const std::vector<float> experts = RandomNormal(3 * E * D * H, 4, 0.2f);
  const std::vector<float> w_out = RandomNormal(D * V, 5, 0.2f), dy = RandomNormal(T * D, 6);
  DeviceBuffer emb_d = Dev(emb), gain_d = Dev(gain), router_d = Dev(router);
  DeviceBuffer experts_d = Dev(experts), w_out_d = Dev(w_out), dy_d = Dev(dy);
  auto zeros = [](int64_t n) { return std::vector<float>(n, 0.0f); };
  auto dz = [](int64_t n) { return DevZeros(n * sizeof(float)); };

  // Embedding forward.
  std::vector<float> h = zeros(T * D);
  DeviceBuffer h_d = dz(T * D);
  ASSERT_TRUE((*cpu)->EmbeddingForward(/*stream=*/0, emb.data(), h.data()).ok());
  ASSERT_TRUE((*gpu)->EmbeddingForward(/*stream=*/0, emb_d.as<float>(), h_d.as<float>()).ok());
  ExpectClose(Host<float>(h_d), h, "h");

  // RMSNorm forward.
  std::vector<float> a = zeros(T * D), r = zeros(T);
  DeviceBuffer a_d = dz(T * D), r_d = dz(T);
  ASSERT_TRUE((*cpu)->RmsNormForward(h.data(), gain.data(), a.data(), r.data()).ok());
  ASSERT_TRUE(
      (*gpu)
          ->RmsNormForward(h_d.as<float>(), gain_d.as<float>(), a_d.as<float>(), r_d.as<float>())
          .ok());
  ExpectClose(Host<float>(a_d), a, "a");
  ExpectClose(Host<float>(r_d), r, "inv_rms");

  // The MoE layer forward (the layer takes the normed input as the model does).
  std::vector<float> y = zeros(T * D);
  DeviceBuffer y_d = dz(T * D);
  const float* bias = expert_bias.empty() ? nullptr : expert_bias.data();
  ASSERT_TRUE(
      (*cpu)->MoeForward(0, a.data(), {router.data(), experts.data(), bias}, y.data()).ok());
  absl::Status s = (*gpu)->MoeForward(
      0, a_d.as<float>(), {router_d.as<float>(), experts_d.as<float>(), bias}, y_d.as<float>());
  ASSERT_TRUE(s.ok()) << s;
  ExpectClose(Host<float>(y_d), y, "moe y");

  // The LM head on a (as the final norm's output would be).
  std::vector<float> grad_f = zeros(T * D), d_out = zeros(D * V);
  DeviceBuffer grad_f_d = dz(T * D), d_out_d = dz(D * V);
  ASSERT_TRUE((*cpu)
                  ->LmHeadCrossEntropy(/*stream=*/0, a.data(), w_out.data(), grad_f.data(),
                                       GradTarget::Accumulate(d_out.data(), D * V))
                  .ok());
  s = (*gpu)->LmHeadCrossEntropy(/*stream=*/0, a_d.as<float>(), w_out_d.as<float>(),
                                 grad_f_d.as<float>(),
                                 GradTarget::Accumulate(d_out_d.as<float>(), D * V));
  ASSERT_TRUE(s.ok()) << s;
  ExpectClose(Host<float>(grad_f_d), grad_f, "grad_f");
  ExpectClose(Host<float>(d_out_d), d_out, "d_out");

  // The MoE layer backward with its router losses.
  std::vector<float> da = zeros(T * D), d_router = zeros(D * E), d_experts = zeros(3 * E * D * H);
  DeviceBuffer da_d = dz(T * D), d_router_d = dz(D * E), d_experts_d = dz(3 * E * D * H);
  MoeGrads cg{GradTarget::Accumulate(d_router.data(), D * E),
              GradTarget::Accumulate(d_experts.data(), 3 * E * D * H)};
  MoeGrads gg{GradTarget::Accumulate(d_router_d.as<float>(), D * E),
              GradTarget::Accumulate(d_experts_d.as<float>(), 3 * E * D * H)};
  ASSERT_TRUE((*cpu)
                  ->MoeBackward(0, a.data(), {router.data(), experts.data()}, dy.data(), da.data(),
                                std::move(cg))
                  .ok());
  s = (*gpu)->MoeBackward(0, a_d.as<float>(), {router_d.as<float>(), experts_d.as<float>()},
                          dy_d.as<float>(), da_d.as<float>(), std::move(gg));
  ASSERT_TRUE(s.ok()) << s;
  ExpectClose(Host<float>(da_d), da, "moe da");
  ExpectClose(Host<float>(d_router_d), d_router, "d_router");
  ExpectClose(Host<float>(d_experts_d), d_experts, "d_experts");

  // RMSNorm backward, written and accumulated.
  std::vector<float> dx = zeros(T * D), dgain = zeros(D);
  DeviceBuffer dx_d = dz(T * D), dgain_d = dz(D);
  for (bool accumulate : {false, true}) {
    ASSERT_TRUE((*cpu)
                    ->RmsNormBackward(h.data(), gain.data(), r.data(), dy.data(), dx.data(),
                                      accumulate, GradTarget::Accumulate(dgain.data(), D))
                    .ok());
    ASSERT_TRUE((*gpu)
                    ->RmsNormBackward(h_d.as<float>(), gain_d.as<float>(), r_d.as<float>(),
                                      dy_d.as<float>(), dx_d.as<float>(), accumulate,
                                      GradTarget::Accumulate(dgain_d.as<float>(), D))
                    .ok());
    ExpectClose(Host<float>(dx_d), dx, accumulate ? "dx (accumulated)" : "dx");
    ExpectClose(Host<float>(dgain_d), dgain, "dgain");
  }

  // Embedding backward (repeated tokens: fp32 atomics on the GPU, rounding-level order).
  std::vector<float> demb = zeros(V * D);
  DeviceBuffer demb_d = dz(V * D);
  ASSERT_TRUE(
      (*cpu)
          ->EmbeddingBackward(/*stream=*/0, dy.data(), GradTarget::Accumulate(demb.data(), V * D))
          .ok());
  ASSERT_TRUE((*gpu)
                  ->EmbeddingBackward(/*stream=*/0, dy_d.as<float>(),
                                      GradTarget::Accumulate(demb_d.as<float>(), V * D))
                  .ok());
  ExpectClose(Host<float>(demb_d), demb, "demb");

  // The loss values and the counts.
  absl::StatusOr<MicroBatchLossTerms> ct = (*cpu)->End(), gt = (*gpu)->End();
  ASSERT_TRUE(ct.ok()) << ct.status();
  ASSERT_TRUE(gt.ok()) << gt.status();
  EXPECT_NEAR(gt->ce, ct->ce, 1e-5 * std::abs(ct->ce));
  EXPECT_NEAR(gt->z, ct->z, 1e-5 * std::abs(ct->z) + 1e-12);
  EXPECT_NEAR(gt->bal, ct->bal, 1e-5 * std::abs(ct->bal) + 1e-12);
  // §3.2's output z-loss, its own term on both devices (none without alpha_lse).
  EXPECT_NEAR(gt->z_out, ct->z_out, 1e-5 * std::abs(ct->z_out));
  EXPECT_EQ(gt->z_out_terms.size(), ct->z_out_terms.size());
  EXPECT_EQ(ct->z_out_terms.size(), c.ce.alpha_lse > 0 ? 1u : 0u);
  if (c.ce.alpha_lse > 0) {
    EXPECT_GT(ct->z_out, 0.0);
  }
  EXPECT_EQ(gt->global_expert_counts, ct->global_expert_counts);
  EXPECT_GT(ct->ce, 0.0);
}

TEST(CudaOpsTest, EveryOpMatchesTheHostOps) {
  GRADSUM_SKIP_WITHOUT_GPU();
  ExpectEveryOpMatchesTheHostOps(EveryOpConfig(), /*sample_weights=*/false);
}

// The CE options of SEMANTICS.md §3.2 on the GPU (the CUDA CE kernel's options path) against
// the host's: each alone and all three, with sample weights; the LM head's gradients, its
// CE term and the output z-loss term apart.
TEST(CudaOpsTest, EveryOpMatchesTheHostOpsWithTheCeOptions) {
  GRADSUM_SKIP_WITHOUT_GPU();
  struct Options {
    double eps, cap, alpha;
  };
  for (const Options& o :
       {Options{0.1, 0, 0}, Options{0, 2.0, 0}, Options{0, 0, 0.02}, Options{0.2, 1.5, 0.05}}) {
    SCOPED_TRACE(absl::StrCat("eps ", o.eps, " cap ", o.cap, " alpha ", o.alpha));
    MoeLmConfig c = EveryOpConfig();
    c.ce.label_smoothing = o.eps;
    c.ce.logit_softcap = o.cap;
    c.ce.alpha_lse = o.alpha;
    ExpectEveryOpMatchesTheHostOps(c, /*sample_weights=*/true);
  }
}

// The aux-loss-free balancing of SEMANTICS.md §5.1 on the GPU (the CUDA router's sigmoid
// scores and expert bias) against the host's: sigmoid scores (alpha_b 0), an expert bias
// that moves some selections, and both; the whole MoE layer forward and backward, and the
// counts the bias update reads.
TEST(CudaOpsTest, EveryOpMatchesTheHostOpsWithSigmoidScoresAndExpertBias) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const std::vector<float> bias = {0.2f, -0.15f, 0.05f, -0.3f};  // E = 4
  for (const auto& [sigmoid, with_bias] :
       {std::pair<bool, bool>{true, false}, {false, true}, {true, true}}) {
    SCOPED_TRACE(absl::StrCat(sigmoid ? "sigmoid" : "softmax", with_bias ? " + bias" : ""));
    MoeLmConfig c = EveryOpConfig();
    c.router_sigmoid = sigmoid;
    if (sigmoid) c.alpha_b = 0;  // the balancing loss is of the softmax (§5.1)
    ExpectEveryOpMatchesTheHostOps(c, /*sample_weights=*/false,
                                   with_bias ? bias : std::vector<float>());
  }
}

// A one-layer model small enough for the refusal tests.
MoeLmConfig OneLayerConfig() {
  MoeLmConfig c;
  c.vocab = 8;
  c.dim = 4;
  c.layers = 1;
  c.experts = 2;
  c.top_k = 1;
  c.expert_dim = 4;
  return c;
}

TEST(CudaOpsTest, RowBlocksAndExactTargetsAreRefused) {
  GRADSUM_SKIP_WITHOUT_GPU();
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(OneLayerConfig());
  ASSERT_TRUE(spec.ok());
  auto host = CreateThreadCommunicators(1);
  ASSERT_TRUE(host.ok());
  NcclBackendOptions nccl_options;
  nccl_options.device = 0;
  auto nccl = CreateNcclCommunicator(*(*host)[0], nccl_options);
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  auto ctx = cuda::ComputeContext::Create(0);
  ASSERT_TRUE(ctx.ok());
  absl::StatusOr<std::unique_ptr<Mesh>> mesh = Mesh::Create((*host)[0].get(), MeshShape{});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  ASSERT_TRUE((*mesh)->AttachDeviceView(*std::move(nccl)).ok());
  auto gpu = MakeCudaOps(*spec, *ctx, **mesh);
  ASSERT_TRUE(gpu.ok());
  std::vector<int32_t> tokens = {1, 2, 3, 4}, labels = {2, 3, 4, data::kIgnoreIndex},
                       mask = {1, 1, 1, 1};
  MicroBatchInputs in;
  in.rows = 4;
  in.tokens = tokens;
  in.labels = labels;
  in.mask = mask;
  in.row_block = 2;
  EXPECT_EQ((*gpu)->Begin(in).code(), absl::StatusCode::kInvalidArgument);
  in.row_block = 0;
  labels[1] = 9;
  absl::Status s = (*gpu)->Begin(in);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("label 9 at position 1"), absl::string_view::npos) << s;
}

// The CE options of SEMANTICS.md §3.2 are no longer refused: without a context the ops fail
// on the missing context (InvalidArgument), not on the option. Needs no GPU (the config is
// checked before the device).
// A host mesh of one rank without a device view (the ops refuse it as they refuse the
// missing context: InvalidArgument).
std::unique_ptr<Mesh> HostMeshOfOne(std::vector<std::unique_ptr<Communicator>>& keep) {
  keep = std::move(*CreateThreadCommunicators(1));
  return *std::move(Mesh::Create(keep[0].get(), MeshShape{}));
}

TEST(CudaOpsTest, CeOptionsAreNotRefused) {
  std::vector<std::unique_ptr<Communicator>> keep;
  std::unique_ptr<Mesh> mesh = HostMeshOfOne(keep);
  for (const char* flag : {"label_smoothing", "logit_softcap", "alpha_lse"}) {
    MoeLmConfig c = OneLayerConfig();
    const std::string name = flag;
    if (name == "label_smoothing") c.ce.label_smoothing = 0.25;
    if (name == "logit_softcap") c.ce.logit_softcap = 0.25;
    if (name == "alpha_lse") c.ce.alpha_lse = 0.25;
    absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
    ASSERT_TRUE(spec.ok());
    auto gpu = MakeCudaOps(*spec, nullptr, *mesh);
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kInvalidArgument) << flag << gpu.status();
    EXPECT_EQ(gpu.status().message().find(flag), absl::string_view::npos) << gpu.status();
  }
}

// Nor are the bias speed and sigmoid scores of §5.1: without a context the ops fail on the
// missing context, not on the option. Needs no GPU.
TEST(CudaOpsTest, ExpertBiasAndSigmoidScoresAreNotRefused) {
  std::vector<std::unique_ptr<Communicator>> keep;
  std::unique_ptr<Mesh> mesh = HostMeshOfOne(keep);
  MoeLmConfig c = OneLayerConfig();
  c.expert_bias_speed = 0.25;
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto gpu = MakeCudaOps(*spec, nullptr, *mesh);
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kInvalidArgument) << gpu.status();
  EXPECT_EQ(gpu.status().message().find("expert_bias_speed"), absl::string_view::npos)
      << gpu.status();
  c = OneLayerConfig();
  c.router_sigmoid = true;
  c.alpha_b = 0;
  spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok()) << spec.status();
  gpu = MakeCudaOps(*spec, nullptr, *mesh);
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kInvalidArgument) << gpu.status();
  EXPECT_EQ(gpu.status().message().find("sigmoid"), absl::string_view::npos) << gpu.status();
}

}  // namespace
}  // namespace gradsum::model
