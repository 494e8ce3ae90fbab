#ifndef GRADSUM_TRAIN_MOE_LM_H_
#define GRADSUM_TRAIN_MOE_LM_H_

// moe_lm (SEMANTICS.md §10) on one rank of a (F, P) mesh, built from the library:
// moe/ (router, dropless dispatch over the EP group, grouped SwiGLU experts), losses/
// (fused linear CE, router z-loss, balancing loss, step statistics, display) and
// sharding/ (flat parameter groups with sharded or replicated SUM reduction). The
// embedding and RMSNorm are train/layers.h.
//
// Parameters live in FlatParam units (docs/CHECKPOINTS.md has the layout), in forward
// order, with layers_per_unit = k (the wrap policy; 1 by default):
//   "emb"                               over the world: emb
//   "layers.{l}" ("layers.{a}-{b}")     over the world: the norm and router of layer l
//                                       (of layers a..b when k > 1)
//   "layers.{l}.experts.ep{p}"          over this rank's EDP group: the E/P experts of EP
//                                       slot p (of every layer of the unit), stacked per
//                                       layer as all wg, then all wu, then all wd
//   "head"                              over the world: final_norm, out
// Each micro-batch's forward + backward runs through the shared UnitSchedule
// (train/unit_schedule.h): units are gathered one stage ahead, freed after forward
// (sharded mode), re-gathered one stage ahead in backward, and each unit's SUM reduction
// is issued as soon as backward has completed its gradient (sharded: a reduce-scatter
// into the fp32 sharded accumulator; replicated: GradBucketer buckets, last micro-batch).
// FinishGradReduce() waits for them before the optimizer (see train/trainer.h).
//
//   GRADSUM_ASSIGN_OR_RETURN(auto model, MoeLm::Create(options, mesh));
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
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/dtype.h"
#include "losses/display.h"
#include "losses/step_stats.h"
#include "moe/moe_layer.h"
#include "sharding/flat_param.h"
#include "train/config.pb.h"
#include "train/data.h"
#include "train/unit_schedule.h"

namespace gradsum::train {

// Full parameter (or gradient) values by name, row-major fp32.
using NamedParams = std::map<std::string, std::vector<float>>;

// InvalidArgument unless tokens, labels and mask have one length and every token is in
// [0, vocab) (naming the first bad token and its position). Labels are the CE's to check.
absl::Status CheckMicroBatchTokens(const MicroBatch& batch, int64_t vocab);

// The CE weights w_t (§3) of micro-batch `micro_index` with `tokens` tokens: empty in token
// mode (w_t = 1 for valid tokens), else stats.token_weights[micro_index]. InvalidArgument
// for a micro_index outside [0, G) or weights of another length.
absl::StatusOr<absl::Span<const float>> MicroBatchTokenWeights(const losses::StepStats& stats,
                                                               int micro_index, int64_t tokens);

// Every parameter's name and shape (SEMANTICS.md §10 names, as in the dumps).
std::vector<std::pair<std::string, std::vector<int64_t>>> MoeLmParamShapes(
    const ModelConfig& model);

struct MoeLmOptions {
  ModelConfig model;
  ShardingMode sharding = ShardingMode::kSharded;
  // Parameters as forward reads them: f32, or bf16 (rounded to nearest even and
  // all-gathered in bf16, half the bytes; the CPU kernels then widen them exactly to fp32
  // and compute in fp32). Gradients and the master weights stay fp32 either way.
  DType compute_dtype = DType::kF32;
  DType reduce_dtype = DType::kF32;  // gradient SUM dtype: f32 or bf16
  double alpha_b = 0.001;            // §5
  double alpha_z = 0.001;            // §4
  int num_threads = 1;               // threads for the rank's loss kernels and GEMMs
  // The unit schedule (train/unit_schedule.h, docs/CHECKPOINTS.md):
  int layers_per_unit = 1;            // wrap policy: layers per FlatParam unit
  bool reshard_after_forward = true;  // sharded mode: free units after their forward
  // Sharded mode: reduce-scatter every micro-batch (true) or only the last one's
  // accumulated full gradient (false).
  bool reduce_every_micro_batch = true;
  // Replicated mode: GradBucketer caps (collectives/bucketer.h).
  size_t bucket_cap_bytes = size_t{25} << 20;
  size_t first_bucket_cap_bytes = size_t{1} << 20;
  // Bitwise-reproducible mode (docs/REPRODUCIBILITY.md): every per-token value is computed
  // per packed sequence (row blocks of seq_len rows), every weight gradient is summed
  // exactly per sequence (per (sequence, expert) for the experts) in FlatParam's exact
  // gradient mode, and the display terms are added per sequence. The CPU model only.
  bool reproducible = false;
};

// The rank's communicators (not owned; they must outlive the model). ep_group: the P
// ranks with this rank's f (contiguous); edp_group: the F ranks with this rank's p.
struct MoeLmGroups {
  Communicator* world = nullptr;
  Communicator* ep_group = nullptr;
  Communicator* edp_group = nullptr;
};

// One micro-batch's local loss components (detached, §8).
struct MicroBatchLosses {
  double ce = 0, z = 0, bal = 0;
};

class MoeLm {
 public:
  virtual ~MoeLm() = default;

