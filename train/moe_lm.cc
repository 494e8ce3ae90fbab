#include "train/moe_lm.h"

#include <utility>

#include "core/dtype.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "model/cpu_ops.h"
#include "train/config.h"

namespace gradsum::train {

namespace {

// The config's choices as the types of the code that implements them.
DType ToDType(TrainConfig::FloatDType d) {
  return d == TrainConfig::bf16 ? DType::kBF16 : DType::kF32;
}
ShardingMode ToShardingMode(TrainConfig::Sharding s) {
  // hsdp is sharded mode with replica groups (SEMANTICS.md §7: the mesh's HSDP groups).
  return s == TrainConfig::replicated ? ShardingMode::kReplicated : ShardingMode::kSharded;
}

// The spec of the model section alone (its parameters): loss weights 0, as no loss term can
// then make MoeLmSpec::Create refuse the sizes (sigmoid routing needs alpha_b = 0).
model::MoeLmConfig SizesOnly(const ModelConfig& m) {
  LossConfig loss;
  loss.set_alpha_b(0);
  loss.set_alpha_z(0);
  return ToMoeLmConfig(m, loss);
}

}  // namespace

model::MoeLmConfig ToMoeLmConfig(const ModelConfig& m, const LossConfig& loss) {
  model::MoeLmConfig c;
  c.vocab = m.vocab();
  c.dim = m.dim();
  c.layers = m.layers();
  c.experts = m.experts();
  c.top_k = m.top_k();
  c.expert_dim = m.expert_dim();
  c.norm_topk_prob = m.norm_topk_prob();
  c.router_scale = m.router_scale();
  c.init_std = m.init_std();
  c.attention = m.attention() != ModelConfig::none;
  c.n_heads = m.heads();
  c.n_kv_heads = m.kv_heads();
  c.rope_theta = m.rope_theta();
  c.router_sigmoid = m.router_score() == ModelConfig::sigmoid;
  c.mtp_depth = m.mtp_depth();
  c.alpha_b = loss.alpha_b();
  c.alpha_z = loss.alpha_z();
  c.ce = {loss.label_smoothing(), loss.logit_softcap(), loss.alpha_lse()};
  c.expert_bias_speed = loss.expert_bias_speed();
  c.mtp_scale = loss.mtp_scale();
  return c;
}

MoeLmOptions ToMoeLmOptions(const TrainConfig& config) {
  const ParallelismConfig& parallelism = config.parallelism();
  const PrecisionConfig& precision = config.precision();
  MoeLmOptions options;
  options.model = config.model();
  options.loss = config.loss();
  parallel::ParallelOptions& p = options.parallel;
  p.sharding = ToShardingMode(parallelism.sharding());
  p.compute_dtype = ToDType(precision.compute_dtype());
  // The gradient precision, chosen once (core/grad_precision.h); the config's validation
  // refused reproducible with a bf16 reduce dtype.
  p.precision = precision.reproducible()                        ? GradPrecision::kExact
                : precision.reduce_dtype() == TrainConfig::bf16 ? GradPrecision::kBF16Wire
                                                                : GradPrecision::kF32;
  options.recompute = parallelism.recompute() == ParallelismConfig::full ? model::Recompute::kFull
                      : parallelism.recompute() == ParallelismConfig::selective
                          ? model::Recompute::kSelective
                          : model::Recompute::kNone;
  p.layers_per_unit = parallelism.layers_per_unit();
  p.reshard_after_forward = parallelism.reshard_after_forward();
  p.reduce_every_micro_batch = parallelism.reduce_every_micro_batch();
  p.bucket_cap_bytes = static_cast<size_t>(config.comm().bucket_cap_mb() * (1 << 20));
  p.first_bucket_cap_bytes = static_cast<size_t>(config.comm().first_bucket_mb() * (1 << 20));
  // Reproducible mode's blocks are fixed by the sequence length (train/config.h ReproBlock),
  // so they are the same at every SP and CP size.
  p.repro_block = precision.reproducible() ? ReproBlock(config) : precision.repro_block();
  return options;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> MoeLmParamShapes(const ModelConfig& m) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  absl::StatusOr<model::MoeLmSpec> spec = model::MoeLmSpec::Create(SizesOnly(m));
  if (!spec.ok()) return shapes;
  for (const model::ParamDef& p : spec->params()) shapes.push_back({p.name, p.shape});
  return shapes;
}

NamedParams MoeLm::InitialParameters(const ModelConfig& m, uint64_t seed) {
  absl::StatusOr<model::MoeLmSpec> spec = model::MoeLmSpec::Create(SizesOnly(m));
  return spec.ok() ? spec->InitialParameters(seed) : NamedParams();
}

absl::StatusOr<std::unique_ptr<MoeLm>> MoeLm::Create(const MoeLmOptions& options, const Mesh& mesh,
                                                     ComputeDevice device) {
  GRADSUM_ASSIGN_OR_RETURN(model::MoeLmSpec spec,
                           model::MoeLmSpec::Create(ToMoeLmConfig(options.model, options.loss)));
  if (device.units == nullptr) device.units = std::make_shared<parallel::HostUnitDevice>();
  if (!device.ops) {
    const model::CpuOpsOptions ops_options{.num_threads = options.num_threads};
    const Mesh* m = &mesh;
    device.ops = [m, ops_options](const model::MoeLmSpec& s) {
      return model::MakeCpuOps(s, *m, ops_options);
    };
  }
  auto lm = std::unique_ptr<MoeLm>(new MoeLm());
  lm->options_ = options;
  lm->device_ = device.units;
  GRADSUM_ASSIGN_OR_RETURN(lm->params_,
                           parallel::Parallelize(spec, mesh, options.parallel, *device.units));
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<model::ModelOps> ops, device.ops(spec));
  GRADSUM_ASSIGN_OR_RETURN(
      lm->model_,
      model::MoeLmModel::Create(
          spec, lm->params_.get(), std::move(ops), options.recompute,
          {.mesh = &mesh, .reproducible = options.parallel.precision == GradPrecision::kExact}));
  return lm;
}

