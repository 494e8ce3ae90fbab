// The GPU model (CreateCudaMoeLm through the Trainer, NCCL world of one GPU) against two
// independent references: the double-precision single-process reference model (the
// --parity_check of step 1, tolerance 1e-5) and the CPU trainer run on the same config
// (reduced gradients of step 1 and the losses of the following steps). Skips without a GPU.
//
// One process drives one GPU here (NCCL refuses two ranks on one device), so the EP
// all-to-all runs with P = 1; the multi-GPU mesh is //train/cuda:moe_lm_nccl_mpi_np*_test.
#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/mesh.h"
#include "collectives/nccl_backend.h"
#include "collectives/thread_backend.h"
#include "core/status.h"
#include "data/loader.h"
#include "data/streams.h"
#include "gtest/gtest.h"
#include "testing/gpu_test_util.h"
#include "train/cuda/cuda_compute.h"
#include "train/cuda/nccl_rank.h"
#include "train/parity.h"
#include "train/rank_main.h"
#include "train/test_util.h"
#include "train/trainer.h"

namespace gradsum::train {
namespace {

struct GpuRun {
  std::vector<StepMetrics> history;
  std::optional<NamedParams> first_step_grads;
  std::optional<ParityReport> parity;
};

// Runs `config` (world 1) with the GPU model on device 0.
absl::StatusOr<GpuRun> RunOnGpu(const TrainConfig& config) {
  GRADSUM_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> host,
                           CreateThreadCommunicators(1));
  NcclBackendOptions options;
  options.device = 0;
  options.timeout = absl::Seconds(60);
  GRADSUM_ASSIGN_OR_RETURN(RankMesh mesh, MakeRankMesh(host[0].get(), config.parallelism()));
  // As RunNcclRank: NCCL's collectives are timed into the host mesh's CommTimer.
  GRADSUM_RETURN_IF_ERROR(AttachNcclView(*host[0], options, mesh));
  RankComms comms = mesh.comms();
  comms.make_model = CreateCudaMoeLm;
  comms.parity_check = RunParityCheck;
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(config, comms));
  GRADSUM_RETURN_IF_ERROR(trainer->Run(nullptr).status());
  GpuRun out;
  out.history = trainer->history();
  out.first_step_grads = trainer->first_step_grads();
  out.parity = trainer->parity();
  return out;
}

// (G, sharding, compute dtype, reduce dtype, CE weighting, small buckets, attention)
using Case = std::tuple<int, TrainConfig::Sharding, TrainConfig::FloatDType,
                        TrainConfig::FloatDType, TrainConfig::CeMode, bool, bool>;

class MoeLmCudaTest : public ::testing::TestWithParam<Case> {};