  // InvalidArgument for bad sizes (E % P, K > E, non-positive sizes), null or
  // inconsistent groups (ep_group->size() * edp_group->size() != world->size()).
  static absl::StatusOr<std::unique_ptr<MoeLm>> Create(const MoeLmOptions& options,
                                                       const MoeLmGroups& groups);

  // The initial parameters, the same on every rank for a seed: norm gains 1, emb ~ N(0,1),
  // every matrix ~ N(0, init_std^2), drawn in MoeLmParamShapes order.
  static NamedParams InitialParameters(const ModelConfig& model, uint64_t seed);

  // Sets every parameter this rank holds from full values (same on every rank).
  // InvalidArgument naming a missing or mis-sized parameter.
  absl::Status SetFullParameters(const NamedParams& params);

  // Prepares the next step after the master parameters changed (creation, optimizer step,
  // checkpoint load); call before the step's first forward. The parameters themselves
  // are gathered unit by unit during forward and backward (replicated mode: copied once
  // and kept). Virtual: train/cuda's MoeLmCuda also resets its failed-step state.
  virtual absl::Status Unshard();

  // Forward and backward of one micro-batch of this rank. `stats` are the step's global
  // statistics (D, N, and in sample / square mode the CE weights w_t of every micro-batch,
  // §3); `micro_index` in [0, G) picks this micro-batch's weights (and micro_index ==
  // G - 1 marks the last micro-batch). InvalidArgument for a micro_index outside the
  // statistics or weights of the wrong length. Adds the local gradients into the units'
  // gradient buffers, issues their SUM reductions as they complete (see above), and adds
  // the loss components into `display` (terms "ce", "z", "bal").
  // Collective over the EP group (dispatch) and the world (expert-count all-reduce).
  // Errors: bad batch (labels or tokens outside [0, V)) as InvalidArgument; the
  // components' errors as they are.
  // Virtual: train/cuda's MoeLmCuda computes on its GPU instead.
  virtual absl::StatusOr<MicroBatchLosses> ForwardBackward(const MicroBatch& batch,
                                                           const losses::StepStats& stats,
                                                           int micro_index,
                                                           losses::StepDisplay* display);

  // After the step's last ForwardBackward: waits for every unit's reduction, so that
  // master_grad() holds the SUM-reduced gradient (§7). Collective (the waits).
  absl::Status FinishGradReduce();

  // The step's unit traffic so far, and reset: the most parameter bytes held unsharded at
  // once (compute dtype), and what the rank would hold with every unit unsharded.
  int64_t TakePeakUnshardedBytes() { return schedule_.TakePeakUnshardedBytes(); }
  int64_t FullParamBytes() const { return store_->FullBytes(); }

