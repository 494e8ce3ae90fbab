#ifndef GRADSUM_MODEL_MODEL_PARAMS_H_
#define GRADSUM_MODEL_MODEL_PARAMS_H_

// What the model's compute sees of its parameters: values and gradient targets in the
// compute device's memory, and the schedule that makes them available stage by stage.
// parallel/parallelize.h implements it over sharded parameter units; the model never
// knows how its parameters are sharded, replicated or reduced, nor in which precision.

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "core/grad_sink.h"

namespace gradsum::model {

// One micro-batch's compute, by stage (MoeLmSpec::stages()): forward(s) for s = 0 .. S-1
// (the last also runs its own backward), then backward(s) for s = S-2 .. 0.
struct StageFns {
  std::function<absl::Status(int stage)> forward;
  std::function<absl::Status(int stage)> backward;
};

class ModelParams {
 public:
  virtual ~ModelParams() = default;

  // Dense parameter `p` (an index into MoeLmSpec::params()) as forward reads it: fp32 in
  // the device's memory, valid while a stage that reads it runs.
  virtual const float* Values(int p) = 0;
  // Where backward adds its gradient (valid while the stage that writes it runs).
  virtual absl::StatusOr<GradTarget> Grad(int p) = 0;

  // This rank's experts of `layer` (the EP slot's E / ep experts, from
  // first_local_expert()), stacked as ops.h's MoeWeights::local_experts, and their gradient.
  virtual const float* LocalExperts(int layer) = 0;
  virtual absl::StatusOr<GradTarget> LocalExpertsGrad(int layer) = 0;
  virtual int num_local_experts() const = 0;
  virtual int first_local_expert() const = 0;

  // The row block the gradient precision asks of the compute when this rank holds
  // `local_seq_len` consecutive tokens of each sequence (model/ops.h): 0, or, with exact
  // gradients, a block no contribution may cross (the configured one, or the rank's share
  // of each sequence), so that its bits do not depend on its neighbours or the mesh.
  virtual int64_t RowBlock(int64_t local_seq_len) const = 0;

  // Runs one micro-batch's stages with the parameter traffic around them (gathers before
  // the stages that read a unit, frees after, and each unit's gradient reduction issued as
  // soon as backward completes it). `last_micro_batch`: the step's last.
  virtual absl::Status RunMicroBatch(const StageFns& stages, bool last_micro_batch) = 0;
  // One micro-batch's stages.forward only (an evaluation), with the gathers and frees
  // around them; nothing is reduced.
  virtual absl::Status RunForward(const StageFns& stages) = 0;
};

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_MODEL_PARAMS_H_
