#include "train/parity.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "collectives/status_agreement.h"
#include "core/status.h"
#include "data/corpus.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/streams.h"
#include "testing/reference_config_of.h"
#include "testing/reference_moe_lm.h"

namespace gradsum::train {

absl::StatusOr<std::vector<std::vector<data::MicroBatch>>> GlobalBatchForStep(
    const TrainConfig& config, int64_t step_index,
    std::shared_ptr<const data::DocumentSource> corpus) {
  if (corpus == nullptr) {
    GRADSUM_ASSIGN_OR_RETURN(corpus, data::MakeCorpus(config.data()));
  }
  // The whole sequences of every data rank (the rows of each group of ranks that share
  // sequences, §12, §16: data/shard.h DataPlace).
  GRADSUM_ASSIGN_OR_RETURN(
      const data::DataPlace place,
      data::DataPlaceOf(config.parallelism(), config.data().seq_len(), /*rank=*/0));
  const int G = config.parallelism().grad_acc(), W = place.data_ranks;
  std::vector<std::vector<data::MicroBatch>> batch(G, std::vector<data::MicroBatch>(W));
  for (int r = 0; r < W; ++r) {
    GRADSUM_ASSIGN_OR_RETURN(data::RankDataLoader loader,
                             data::RankDataLoader::Create(corpus, config.data(), r, W));
    loader.SkipSteps(step_index, G);
    std::vector<data::MicroBatch> step = loader.NextStep(G);
    for (int m = 0; m < G; ++m) batch[m][r] = std::move(step[m]);
  }
  return batch;
}

testing::ReferenceConfig ReferenceConfigFor(const TrainConfig& config,
                                            const model::ExpertBias& expert_bias) {
  // The model the trainer builds (the one converter, train/moe_lm.h), in the reference's
  // terms.
  const model::MoeLmConfig m = ToMoeLmConfig(config.model(), config.loss());
  testing::ReferenceConfig rc = testing::ReferenceConfigOf(m);
  for (const std::vector<float>& layer : expert_bias) {
    rc.expert_bias.emplace_back(layer.begin(), layer.end());
  }
  rc.ce_mode = TrainConfig::CeMode_Name(config.loss().ce_mode());
  return rc;
}

absl::StatusOr<ParityReport> CheckParity(
    const TrainConfig& config, const NamedParams& weights,
    const std::vector<std::vector<data::MicroBatch>>& global_batch, const NamedParams& grads,
    const StepLosses& losses, double tolerance, const model::ExpertBias& expert_bias) {
  const testing::ReferenceConfig rc = ReferenceConfigFor(config, expert_bias);
  testing::NamedTensors params;
  for (const auto& [name, values] : weights) params[name].assign(values.begin(), values.end());
  std::vector<std::vector<testing::ReferenceMicroBatch>> batch(global_batch.size());
  for (size_t mi = 0; mi < global_batch.size(); ++mi) {
    for (const data::MicroBatch& mb : global_batch[mi]) {
      testing::ReferenceMicroBatch r{mb.tokens, mb.labels, mb.mask, mb.sample_ids};
      r.seq_len = mb.seq_len;
      r.doc_start = mb.doc_start;
      batch[mi].push_back(std::move(r));
    }
  }
  GRADSUM_ASSIGN_OR_RETURN(testing::ReferenceResult ref,
                           testing::ReferenceLossAndGrads(rc, params, batch));
  ParityReport report;
  report.tolerance = tolerance;
  for (const auto& [name, shape] : testing::ReferenceParamShapes(rc)) {
    const std::vector<double>& want = ref.grads.at(name);
    auto it = grads.find(name);
    if (it == grads.end() || it->second.size() != want.size()) {
      return absl::InvalidArgumentError(absl::StrCat("gradient ", name, " missing or mis-sized"));
    }
    double norm = 0, ref_norm = 0, ref_max = 0, err_max = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double g = it->second[i];
      norm += g * g;
      ref_norm += want[i] * want[i];
      ref_max = std::max(ref_max, std::abs(want[i]));
      err_max = std::max(err_max, std::abs(g - want[i]));
    }
    ParamParity p;
    p.name = name;
    p.norm_ratio = ref_norm > 0 ? std::sqrt(norm / ref_norm) : (norm > 0 ? INFINITY : 1.0);
    p.max_rel_err = ref_max > 0 ? err_max / ref_max : (err_max > 0 ? INFINITY : 0.0);
    report.worst = std::max({report.worst, std::abs(p.norm_ratio - 1), p.max_rel_err});
    report.params.push_back(p);
  }
  if (losses.mtp.size() != ref.mtp.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the step logged ", losses.mtp.size(), " MTP terms, the reference has ", ref.mtp.size()));
  }
  std::vector<std::tuple<std::string, double, double>> terms = {
      {"ce", losses.ce, ref.ce}, {"z", losses.z, ref.z}, {"bal", losses.bal, ref.bal}};
  // §3.2's output z-loss is its own display term only when it is on.
  if (rc.ce.alpha_lse > 0) terms.emplace_back("z_out", losses.z_out, ref.z_out);
  for (size_t j = 0; j < ref.mtp.size(); ++j) {
    terms.push_back({absl::StrCat("mtp_", j + 1), losses.mtp[j], ref.mtp[j]});
  }
  for (const auto& [name, value, reference] : terms) {
    LossParity l{name, value, reference, 0};
    const double diff = std::abs(value - reference);
    l.rel_err = reference != 0 ? diff / std::abs(reference) : (diff > 0 ? INFINITY : 0.0);
    report.worst = std::max(report.worst, l.rel_err);
    report.losses.push_back(l);
  }
  report.ok = report.worst <= tolerance;  // false for NaN too
  return report;
}

absl::StatusOr<ParityReport> RunParityCheck(const TrainConfig& config, Communicator& world,
                                            const NamedParams& weights, const NamedParams& grads,
                                            const StepMetrics& record,
                                            const model::ExpertBias& expert_bias) {
  // Rank 0 runs the reference; every rank learns the verdict, so all fail together.
  ParityReport report;
  int64_t ok = 0;
  absl::Status local = absl::OkStatus();
  if (world.rank() == 0)
    local = [&]() -> absl::Status {
      const bool f32 = config.precision().compute_dtype() == TrainConfig::f32 &&
                       config.precision().reduce_dtype() == TrainConfig::f32;
      // bf16 rounds parameters or gradients to 8 bits of mantissa: a looser bar, the one
      // moe/cuda's bf16 layer test uses (the tiny test models' expert gradients reach 2.1e-2).
      const double tolerance = config.debug().parity_tolerance();
      const double tol = f32 ? tolerance : std::max(tolerance, 3e-2);
      GRADSUM_ASSIGN_OR_RETURN(auto global_batch, GlobalBatchForStep(config, 0));
      GRADSUM_ASSIGN_OR_RETURN(report, CheckParity(config, weights, global_batch, grads,
                                                   {record.ce(),
                                                    record.z(),
                                                    record.bal(),
                                                    record.z_out(),
                                                    {record.mtp().begin(), record.mtp().end()}},
                                                   tol, expert_bias));
      ok = report.ok ? 1 : 0;
      return absl::OkStatus();
    }();
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, local, "--parity_check"));
  GRADSUM_RETURN_IF_ERROR(world.Broadcast(&ok, 1, DType::kI64, 0));
  if (world.rank() != 0) report.ok = ok == 1;
  return report;
}

}  // namespace gradsum::train