  // The parameter units this rank holds, in forward order (the optimizer's and the
  // checkpoint's groups).
  std::vector<FlatParam*> groups();

  // Full values of every parameter of the model, on every rank: each group's owned
  // slices all-gathered, experts of every EP slot combined over the world. `grads`: the
  // reduced gradients (master_grad) instead of the master values. Collective over the
  // world. For dumps and the parity check, not the training path.
  absl::StatusOr<NamedParams> GatherFull(bool grads);

  // Registers the display terms this model adds ("ce", "z", "bal").
  static absl::Status RegisterDisplayTerms(losses::StepDisplay* display);

  const MoeLmOptions& options() const { return options_; }

 protected:
  MoeLm() = default;
  // Validates options and groups and builds `model`'s parameter groups (Create's work,
  // shared with subclasses).
  static absl::Status Init(const MoeLmOptions& options, const MoeLmGroups& groups, MoeLm* model);
  // FinishGradReduce's precondition beyond the store's (MoeLmCuda: no failed micro-batch).
  virtual absl::Status CheckStepReducible() { return absl::OkStatus(); }
  // Where a parameter lives: unit and index in it.
  struct ParamRef {
    int unit = 0;
    int index = 0;
  };
  ParamRef emb_ref() const { return emb_; }
  ParamRef norm_ref(int layer) const { return norm_[layer]; }
  ParamRef router_ref(int layer) const { return router_[layer]; }
  // The first wg / wu / wd of this EP slot's experts of `layer` (E/P stacked entries).
  ParamRef gate_ref(int layer) const { return gate_[layer]; }
  ParamRef up_ref(int layer) const;
  ParamRef down_ref(int layer) const;
  ParamRef final_norm_ref() const { return final_norm_; }
  ParamRef out_ref() const { return out_; }
  FlatParam* unit(int u) const { return units_[u].get(); }
  int num_units() const { return static_cast<int>(units_.size()); }
  // Whether unit u holds experts (sharded over the EDP group) rather than world parameters.
  bool expert_unit(int u) const { return expert_unit_[u]; }
  // The schedule (stages: 0 embedding, 1 + l layer l, L + 1 the head) and the store it
  // moves units with; MoeLmCuda installs its device store.
  UnitSchedule& schedule() { return schedule_; }
  void set_store(std::unique_ptr<UnitStore> store) {
    store_ = std::move(store);
    widened_ = nullptr;
  }
  UnitStore& store() { return *store_; }
  const MoeLmGroups& comm() const { return comm_; }

 private:
  // Float view of a parameter (widened once per gather if bf16) and of its gradient.
  const float* Param(ParamRef ref);
  absl::StatusOr<float*> Grad(ParamRef ref);

  MoeLmOptions options_;
  MoeLmGroups comm_;
  int ep_rank_ = 0;
  std::vector<std::unique_ptr<FlatParam>> units_;
  std::vector<bool> expert_unit_;
  ParamRef emb_, final_norm_, out_;
  std::vector<ParamRef> norm_, router_, gate_;
  UnitSchedule schedule_;
  std::unique_ptr<UnitStore> store_;
  // fp32 copies of bf16 compute parameters, per unit, kept by the host store.
  std::vector<std::vector<float>>* widened_ = nullptr;
  std::vector<moe::MoeLayerState> layer_state_;
  // ForwardBackward's activations and gradients, kept from one micro-batch to the next so
  // that they are not fresh allocations (page faults, zero fill) every micro-batch.
  struct MicroBatchBuffers {
    std::vector<float> h, y, dh, da;                   // [T, D]
    std::vector<float> du;                             // [T, E]
    std::vector<std::vector<float>> h_in, a, inv_rms;  // per layer: [T, D], [T, D], [T]
    std::vector<float> f, inv_rms_final, grad_f;       // the head: [T, D], [T], [T, D]
  };
  MicroBatchBuffers buffers_;
};

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_MOE_LM_H_