TEST_P(MoeLmCudaTest, MatchesReferenceAndCpuTrainer) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const auto [G, sharding, compute, reduce, ce_mode, small_buckets, attention] = GetParam();
  TrainConfig config = TinyConfig(1, 1, G, sharding);
  if (attention) {
    // The document-causal GQA attention block (model/cuda/attention_cuda.h) in every layer:
    // two query heads of 4 sharing one key/value head.
    config.mutable_model()->set_attention(ModelConfig::causal);
    config.mutable_model()->set_heads(2);
    config.mutable_model()->set_kv_heads(1);
  }
  config.mutable_loss()->set_ce_mode(ce_mode);
  config.mutable_precision()->set_compute_dtype(compute);
  config.mutable_precision()->set_reduce_dtype(reduce);
  if (small_buckets) {
    // Replicated: GradBucketer buckets of at most 524 bytes (the first: 104), so the tiny
    // model's gradients travel in many buckets: the 2048-float embedding and head alone,
    // a layer's norm and router together, two 64-float expert matrices per bucket. The CPU
    // run below buckets the same way.
    config.mutable_comm()->set_bucket_cap_mb(0.0005);
    config.mutable_comm()->set_first_bucket_mb(0.0001);
  }
  config.mutable_optim()->set_steps(4);
  config.mutable_debug()->set_parity_check(true);
  absl::StatusOr<GpuRun> gpu = RunOnGpu(config);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  absl::StatusOr<std::vector<RankOutcome>> cpu = RunInProcess(config);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE((*cpu)[0].status.ok()) << (*cpu)[0].status;

  // 1. Step 1 against the double-precision reference: the trainer's own check (1e-5 in
  //    f32; 3e-2 when parameters or gradients are rounded to bf16).
  ASSERT_TRUE(gpu->parity.has_value());
  EXPECT_TRUE(gpu->parity->ok) << gpu->parity->ToString();
  if (compute == TrainConfig::f32 && reduce == TrainConfig::f32) {
    EXPECT_LE(gpu->parity->worst, 1e-5) << gpu->parity->ToString();
  }

  // 2. Step 1's reduced gradients against the CPU trainer's, parameter by parameter.
  ASSERT_TRUE(gpu->first_step_grads.has_value());
  const NamedParams& want = *(*cpu)[0].first_step_grads;
  const NamedParams& got = *gpu->first_step_grads;
  ASSERT_EQ(got.size(), want.size());
  const double rtol = reduce == TrainConfig::bf16 ? 1e-2 : 1e-5;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << name;
    ASSERT_EQ(it->second.size(), w.size()) << name;
    double scale = 0;
    for (float v : w) scale = std::max(scale, static_cast<double>(std::abs(v)));
    for (size_t i = 0; i < w.size(); ++i) {
      EXPECT_NEAR(it->second[i], w[i], rtol * scale + 1e-9) << name << "[" << i << "]";
    }
  }

  // 3. Every step's detached losses and grad norm against the CPU run's.
  const std::vector<StepMetrics>& cpu_hist = (*cpu)[0].history;
  ASSERT_EQ(gpu->history.size(), cpu_hist.size());
  for (size_t s = 0; s < cpu_hist.size(); ++s) {
    const double tol = reduce == TrainConfig::bf16 ? 1e-2 : 1e-4;
    EXPECT_NEAR(gpu->history[s].ce(), cpu_hist[s].ce(), tol * std::abs(cpu_hist[s].ce())) << s;
    EXPECT_NEAR(gpu->history[s].z(), cpu_hist[s].z(), tol * std::abs(cpu_hist[s].z()) + 1e-9) << s;
    EXPECT_NEAR(gpu->history[s].bal(), cpu_hist[s].bal(), tol * std::abs(cpu_hist[s].bal()) + 1e-9)
        << s;
    EXPECT_NEAR(gpu->history[s].grad_norm(), cpu_hist[s].grad_norm(), tol * cpu_hist[s].grad_norm())
        << s;
    EXPECT_EQ(gpu->history[s].valid_tokens(), cpu_hist[s].valid_tokens());
    EXPECT_EQ(gpu->history[s].routed_tokens(), cpu_hist[s].routed_tokens());
  }

  // 4. NCCL's collectives are in the comm metrics (TimedCommunicator over the NCCL groups'
  //    device streams, with the host's): some communication every step, and never more
  //    exposed than its total.
  for (const StepMetrics& r : gpu->history) {
    EXPECT_GT(r.comm_s(), 0.0) << r.step();
    EXPECT_LE(r.comm_exposed_s(), r.comm_s()) << r.step();
  }

  // 5. Parameter memory on the device (fp32 unit buffers): the whole model is emb, two
  //    layers' norm + router and experts, and the head; fsdp holds at most two layers' units
  //    or a layer's with the head or the embedding at once (the shared schedule frees units
  //    after use), replicated keeps every unit.
  //    The attention block adds its norm, Wq, Wo (8 x 8) and Wk, Wv (8 x 4) to each layer.
  const int64_t attention_floats = attention ? 8 + 2 * 8 * 8 + 2 * 8 * 4 : 0;
  const int64_t full =
      4 * (256 * 8 + 2 * (attention_floats + 8 + 8 * 4 + 4 * 3 * 8 * 8) + 8 + 8 * 256);
  for (const StepMetrics& r : gpu->history) {
    EXPECT_EQ(r.full_param_bytes(), full);
    if (sharding == TrainConfig::fsdp) {
      EXPECT_LT(r.peak_unsharded_param_bytes(), full * 6 / 10);
    } else {
      EXPECT_GE(r.peak_unsharded_param_bytes(), full);
    }
  }
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const auto [G, sharding, compute, reduce, ce_mode, small_buckets, attention] = info.param;
  return absl::StrCat("G", G, "_", TrainConfig::Sharding_Name(sharding), "_compute_",
                      TrainConfig::FloatDType_Name(compute), "_reduce_",
                      TrainConfig::FloatDType_Name(reduce), "_ce_",
                      TrainConfig::CeMode_Name(ce_mode), small_buckets ? "_small_buckets" : "",
                      attention ? "_attention" : "");
}

