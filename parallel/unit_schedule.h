#ifndef GRADSUM_PARALLEL_UNIT_SCHEDULE_H_
#define GRADSUM_PARALLEL_UNIT_SCHEDULE_H_

// The order of a training step's parameter communication (FSDP2's schedule), written once
// for every model and device: which parameter units are gathered before each stage of
// forward and backward, which are prefetched one stage ahead, when each is freed again, and
// when each unit's gradient reduction is issued and waited on. The model (model/moe_lm.h)
// supplies only its stages' compute, and a UnitStore (parallel/host_unit_store.h on the
// host, parallel/cuda/device_unit_store.h on a GPU) moves the units' bytes;
// parallel/parallelize.h puts the three together.
//
// A model is a chain of stages 0 .. S-1 in forward order; the last one is the turn stage,
// whose forward call also runs its backward (the LM head's fused CE). Each stage reads a
// set of units; a unit may span several stages (a coarser wrap policy). One micro-batch:
//
//   forward, s = 0 .. S-2:  gather s's units (wait) | issue s+1's gathers | forward(s) |
//                           free the units s was the last forward reader of
//                           (reshard_after_forward)
//   turn, s = S-1:          gather s's units (wait) | issue S-2's gathers (if its backward
//                           reads parameters) | forward(s), which includes backward(s) |
//                           free + issue the reduction of units whose gradient is complete
//   backward, s = S-2 .. 0: wait the previous micro-batch's reduction of units whose
//                           gradient s writes first | gather s's units if backward(s)
//                           reads them (wait) | issue s-1's gathers | backward(s) | free +
//                           issue the reduction of the units s was the first reader of
//
// Reductions are only waited for where their values are needed: before the next
// micro-batch writes the unit's gradient again, and in FinishStep (grad norm, optimizer).
// In replicated mode nothing is freed (the units stay resident; gathering is a copy).

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "core/grad_sink.h"

namespace gradsum::parallel {

// Where a model's units live and how their bytes move (host FlatParams, or device
// buffers), and what the compute reads and writes of them. Every call is made by the rank's
// thread (the schedule's calls in the schedule's order, identically on every rank).
class UnitStore {
 public:
  virtual ~UnitStore() = default;

  // ---- What the compute sees (while the schedule holds the unit gathered). ----
  // Entry `index` of unit u as forward reads it: fp32 in the compute device's memory.
  virtual const float* Values(int u, int index) = 0;
  // Where backward adds the gradient of entries [first, first + count) of unit u, which
  // lie end to end in the unit's flat layout.
  virtual absl::StatusOr<GradTarget> Grad(int u, int first, int count) = 0;

  // ---- The step's protocol. ----
  // The masters changed (creation, optimizer step, checkpoint load): a new step starts.
  virtual absl::Status PrepareStep() { return absl::OkStatus(); }
  // Before a micro-batch: FailedPrecondition if the store cannot run one now (a device
  // store whose copy of the masters is stale, or whose step already failed).
  virtual absl::Status CheckMicroBatch() { return absl::OkStatus(); }
  // A micro-batch failed: its gradients are incomplete (a device store drops them).
  virtual void MicroBatchFailed() {}

  // ---- The schedule's calls. ----
  // Starts making unit u's parameters readable (an all-gather in sharded mode). No-op
  // when they already are or the gather is in flight.
  virtual absl::Status StartGather(int u) = 0;
  // Waits for it; afterwards the unit's parameters are readable by the stage compute.
  virtual absl::Status WaitGather(int u) = 0;
  // Frees the gathered parameters (sharded mode).
  virtual absl::Status Release(int u) = 0;
  // Unit u's gradient of this micro-batch is complete: issue its SUM reduction (or keep
  // accumulating, where the mode reduces only on the last micro-batch).
  virtual absl::Status StartReduce(int u, bool last_micro_batch) = 0;
  // Waits for u's reduction in flight and folds it into the sharded accumulator (OK if
  // none is). Afterwards u's gradient buffer may be written again.
  virtual absl::Status WaitReduce(int u) = 0;
  // The last micro-batch, one stage after u's reduction was issued: a reduction with a
  // second stage (HSDP's cross-replica all-reduce, SEMANTICS.md §7) may start it now, so
  // that it overlaps the next stage's backward. The default has no second stage.
  virtual absl::Status AdvanceReduce(int u) {
    (void)u;
    return absl::OkStatus();
  }
  // After the last micro-batch: every reduction done, master_grad() complete.
  // FailedPrecondition after MicroBatchFailed() in this step.
  virtual absl::Status FinishReductions() = 0;
  // Parameter bytes held unsharded now (compute dtype), and with every unit unsharded.
  virtual int64_t UnshardedBytes() const = 0;
  virtual int64_t FullBytes() const = 0;
};

struct UnitScheduleOptions {
  // Sharded mode: units are gathered and freed; replicated: they stay resident.
  bool sharded = true;
  // Free each unit after the forward of its last stage (re-gathered for backward).
  bool reshard_after_forward = true;
};

class UnitSchedule {
 public:
  // stage_units[s]: the units stage s reads (each in [0, num_units)); backward_reads[s]:
  // whether backward(s) reads them (the embedding's backward does not). Every unit must be
  // read by a contiguous range of stages. InvalidArgument otherwise.
  static absl::StatusOr<UnitSchedule> Create(int num_units,
                                             std::vector<std::vector<int>> stage_units,
                                             std::vector<bool> backward_reads,
                                             UnitScheduleOptions options);
  UnitSchedule() = default;

  struct Stages {
    // forward(S-1) runs the turn stage's forward and backward.
    std::function<absl::Status(int stage)> forward;
    std::function<absl::Status(int stage)> backward;  // stages S-2 .. 0
  };

  // One micro-batch's forward and backward with the unit traffic described above.
  // After an error the units may be left gathered; the next micro-batch re-uses them.
  absl::Status RunMicroBatch(UnitStore& store, const Stages& stages, bool last_micro_batch);
  // One micro-batch's forward only (an evaluation): forward(s) for every stage, the turn
  // stage's included, each stage's units gathered first (the next stage's prefetched), and
  // in sharded mode each unit freed after its last stage. No gradient, no reduction.
  absl::Status RunForward(UnitStore& store, const std::function<absl::Status(int stage)>& forward);
  // Waits for every reduction (before the grad norm and the optimizer).
  absl::Status FinishStep(UnitStore& store);

  // The most parameter bytes held unsharded at once since the last call (sampled after
  // every gather issued), and resets it.
  int64_t TakePeakUnshardedBytes();

  int num_stages() const { return static_cast<int>(stage_units_.size()); }
  int num_units() const { return num_units_; }
  const UnitScheduleOptions& options() const { return options_; }

 private:
  absl::Status Gather(UnitStore& store, int stage, bool wait);
  absl::Status Complete(UnitStore& store, int stage, bool last_micro_batch);

  int num_units_ = 0;
  std::vector<std::vector<int>> stage_units_;
  std::vector<bool> backward_reads_;
  std::vector<int> first_stage_, last_stage_;  // per unit
  UnitScheduleOptions options_;
  int64_t peak_ = 0;
};

}  // namespace gradsum::parallel

#endif  // GRADSUM_PARALLEL_UNIT_SCHEDULE_H_
