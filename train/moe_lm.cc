#include "train/moe_lm.h"

#include <utility>

#include "core/status.h"
#include "core/thread_pool.h"
#include "model/cpu_ops.h"

namespace gradsum::train {

model::MoeLmConfig ToMoeLmConfig(const ModelConfig& m, double alpha_b, double alpha_z) {
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
  c.alpha_b = alpha_b;
  c.alpha_z = alpha_z;
  return c;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> MoeLmParamShapes(const ModelConfig& m) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  absl::StatusOr<model::MoeLmSpec> spec = model::MoeLmSpec::Create(ToMoeLmConfig(m, 0, 0));
  if (!spec.ok()) return shapes;
  for (const model::ParamDef& p : spec->params()) shapes.push_back({p.name, p.shape});
  return shapes;
}

NamedParams MoeLm::InitialParameters(const ModelConfig& m, uint64_t seed) {
  absl::StatusOr<model::MoeLmSpec> spec = model::MoeLmSpec::Create(ToMoeLmConfig(m, 0, 0));
  return spec.ok() ? spec->InitialParameters(seed) : NamedParams();
}

absl::StatusOr<std::unique_ptr<MoeLm>> MoeLm::Create(const MoeLmOptions& options,
                                                     const MoeLmGroups& groups,
                                                     ComputeDevice device) {
  model::MoeLmConfig config = ToMoeLmConfig(options.model, options.alpha_b, options.alpha_z);
  config.label_smoothing = options.label_smoothing;
  config.logit_softcap = options.logit_softcap;
  config.alpha_lse = options.alpha_lse;
  config.mtp_scale = options.mtp_scale;
  config.expert_bias_speed = options.expert_bias_speed;
  GRADSUM_ASSIGN_OR_RETURN(model::MoeLmSpec spec, model::MoeLmSpec::Create(config));
  if (device.units == nullptr) device.units = std::make_shared<parallel::HostUnitDevice>();
  if (!device.ops) {
    model::CpuOpsComms comms{groups.world, groups.ep_group, groups.sp_group, groups.cp_group};
    // Reproducible mode's bits do not depend on the CP size: attention gathers the group's
    // chunks and runs the whole-sequence kernel (model/ring_attention.h).
    if (options.parallel.precision == GradPrecision::kExact) {
      comms.cp_schedule = model::RingSchedule::kGathered;
    }
    const int threads = options.num_threads;
    device.ops = [comms, threads](const model::MoeLmSpec& s) {
      return model::MakeCpuOps(s, comms, threads);
    };
  }
  auto lm = std::unique_ptr<MoeLm>(new MoeLm());
  lm->options_ = options;
  lm->device_ = device.units;
  GRADSUM_ASSIGN_OR_RETURN(lm->params_,
                           parallel::Parallelize(spec, groups, options.parallel, *device.units));
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<model::ModelOps> ops, device.ops(spec));
  GRADSUM_ASSIGN_OR_RETURN(
      lm->model_,
      model::MoeLmModel::Create(spec, lm->params_.get(), std::move(ops), options.recompute));
  return lm;
}

absl::Status MoeLm::SetFullParameters(const NamedParams& params) {
  return params_->SetFullParameters(params);
}

absl::Status MoeLm::Unshard() { return params_->PrepareStep(); }

absl::StatusOr<MicroBatchLosses> MoeLm::ForwardBackward(const data::MicroBatch& batch,
                                                        const losses::StepStats& stats,
                                                        int micro_index,
                                                        losses::StepDisplay* display,
                                                        const losses::MtpStats* mtp) {
  // The host kernels (router, experts, CE) use this rank's thread budget.
  ScopedComputeThreads compute_threads(options_.num_threads);
  GRADSUM_RETURN_IF_ERROR(params_->CheckMicroBatch());
  return model_->ForwardBackward(Tokens(batch), stats, micro_index, display, mtp);
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
  for (const std::vector<int32_t>& x : batch.mtp_tokens) tokens.mtp_tokens.push_back(x);
  return tokens;
}

}  // namespace gradsum::train