using C = TrainConfig;
INSTANTIATE_TEST_SUITE_P(
    Configs, MoeLmCudaTest,
    ::testing::Values(Case{1, C::fsdp, C::f32, C::f32, C::token, false, false},
                      Case{3, C::fsdp, C::f32, C::f32, C::token, false, false},
                      Case{1, C::replicated, C::f32, C::f32, C::token, false, false},
                      Case{3, C::replicated, C::f32, C::f32, C::token, false, false},
                      Case{1, C::replicated, C::f32, C::f32, C::token, true, false},
                      Case{3, C::replicated, C::f32, C::f32, C::token, true, false},
                      Case{2, C::replicated, C::f32, C::bf16, C::token, true, false},
                      Case{2, C::fsdp, C::bf16, C::f32, C::token, false, false},
                      Case{2, C::fsdp, C::f32, C::bf16, C::token, false, false},
                      Case{2, C::fsdp, C::f32, C::f32, C::sample, false, false},
                      Case{2, C::replicated, C::f32, C::f32, C::square, false, false},
                      Case{1, C::fsdp, C::f32, C::f32, C::token, false, true},
                      Case{2, C::replicated, C::f32, C::f32, C::token, true, true},
                      Case{2, C::fsdp, C::bf16, C::f32, C::token, false, true}),
    CaseName);