absl::Status MoeLm::SetFullParameters(const NamedParams& params) {
  return params_->SetFullParameters(params);
}

absl::Status MoeLm::Unshard() { return params_->PrepareStep(); }

absl::StatusOr<MicroBatchLosses> MoeLm::ForwardBackward(const data::MicroBatch& batch,
                                                        const losses::StepStats& stats,
                                                        int micro_index,
                                                        losses::StepDisplay* display) {
  // The host kernels (router, experts, CE) use this rank's thread budget.
  ScopedComputeThreads compute_threads(options_.num_threads);
  GRADSUM_RETURN_IF_ERROR(params_->CheckMicroBatch());
  return model_->ForwardBackward(Tokens(batch), stats, micro_index, display);
}

absl::StatusOr<MicroBatchLosses> MoeLm::Evaluate(const data::MicroBatch& batch,
                                                 const losses::StepStats& stats, int micro_index,
                                                 losses::StepDisplay* display) {
  ScopedComputeThreads compute_threads(options_.num_threads);
  GRADSUM_RETURN_IF_ERROR(params_->CheckMicroBatch());
  return model_->Evaluate(Tokens(batch), stats, micro_index, display);
}

model::TokenBatch MoeLm::Tokens(const data::MicroBatch& batch) {
  model::TokenBatch tokens;
  tokens.sequences = batch.batch;
  tokens.seq_len = batch.seq_len;
  tokens.local_seq_len = batch.local_seq_len > 0 ? batch.local_seq_len : batch.seq_len;
  tokens.tokens = batch.tokens;
  tokens.labels = batch.labels;
  tokens.mask = batch.mask;
  tokens.positions = batch.positions;
  tokens.doc_start = batch.doc_start;
  for (const data::MicroBatch::Stream& s : batch.extra_streams) {
    tokens.extra_streams.push_back({s.tokens, s.labels});
  }
  return tokens;
}

}  // namespace gradsum::train
