#ifndef GRADSUM_TRAIN_MOE_LM_H_
#define GRADSUM_TRAIN_MOE_LM_H_

// moe_lm (SEMANTICS.md §10) on one rank of a (F, P) mesh, as the trainer uses it: the
// three pieces put together for one device.
// - What the model is: model/moe_lm_spec.h (parameters, stages) and model/moe_lm.h (its
//   forward and backward, composed once from a device's ops, model/ops.h).
// - How it is distributed: parallel/parallelize.h (units, schedule, store, precision).
// - Where it computes: a ComputeDevice: the host (model/cpu_ops.h, the host unit store),
//   or a GPU (train/cuda/cuda_compute.h: model/cuda's ops, parallel/cuda's device store).
//
//   GRADSUM_ASSIGN_OR_RETURN(auto model, MoeLm::Create(options, mesh));   // host
//   GRADSUM_RETURN_IF_ERROR(model->SetFullParameters(MoeLm::InitialParameters(config, seed)));
//   GRADSUM_RETURN_IF_ERROR(model->Unshard());
//   for (int m = 0; m < G; ++m) {
//     GRADSUM_ASSIGN_OR_RETURN(MicroBatchLosses l,
//                              model->ForwardBackward(batch[m], stats, m, &display));
//   }
//   GRADSUM_RETURN_IF_ERROR(model->FinishGradReduce());   // master_grad() complete
//
// Thread safety: one MoeLm per rank, used by that rank's thread.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "core/dtype.h"
#include "data/loader.h"
#include "losses/display.h"
#include "losses/step_stats.h"
#include "model/moe_lm.h"
#include "model/moe_lm_spec.h"
#include "model/ops.h"
#include "parallel/flat_param.h"
#include "parallel/parallelize.h"
#include "train/config.pb.h"

namespace gradsum::train {

// Full parameter (or gradient) values by name, row-major fp32.
using NamedParams = model::NamedParams;
using MicroBatchLosses = model::MicroBatchLosses;

// The one converter from the config to the model's spec: its sizes from the model section,
// its loss weights, CE options, expert bias speed and MTP weight from the loss section.
// MoeLm::Create, the parameter shapes and the parity reference (train/parity.h) use it.
model::MoeLmConfig ToMoeLmConfig(const ModelConfig& model, const LossConfig& loss);

// Every parameter's name and shape (SEMANTICS.md §10 names, as in the dumps), in forward
// order. Empty for a config the spec rejects.
std::vector<std::pair<std::string, std::vector<int64_t>>> MoeLmParamShapes(
    const ModelConfig& model);

struct MoeLmOptions {
  ModelConfig model;
  // The loss weights (§4, §5), the LM head's CE options (§3.2), the expert bias's update
  // speed (§5.1) and the MTP weight (§15), as the config's loss section.
  LossConfig loss;
  // How the parameters are distributed (sharding mode, dtypes, wrap policy, schedule,
  // gradient precision: parallel/parallel_options.h).
  parallel::ParallelOptions parallel;
  // What each layer keeps for backward (model/moe_lm.h).
  model::Recompute recompute = model::Recompute::kNone;
  int num_threads = 1;  // threads for the rank's loss kernels and GEMMs (host compute)
};

// The one converter from the config to a rank's MoeLmOptions: the model and loss sections,
// and the parallelism, precision and comm settings as ParallelOptions and Recompute.
// num_threads stays 1: it depends on the mesh (train/build_model.h sets it).
MoeLmOptions ToMoeLmOptions(const TrainConfig& config);

// Where a rank computes: the store its parameter units live in, and its layers' ops.
// Empty members mean the host (MoeLm::Create fills them).
struct ComputeDevice {
  std::shared_ptr<parallel::UnitDevice> units;
  std::function<absl::StatusOr<std::unique_ptr<model::ModelOps>>(const model::MoeLmSpec&)> ops;
};

class MoeLm {
 public:
  // Errors: the spec's (model sizes), Parallelize's (mesh, options), the device's.
  // `mesh` (the rank's, collectives/mesh.h; not owned) must outlive the model.
  static absl::StatusOr<std::unique_ptr<MoeLm>> Create(const MoeLmOptions& options,
                                                       const Mesh& mesh, ComputeDevice device = {});