// The options the GPU gained after the cases above (SEMANTICS.md §3.2's CE options; §5.1's
// routing): the GPU run of `config` (f32) against the reference (step 1's parity, 1e-5,
// with the output z-loss's own row when alpha_lse > 0) and against the CPU trainer (step
// 1's reduced gradients, every step's display terms, z_out included, and grad norm).
void ExpectGpuMatchesReferenceAndCpu(TrainConfig config) {
  config.mutable_optim()->set_steps(3);
  config.mutable_debug()->set_parity_check(true);
  absl::StatusOr<GpuRun> gpu = RunOnGpu(config);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  absl::StatusOr<std::vector<RankOutcome>> cpu = RunInProcess(config);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE((*cpu)[0].status.ok()) << (*cpu)[0].status;
  ASSERT_TRUE(gpu->parity.has_value());
  EXPECT_TRUE(gpu->parity->ok) << gpu->parity->ToString();
  EXPECT_LE(gpu->parity->worst, 1e-5) << gpu->parity->ToString();
  const int k = config.model().mtp_depth();
  EXPECT_EQ(gpu->parity->losses.size(), (config.loss().alpha_lse() > 0 ? 4u : 3u) + k);

  ASSERT_TRUE(gpu->first_step_grads.has_value());
  const NamedParams& want = *(*cpu)[0].first_step_grads;
  const NamedParams& got = *gpu->first_step_grads;
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << name;
    ASSERT_EQ(it->second.size(), w.size()) << name;
    double scale = 0;
    for (float v : w) scale = std::max(scale, static_cast<double>(std::abs(v)));
    for (size_t i = 0; i < w.size(); ++i) {
      EXPECT_NEAR(it->second[i], w[i], 1e-5 * scale + 1e-9) << name << "[" << i << "]";
    }
  }
  const std::vector<StepMetrics>& cpu_hist = (*cpu)[0].history;
  ASSERT_EQ(gpu->history.size(), cpu_hist.size());
  for (size_t s = 0; s < cpu_hist.size(); ++s) {
    const StepMetrics& g = gpu->history[s];
    const StepMetrics& c = cpu_hist[s];
    EXPECT_NEAR(g.ce(), c.ce(), 1e-4 * std::abs(c.ce())) << s;
    EXPECT_NEAR(g.z(), c.z(), 1e-4 * std::abs(c.z()) + 1e-9) << s;
    EXPECT_NEAR(g.bal(), c.bal(), 1e-4 * std::abs(c.bal()) + 1e-9) << s;
    ASSERT_EQ(g.has_z_out(), c.has_z_out()) << s;
    EXPECT_EQ(c.has_z_out(), config.loss().alpha_lse() > 0) << s;
    EXPECT_NEAR(g.z_out(), c.z_out(), 1e-4 * std::abs(c.z_out())) << s;
    ASSERT_EQ(g.mtp_size(), k) << s;
    ASSERT_EQ(c.mtp_size(), k) << s;
    for (int j = 0; j < k; ++j) {
      EXPECT_NEAR(g.mtp(j), c.mtp(j), 1e-4 * std::abs(c.mtp(j))) << s << " depth " << j + 1;
    }
    EXPECT_NEAR(g.grad_norm(), c.grad_norm(), 1e-4 * c.grad_norm()) << s;
    ASSERT_EQ(g.has_eval_ce(), c.has_eval_ce()) << s;
    EXPECT_NEAR(g.eval_ce(), c.eval_ce(), 1e-4 * std::abs(c.eval_ce())) << s;
    // The global counts (what the expert bias of §5.1 moves by): the same choices.
    EXPECT_EQ(std::vector<int64_t>(g.tokens_per_expert().begin(), g.tokens_per_expert().end()),
              std::vector<int64_t>(c.tokens_per_expert().begin(), c.tokens_per_expert().end()))
        << s;
  }
}

// The CE options of SEMANTICS.md §3.2 on the GPU model, each alone and all three, in sample
// mode (weights that are not token counts), fsdp, two micro-batches.
TEST(MoeLmCudaOptionsTest, CeOptionsMatchReferenceAndCpuTrainer) {
  GRADSUM_SKIP_WITHOUT_GPU();
  struct Options {
    double eps, cap, alpha;
  };
  for (const Options& o :
       {Options{0.1, 0, 0}, Options{0, 0.5, 0}, Options{0, 0, 0.01}, Options{0.2, 0.3, 0.02}}) {
    SCOPED_TRACE(absl::StrCat("eps ", o.eps, " cap ", o.cap, " alpha ", o.alpha));
    TrainConfig config = TinyConfig(1, 1, 2, TrainConfig::fsdp);
    config.mutable_loss()->set_ce_mode(TrainConfig::sample);
    config.mutable_loss()->set_label_smoothing(o.eps);
    config.mutable_loss()->set_logit_softcap(o.cap);
    config.mutable_loss()->set_alpha_lse(o.alpha);
    ExpectGpuMatchesReferenceAndCpu(config);
  }
}

