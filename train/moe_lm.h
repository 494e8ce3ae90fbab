#ifndef GRADSUM_TRAIN_MOE_LM_H_
#define GRADSUM_TRAIN_MOE_LM_H_

// moe_lm (SEMANTICS.md §10) on one rank of a (F, P) mesh, built from the library:
// moe/ (router, dropless dispatch over the EP group, grouped SwiGLU experts), losses/
// (fused linear CE, router z-loss, balancing loss, step statistics, display) and
// sharding/ (flat parameter groups with sharded or replicated SUM reduction). The
// embedding and RMSNorm are train/layers.h.
//
// Parameters live in FlatParam groups:
//   "dense"                  over the world: emb, layers.{l}.norm, layers.{l}.router,
//                            final_norm, out (every rank holds them, §7)
//   "layers.{l}.experts.ep{p}" over this rank's EDP group: the E/P experts of EP slot p,
//                            stacked as all wg, then all wu, then all wd (moe/experts.h)
// Each micro-batch's forward + backward ADDS the local gradient of the rank's local loss
// components (§3-5) into the groups' gradient buffers; the caller reduces them (ReduceGrad)
// and steps the optimizer (see train/trainer.h).
//
//   GRADSUM_ASSIGN_OR_RETURN(auto model, MoeLm::Create(options, mesh));
//   GRADSUM_RETURN_IF_ERROR(model->SetFullParameters(MoeLm::InitialParameters(config, seed)));
//   GRADSUM_RETURN_IF_ERROR(model->Unshard());
//   for (int m = 0; m < G; ++m) {
//     GRADSUM_ASSIGN_OR_RETURN(MicroBatchLosses l, model->ForwardBackward(batch[m], stats, m,
//     &display)); for (FlatParam* g : model->groups()) GRADSUM_RETURN_IF_ERROR(g->ReduceGrad(m == G
//     - 1));
//   }
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

  // All-gathers (sharded) or copies (replicated) the compute parameters; call before the
  // step's first forward and again after each optimizer step.
  // Virtual: train/cuda's MoeLmCuda also uploads them to its GPU.
  virtual absl::Status Unshard();

  // Forward and backward of one micro-batch of this rank. `stats` are the step's global
  // statistics (D, N, and in sample / square mode the CE weights w_t of every micro-batch,
  // §3); `micro_index` in [0, G) picks this micro-batch's weights. InvalidArgument for a
  // micro_index outside the statistics or weights of the wrong length. Adds the local gradients into the groups'
  // gradient buffers and the loss components into `display` (terms "ce", "z", "bal").
  // Collective over the EP group (dispatch) and the world (expert-count all-reduce).
  // Errors: bad batch (labels or tokens outside [0, V)) as InvalidArgument; the
  // components' errors as they are.
  // Virtual: train/cuda's MoeLmCuda computes on its GPU instead.
  virtual absl::StatusOr<MicroBatchLosses> ForwardBackward(const MicroBatch& batch,
                                                           const losses::StepStats& stats,
                                                           int micro_index,
                                                           losses::StepDisplay* display);

  // After micro-batch ForwardBackward: SUM-reduces this micro-batch's gradients into the
  // groups' master_grad() (FlatParam::ReduceGrad on every group, §7). MoeLmCuda reduces
  // its device gradients with NCCL and folds them in (FlatParam::FoldReducedGrad).
  // Collective over the world.
  virtual absl::Status ReduceGrads(bool last_micro_batch);

  // The parameter groups this rank holds (dense first).
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
  FlatParam* dense() const { return dense_.get(); }
  FlatParam* experts(int layer) const { return experts_[layer].get(); }
  int emb_index() const { return emb_index_; }
  int final_norm_index() const { return final_norm_index_; }
  int out_index() const { return out_index_; }
  int norm_index(int layer) const { return norm_index_[layer]; }
  int router_index(int layer) const { return router_index_[layer]; }
  const MoeLmGroups& comm() const { return comm_; }

 private:
  // Float view of parameter `index` of group `g` (converted once per Unshard if bf16).
  const float* Param(FlatParam* g, int index);
  absl::StatusOr<float*> Grad(FlatParam* g, int index);

  MoeLmOptions options_;
  MoeLmGroups comm_;
  int ep_rank_ = 0;
  std::unique_ptr<FlatParam> dense_;
  std::vector<std::unique_ptr<FlatParam>> experts_;  // one per layer
  // Indices in dense_: emb, per layer norm and router, final_norm, out.
  int emb_index_ = 0, final_norm_index_ = 0, out_index_ = 0;
  std::vector<int> norm_index_, router_index_;
  // fp32 copies of the compute parameters when compute_dtype is bf16 (group -> values).
  std::map<FlatParam*, std::vector<float>> compute_f32_;
  std::vector<moe::MoeLayerState> layer_state_;
};

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_MOE_LM_H_