  // The initial parameters, the same on every rank for a seed (MoeLmSpec::InitialParameters).
  // Empty for a config the spec rejects.
  static NamedParams InitialParameters(const ModelConfig& model, uint64_t seed);

  // Sets every parameter this rank holds from full values (same on every rank).
  // InvalidArgument naming a missing or mis-sized parameter.
  absl::Status SetFullParameters(const NamedParams& params);

  // Prepares the next step after the master parameters changed (creation, optimizer step,
  // checkpoint load); call before the step's first forward.
  absl::Status Unshard();

  // Forward and backward of one micro-batch of this rank (model/moe_lm.h), issuing each
  // unit's SUM reduction as its gradient completes. Collective.
  absl::StatusOr<MicroBatchLosses> ForwardBackward(const data::MicroBatch& batch,
                                                   const losses::StepStats& stats, int micro_index,
                                                   losses::StepDisplay* display);

  // A held-out evaluation of one micro-batch (model/moe_lm.h MoeLmModel::Evaluate): forward
  // only, nothing reduced, no expert bias moved. Collective.
  absl::StatusOr<MicroBatchLosses> Evaluate(const data::MicroBatch& batch,
                                            const losses::StepStats& stats, int micro_index,
                                            losses::StepDisplay* display);

  // After the step's last ForwardBackward: every unit's reduction done, master_grad()
  // holds the SUM-reduced gradient (§7). Collective (the waits).
  absl::Status FinishGradReduce() { return params_->FinishGradReduce(); }

  int64_t TakePeakUnshardedBytes() { return params_->TakePeakUnshardedBytes(); }
  int64_t FullParamBytes() const { return params_->FullParamBytes(); }
  // The most activation bytes the model held at once since the last call, and resets it
  // (model/moe_lm.h MoeLmModel::TakePeakActivationBytes).
  int64_t TakePeakActivationBytes() { return model_->TakePeakActivationBytes(); }
  // The most bytes the LM head's CE held inside one call since the last call, and resets it
  // (model/ops.h ModelOps::TakePeakHeadScratchBytes).
  int64_t TakePeakHeadScratchBytes() { return model_->TakePeakHeadScratchBytes(); }

  // The parameter units this rank holds, in forward order.
  std::vector<FlatParam*> groups() { return params_->units(); }

  // Full values of every parameter (or gradient) on every rank. Collective over the world.
  absl::StatusOr<NamedParams> GatherFull(bool grads) { return params_->GatherFull(grads); }

  // Registers the display terms this model adds ("ce", "z", "bal", "z_out" with
  // alpha_lse > 0, and ExtraStreamTerms(); model/moe_lm.h).
  absl::Status RegisterDisplayTerms(losses::StepDisplay* display) const {
    return model::MoeLmModel::RegisterDisplayTerms(model_->spec().config(), display);
  }
  // The display terms of the heads of the label streams beyond the main one, one per stream
  // in stream order (the step record's per-stream values).
  std::vector<std::string> ExtraStreamTerms() const {
    return model::MoeLmModel::ExtraStreamTerms(model_->spec().config());
  }
  // What the model is (its MoE layers, its label streams).
  const model::MoeLmSpec& spec() const { return model_->spec(); }

  // The expert bias of §5.1 (model state, the same on every rank; model/moe_lm.h): [L][E],
  // or empty when the model holds none.
  const model::ExpertBias& expert_bias() const { return model_->expert_bias(); }
  absl::Status SetExpertBias(model::ExpertBias bias) {
    return model_->SetExpertBias(std::move(bias));
  }
  // Once per optimizer step, after its last ForwardBackward (MoeLmModel::UpdateExpertBias).
  void UpdateExpertBias() { model_->UpdateExpertBias(); }

  const MoeLmOptions& options() const { return options_; }

 private:
  // The model's view of a loader's micro-batch (spans into `batch`).
  static model::TokenBatch Tokens(const data::MicroBatch& batch);
  MoeLm() = default;

  MoeLmOptions options_;
  // Declared before what uses them, so they are destroyed last.
  std::shared_ptr<parallel::UnitDevice> device_;
  std::unique_ptr<parallel::ParallelParams> params_;
  std::unique_ptr<model::MoeLmModel> model_;
};

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_MOE_LM_H_