// The aux-loss-free balancing of SEMANTICS.md §5.1 on the GPU model: the expert bias
// (moved by the step's global counts after every step, so steps 2 and 3 route with a bias)
// with softmax scores, sigmoid scores without a bias, and both; alpha_b 0 with sigmoid.
TEST(MoeLmCudaOptionsTest, ExpertBiasAndSigmoidScoresMatchReferenceAndCpuTrainer) {
  GRADSUM_SKIP_WITHOUT_GPU();
  for (const auto& [sigmoid, speed] :
       {std::pair<bool, double>{false, 0.01}, {true, 0.0}, {true, 0.01}}) {
    SCOPED_TRACE(absl::StrCat(sigmoid ? "sigmoid" : "softmax", " speed ", speed));
    TrainConfig config = TinyConfig(1, 1, 2, TrainConfig::fsdp);
    if (sigmoid) {
      config.mutable_model()->set_router_score(ModelConfig::sigmoid);
      config.mutable_loss()->set_alpha_b(0);
    }
    config.mutable_loss()->set_expert_bias_speed(speed);
    ExpectGpuMatchesReferenceAndCpu(config);
  }
}

TEST(MoeLmCudaTest, CreateRejectsMissingOrMismatchedDeviceGroups) {
  GRADSUM_SKIP_WITHOUT_GPU();
  auto host = CreateThreadCommunicators(1);
  ASSERT_TRUE(host.ok()) << host.status();
  MoeLmOptions options;
  options.model = TinyConfig(1, 1, 1, TrainConfig::fsdp).model();
  // A host mesh without the NCCL device view.
  absl::StatusOr<std::unique_ptr<Mesh>> mesh = Mesh::Create((*host)[0].get(), MeshShape{});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  absl::StatusOr<std::unique_ptr<MoeLm>> none = CreateCudaMoeLm(options, **mesh);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument) << none.status();
  EXPECT_NE(none.status().message().find("NCCL"), absl::string_view::npos);
}

// One GPU for the construction tests: a host world of one thread rank, its mesh with the
// NCCL device view (the mesh keeps a pointer to the host communicator, which stays put) and
// the tiny model's options.
struct OneGpu {
  std::vector<std::unique_ptr<Communicator>> host;
  RankMesh mesh;
  MoeLmOptions options;
};

absl::StatusOr<OneGpu> MakeOneGpu() {
  GRADSUM_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> host,
                           CreateThreadCommunicators(1));
  NcclBackendOptions options;
  options.device = 0;
  const TrainConfig config = TinyConfig(1, 1, 1, TrainConfig::fsdp);
  GRADSUM_ASSIGN_OR_RETURN(RankMesh mesh, MakeRankMesh(host[0].get(), config.parallelism()));
  GRADSUM_RETURN_IF_ERROR(AttachNcclView(*host[0], options, mesh));
  MoeLmOptions model_options;
  model_options.model = config.model();
  return OneGpu{std::move(host), std::move(mesh), model_options};
}

// The held-out evaluation on the GPU (CudaOps::LmHeadLoss: the CE kernel's forward-only
// mode; the model's forward without backward): every step's eval_ce against the CPU
// trainer's, with attention, sample weighting and the CE options.
TEST(MoeLmCudaOptionsTest, HeldOutEvaluationMatchesCpuTrainer) {
  GRADSUM_SKIP_WITHOUT_GPU();
  TrainConfig config = TinyConfig(1, 1, 2, TrainConfig::fsdp);
  config.mutable_model()->set_attention(ModelConfig::causal);
  config.mutable_model()->set_heads(2);
  config.mutable_model()->set_kv_heads(1);
  config.mutable_loss()->set_ce_mode(TrainConfig::sample);
  config.mutable_loss()->set_alpha_lse(0.01);
  config.mutable_log()->set_eval_every(1);
  config.mutable_log()->set_eval_micro_batches(2);
  ExpectGpuMatchesReferenceAndCpu(config);
}

