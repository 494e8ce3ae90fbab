#ifndef GRADSUM_PARALLEL_PARALLELIZE_H_
#define GRADSUM_PARALLEL_PARALLELIZE_H_

// Parallelism applied to a model as a function (as torchtitan's apply_fsdp / apply_ep):
// Parallelize(spec, mesh, options, device) groups the spec's parameters into units (the
// wrap policy; each EP slot's experts in units of their own), creates one FlatParam per
// unit over the communicator its gradients are summed over (SEMANTICS.md §7), builds the
// unit schedule from the spec's stages, and puts the units in the device's store. The
// result is what the model's compute sees of its parameters (model/model_params.h) and what
// the optimizer and checkpoints see (units()).
//
//   GRADSUM_ASSIGN_OR_RETURN(auto params, Parallelize(spec, mesh, options, device));
//   GRADSUM_RETURN_IF_ERROR(params->SetFullParameters(spec.InitialParameters(seed)));
//   ... model::MoeLmModel over params, ShardedAdamW over params->units() ...
//
// Units, in forward order, with layers_per_unit = k (docs/CHECKPOINTS.md has the layout):
//   "emb"                               over the world (the mesh's dp_shard axis): emb
//   "layers.{l}" ("layers.{a}-{b}")     over the world: the attention block's parameters
//                                       (attn_norm, wq, wk, wv, wo) when the model has
//                                       them, then the norm and router of layer l (of
//                                       layers a..b when k > 1)
//   "layers.{l}.experts.ep{p}"          over this rank's EDP group (edp_shard): the E/P experts of
//   EP
//                                       slot p (of every layer of the unit), stacked per
//                                       layer as all wg, then all wu, then all wd
//   "head"                              over the world: final_norm, out
// With HSDP (the mesh's shard_group), "over the world" reads "over the dense shard group
// (dp_shard), replicated across dp_replicate" and "over this rank's EDP group" reads "over
// the expert shard group (edp_shard), replicated across edp_replicate" (SEMANTICS.md §7).
// The mesh (collectives/mesh.h) checked its own shape when it was built; Parallelize checks
// only what the model adds (the experts divide over the EP group) and the options.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "collectives/mesh.h"
#include "model/model_params.h"
#include "model/moe_lm_spec.h"
#include "parallel/flat_param.h"
#include "parallel/parallel_options.h"
#include "parallel/unit_schedule.h"

namespace gradsum::parallel {

// Where a rank's parameter units live while the compute reads them: makes their store
// (the host's FlatParam buffers, or a GPU's device buffers: parallel/cuda/).
class UnitDevice {
 public:
  virtual ~UnitDevice() = default;
  // `units` (not owned) in forward order; expert_unit[u]: unit u is reduced over the EDP
  // group rather than the world.
  virtual absl::StatusOr<std::unique_ptr<UnitStore>> MakeStore(std::vector<FlatParam*> units,
                                                               std::vector<bool> expert_unit,
                                                               const ParallelOptions& options) = 0;
};

// The host: FlatParam buffers (parallel/host_unit_store.h).
class HostUnitDevice : public UnitDevice {
 public:
  absl::StatusOr<std::unique_ptr<UnitStore>> MakeStore(std::vector<FlatParam*> units,
                                                       std::vector<bool> expert_unit,
                                                       const ParallelOptions& options) override;
};

// Full parameter (or gradient) values by name, row-major fp32.
using NamedParams = model::NamedParams;

class ParallelParams : public model::ModelParams {
 public:
  ~ParallelParams() override;

  // ---- model::ModelParams. ----
  const float* Values(int p) override;
  absl::StatusOr<GradTarget> Grad(int p) override;
  const float* LocalExperts(int layer) override;
  absl::StatusOr<GradTarget> LocalExpertsGrad(int layer) override;
  int num_local_experts() const override { return local_experts_; }
  int first_local_expert() const override { return first_local_expert_; }
  int64_t RowBlock(int64_t local_seq_len) const override;
  absl::Status RunMicroBatch(const model::StageFns& stages, bool last_micro_batch) override;
  absl::Status RunForward(const model::StageFns& stages) override;

  // ---- The host side: optimizer, checkpoints, dumps. ----
  // The units this rank holds, in forward order (the optimizer's and checkpoints' groups).
  std::vector<FlatParam*> units() const;
  // Sets every parameter this rank holds from full values (the same on every rank).
  // InvalidArgument naming a missing or mis-sized parameter.
  absl::Status SetFullParameters(const NamedParams& params);
  // Full values of every parameter of the model, on every rank: each unit's owned slices
  // all-gathered, experts of every EP slot combined over the world. `grads`: the reduced
  // gradients (master_grad) instead of the master values. Collective over the world. For
  // dumps and the parity check, not the training path.
  absl::StatusOr<NamedParams> GatherFull(bool grads);

  // A new step after the masters changed (creation, optimizer step, checkpoint load).
  absl::Status PrepareStep() { return store_->PrepareStep(); }
  // Before a micro-batch (the store's protocol checks).
  absl::Status CheckMicroBatch() { return store_->CheckMicroBatch(); }
  // After the step's last micro-batch: waits for every unit's reduction, so that
  // master_grad() holds the SUM-reduced gradient (§7). Collective (the waits).
  absl::Status FinishGradReduce() { return schedule_.FinishStep(*store_); }

  // The step's unit traffic so far, and reset: the most parameter bytes held unsharded at
  // once (compute dtype), and what the rank would hold with every unit unsharded.
  int64_t TakePeakUnshardedBytes() { return schedule_.TakePeakUnshardedBytes(); }
  int64_t FullParamBytes() const { return store_->FullBytes(); }

  const ParallelOptions& options() const { return options_; }
  const Mesh& mesh() const { return *mesh_; }

 private:
  friend absl::StatusOr<std::unique_ptr<ParallelParams>> Parallelize(const model::MoeLmSpec& spec,
                                                                     const Mesh& mesh,
                                                                     const ParallelOptions& options,
                                                                     UnitDevice& device);
  ParallelParams() = default;

  // Where a parameter lives: its unit and entry (count > 1: a run of entries).
  struct Ref {
    int unit = -1;
    int index = 0;
    int count = 1;
  };

  model::MoeLmSpec spec_;
  ParallelOptions options_;
  const Mesh* mesh_ = nullptr;  // not owned
  int local_experts_ = 1, first_local_expert_ = 0;
  std::vector<std::unique_ptr<FlatParam>> units_;
  std::vector<bool> expert_unit_;
  std::vector<Ref> dense_;    // per spec parameter (unit -1 for expert parameters)
  std::vector<Ref> experts_;  // per layer: this rank's stacked experts
  UnitSchedule schedule_;
  std::unique_ptr<UnitStore> store_;
};

// Checks that the experts divide evenly over the mesh's EP group (SEMANTICS.md §7) and the
// options, then builds the units, the schedule and the store as described above.
// InvalidArgument naming the field or size at fault. `mesh` (not owned) must outlive the
// result.
absl::StatusOr<std::unique_ptr<ParallelParams>> Parallelize(const model::MoeLmSpec& spec,
                                                            const Mesh& mesh,
                                                            const ParallelOptions& options,
                                                            UnitDevice& device);

}  // namespace gradsum::parallel

#endif  // GRADSUM_PARALLEL_PARALLELIZE_H_