// HSDP (SEMANTICS.md §7) on one GPU: a shard group of one, no replica, so the result is
// fsdp's; what it checks is the plumbing (the NCCL shard groups beside the host's, the
// device store reducing over them, the host fold's replica stage). The mesh with replicas
// is //train/cuda:moe_lm_nccl_mpi_np4_hsdp_test (4 GPUs).
TEST(MoeLmCudaOptionsTest, HsdpOnOneGpuMatchesReferenceAndCpuTrainer) {
  GRADSUM_SKIP_WITHOUT_GPU();
  TrainConfig config = TinyConfig(1, 1, 2, TrainConfig::hsdp);
  config.mutable_parallelism()->set_shard_group(1);
  ExpectGpuMatchesReferenceAndCpu(config);
}

// Activation recomputation (SEMANTICS.md §14) on the GPU model: selective (the norms,
// shared model code) and full (the MoE layers re-run from their kept routing,
// CudaOps::MoeRecomputeForward, one set of dispatch buffers circulating through the layers),
// with attention and MTP, two micro-batches. Each against the fp64 reference and the CPU
// trainer, and step 1's reduced gradients and every step's losses bit for bit the GPU run
// without recomputation (nothing observable happens twice).
TEST(MoeLmCudaOptionsTest, RecomputationKeepsTheBits) {
  GRADSUM_SKIP_WITHOUT_GPU();
  TrainConfig none = TinyConfig(1, 1, 2, TrainConfig::fsdp);
  none.mutable_model()->set_attention(ModelConfig::causal);
  none.mutable_model()->set_heads(2);
  none.mutable_model()->set_kv_heads(1);
  none.mutable_model()->set_mtp_depth(1);
  none.mutable_optim()->set_steps(3);
  none.mutable_debug()->set_parity_check(true);  // keeps step 1's reduced gradients
  absl::StatusOr<GpuRun> base = RunOnGpu(none);
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_TRUE(base->first_step_grads.has_value());
  for (auto mode : {ParallelismConfig::selective, ParallelismConfig::full}) {
    SCOPED_TRACE(ParallelismConfig::Recompute_Name(mode));
    TrainConfig config = none;
    config.mutable_parallelism()->set_recompute(mode);
    ExpectGpuMatchesReferenceAndCpu(config);
    absl::StatusOr<GpuRun> run = RunOnGpu(config);
    ASSERT_TRUE(run.ok()) << run.status();
    ASSERT_TRUE(run->first_step_grads.has_value());
    EXPECT_EQ(*run->first_step_grads, *base->first_step_grads);
    ASSERT_EQ(run->history.size(), base->history.size());
    // What it is for: fewer held bytes (the model's arrays and, under full, the ops'
    // dispatch and expert buffers, CudaOps::HeldActivationBytes).
    EXPECT_LT(run->history.back().peak_activation_bytes(),
              base->history.back().peak_activation_bytes());
    for (size_t i = 0; i < run->history.size(); ++i) {
      EXPECT_EQ(run->history[i].ce(), base->history[i].ce()) << i;
      EXPECT_EQ(run->history[i].mtp(0), base->history[i].mtp(0)) << i;
      EXPECT_EQ(run->history[i].grad_norm(), base->history[i].grad_norm()) << i;
    }
  }
}

// Multi-token prediction (SEMANTICS.md §15.1) on the GPU model: the ops' shifted embedding
// and per-depth head CE (model/ops.h CanMtp) under the model's one composition. Depths 1
// and 2, without and with the attention block, token and sample weighting, and with the CE
// options (a depth's output z-loss stays in its mtp_<j> term): against the fp64 reference
// (every mtp_<j> row of the parity report) and the CPU trainer (step 1's gradients of the
// mtp.{j}.* parameters and the shared ones, every step's mtp values).
TEST(MoeLmCudaOptionsTest, MtpMatchesReferenceAndCpuTrainer) {
  GRADSUM_SKIP_WITHOUT_GPU();
  for (const auto& [k, attention, sample, options] :
       {std::tuple<int, bool, bool, bool>{1, false, false, false},
        {2, false, true, false},
        {2, true, false, false},
        {1, true, true, true}}) {
    SCOPED_TRACE(absl::StrCat("k ", k, attention ? " attention" : "", sample ? " sample" : "",
                              options ? " CE options" : ""));
    TrainConfig config = TinyConfig(1, 1, 2, TrainConfig::fsdp);
    if (attention) {
      ModelConfig* m = config.mutable_model();
      m->set_attention(ModelConfig::causal);
      m->set_heads(2);
      m->set_kv_heads(1);
    }
    if (sample) config.mutable_loss()->set_ce_mode(TrainConfig::sample);
    if (options) {
      config.mutable_loss()->set_label_smoothing(0.1);
      config.mutable_loss()->set_logit_softcap(0.5);
      config.mutable_loss()->set_alpha_lse(0.02);
    }
    config.mutable_model()->set_mtp_depth(k);
    config.mutable_loss()->set_mtp_scale(0.3);
    ExpectGpuMatchesReferenceAndCpu(config);
  }
}

TEST(MoeLmCudaTest, ProtocolAndInputErrorsAreStatuses) {
  GRADSUM_SKIP_WITHOUT_GPU();
  absl::StatusOr<OneGpu> gpu = MakeOneGpu();
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  MoeLmOptions options = gpu->options;
  auto model = CreateCudaMoeLm(options, *gpu->mesh.mesh);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->SetFullParameters(MoeLm::InitialParameters(options.model, 1)).ok());

  data::MicroBatch batch;
  batch.batch = 1;
  batch.seq_len = 4;
  batch.tokens = {1, 2, 3, 4};
  batch.labels = {2, 3, 4, data::kIgnoreIndex};
  batch.mask = {1, 1, 1, 1};
  losses::StepStats stats;
  stats.num_micro_batches = 1;
  stats.global_ce_weight_sum = 3;
  stats.global_routed_tokens = 4;
  // Before Unshard: the device holds no parameters yet.
  EXPECT_EQ((*model)->ForwardBackward(batch, stats, 0, nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*model)->Unshard().ok());
  // A label outside [0, V) is named; a token too.
  data::MicroBatch bad = batch;
  bad.labels[1] = 1000;
  absl::Status s = (*model)->ForwardBackward(bad, stats, 0, nullptr).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("label 1000 at position 1"), absl::string_view::npos) << s;
  bad = batch;
  bad.tokens[2] = -5;
  s = (*model)->ForwardBackward(bad, stats, 0, nullptr).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("token -5 at position 2"), absl::string_view::npos) << s;
  // The good batch runs and reduces.
  auto ok = (*model)->ForwardBackward(batch, stats, 0, nullptr);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_GT(ok->ce, 0.0);
  ASSERT_TRUE((*model)->FinishGradReduce().ok());
  // New host parameters (as after an optimizer step) make the device copy stale.
  NamedParams params = MoeLm::InitialParameters(options.model, 2);
  ASSERT_TRUE((*model)->SetFullParameters(params).ok());
  s = (*model)->ForwardBackward(batch, stats, 0, nullptr).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("changed on the host"), absl::string_view::npos) << s;
  // A failure inside the device work (a NaN router weight: non-finite logits) fails the
  // micro-batch and the step: nothing partial is reduced, until the next Unshard.
  params["layers.0.router"][0] = std::nanf("");
  ASSERT_TRUE((*model)->SetFullParameters(params).ok());
  ASSERT_TRUE((*model)->Unshard().ok());
  s = (*model)->ForwardBackward(batch, stats, 0, nullptr).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ((*model)->FinishGradReduce().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*model)->ForwardBackward(batch, stats, 0, nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  params["layers.0.router"][0] = 0.0f;
  ASSERT_TRUE((*model)->SetFullParameters(params).ok());
  ASSERT_TRUE((*model)->Unshard().ok());
  EXPECT_TRUE((*model)->ForwardBackward(batch, stats, 0, nullptr).ok());
}

}  // namespace
}  // namespace gradsum::train
