#ifndef GRADSUM_TRAIN_TRAINER_H_
#define GRADSUM_TRAIN_TRAINER_H_

// The training loop of one rank: data, step statistics, G micro-batches of forward and
// backward, SUM gradient reduction (sharded or replicated), global grad norm and
// clipping, AdamW on the shards, the display all-reduce, logging, metrics, dumps, the
// parity check and checkpoints. Every rank runs the same Trainer; rank 0 writes.
//
//   RankComms comms{world, ep_group, edp_group, timer};
//   GRADSUM_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(config, comms));
//   GRADSUM_ASSIGN_OR_RETURN(TrainSummary s, trainer->Run(rank == 0 ? &std::cout : nullptr));
//
// One step (SEMANTICS.md): NextStep(G), this rank's rows of the step's global sequences
// (train/data.h); ComputeStepStats (one all-reduce: D, N, §3-4); for each micro-batch
// MoeLm::ForwardBackward, which gathers and frees the parameter units and issues each
// unit's SUM reduction as its gradient completes (train/unit_schedule.h; reduce-scatter in fsdp mode, bucketed all-reduce on
// the last micro-batch in replicated mode, §7); MoeLm::FinishGradReduce; ClipGradNorm
// (§7); AdamW; StepDisplay::Reduce (§8).
//
// Step 1 of a fresh run also writes --dump_dir and runs --parity_check (fails the run
// with FailedPrecondition if the reference disagrees beyond the tolerance).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "losses/display.h"
#include "sharding/adamw.h"
#include "sharding/checkpoint.h"
#include "train/config.pb.h"
#include "train/data.h"
#include "train/moe_lm.h"
#include "train/parity.h"
#include "collectives/timed_communicator.h"

namespace gradsum::train {

// The communicators of one rank (not owned). `timer` (may be null) is the CommTimer the
// communicators add their time to (collectives/timed_communicator.h).
// Builds the rank's model; the default is MoeLm::Create (host compute). The nccl backend
// passes train/cuda's CreateCudaMoeLm, which computes on the rank's GPU.
using MoeLmFactory = std::function<absl::StatusOr<std::unique_ptr<MoeLm>>(const MoeLmOptions&,
                                                                          const MoeLmGroups&)>;

struct RankComms {
  Communicator* world = nullptr;
  Communicator* ep_group = nullptr;
  Communicator* edp_group = nullptr;
  std::shared_ptr<CommTimer> timer;
  MoeLmFactory make_model;  // empty: MoeLm::Create
};

// What one step logs (global values, identical on every rank except the timings).
struct StepRecord {
  int64_t step = 0;  // 1-based
  double ce = 0, z = 0, bal = 0, loss = 0;
  int64_t valid_tokens = 0, routed_tokens = 0;
  double grad_norm = 0;
  double lr = 0;
  double step_seconds = 0, wait_seconds = 0;
  // The step's collectives (collectives/timed_communicator.h): their summed durations (comm_s)
  // and the part the rank's thread spent blocked in them (comm_exposed_s).
  double comm_seconds = 0, comm_exposed_seconds = 0;
  // comm_exposed_s split by the kind of collective that blocked (indexed by CommKind; the
  // parts sum to comm_exposed_s).
  double comm_exposed_by_kind_seconds[kNumCommKinds] = {};
  // Parameter bytes (compute dtype) held unsharded at once at most during the step, and
  // with every unit unsharded (train/unit_schedule.h).
  int64_t peak_unsharded_param_bytes = 0, full_param_bytes = 0;
  // Parts of step_seconds: every micro-batch's forward, backward and gradient reduction
  // (model), and grad norm + clipping + AdamW + Unshard (update). On the nccl backend the
  // model part is the GPU's; the update part runs on the host.
  double model_seconds = 0, update_seconds = 0;
  double tokens_per_second = 0;  // routed tokens of the world per second
  std::vector<double> maxvio;    // per layer (§8)
  // The log line, and the JSONL record (train/metrics.proto StepMetrics).
  std::string ToLogLine(int64_t total_steps) const;
  absl::StatusOr<std::string> ToJson() const;
};

struct TrainSummary {
  int64_t first_step = 0, last_step = 0;  // 1-based, inclusive; first > last if none ran
  double first_ce = 0, last_ce = 0;
  double tail_mean_ce = 0;    // mean CE of the last min(10, steps) steps
  double entropy_floor = -1;  // nats/token, < 0 when unknown (a --data file)
  double seconds = 0, comm_seconds = 0, comm_exposed_seconds = 0, wait_seconds = 0;
  double comm_exposed_by_kind_seconds[kNumCommKinds] = {};  // as StepRecord's, summed
  // Medians over the steps of comm_exposed_s / comm_s and peak_unsharded_param_bytes /
  // full_param_bytes (-1 when no step ran).
  double median_exposed_fraction = -1, median_peak_param_fraction = -1;
  double tokens_per_second = 0;
  std::optional<ParityReport> parity;
  std::string ToString() const;
};

class Trainer {
 public:
  // Validates `config` (ValidateConfig) and the communicators (world size == config.world,
  // ep_group size == config.ep), builds the model with the initial parameters (--init_from's
  // file if given), or with --resume loads the latest checkpoint, written on any mesh with
  // the same model and global batch (docs/CHECKPOINTS.md). Collective over the world.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const TrainConfig& config,
                                                         const RankComms& comms);

  // Runs until config.steps steps are done. `log` (rank 0 usually) gets one line per step
  // and the summary. Writes metrics / dumps / checkpoints / the --export file when configured (rank 0 for the
  // shared files; a checkpoint after the step's metrics line). Collective.
  absl::StatusOr<TrainSummary> Run(std::ostream* log);

  // One optimizer step (no logging, no checkpoint). Collective.
  absl::StatusOr<StepRecord> Step();

  // Steps completed so far (including those restored from a checkpoint).
  int64_t step() const { return step_; }
  MoeLm& model() { return *model_; }
  // The parity report of step 1 when --parity_check ran.
  const std::optional<ParityReport>& parity() const { return parity_; }
  // The full SUM-reduced gradients of step 1 (before clipping), when a dump or the parity
  // check asked for them.
  const std::optional<NamedParams>& first_step_grads() const { return first_step_grads_; }
  const std::vector<StepRecord>& history() const { return history_; }

 private:
  Trainer() = default;
  absl::Status WriteDump(const NamedParams& weights, const NamedParams& grads,
                         const std::vector<MicroBatch>& batches, const StepRecord& record);
  absl::Status SaveCheckpointNow();
  // The rank-local part of Create: corpus, data loader, checkpoint directory.
  absl::Status PrepareLocal();
  absl::Status Resume();
  // FailedPrecondition naming the first field that differs between the checkpoint's saved
  // config and this run's among those that decide the data stream and the model.
  absl::Status CheckResumeCompatible(const CheckpointInfo& info, int64_t step) const;
  // Seeks the data stream to the position the checkpoint recorded (DataLoss if it is not
  // the end of step_ steps of the global batch), or replays step_ steps if it has none.
  absl::Status RestoreDataPosition(const CheckpointInfo& info, const std::string& dir);
  bool is_rank0() const { return comms_.world->rank() == 0; }

  TrainConfig config_;
  RankComms comms_;
  std::unique_ptr<MoeLm> model_;
  std::unique_ptr<ShardedAdamW> optimizer_;
  std::unique_ptr<RankDataLoader> loader_;
  std::shared_ptr<const DocumentSource> corpus_;
  losses::StepDisplay display_;
  int64_t step_ = 0;
  bool fresh_start_ = true;
  std::string run_id_;       // kept in every checkpoint and across --resume
  std::string resume_note_;  // "resumed from step ..." (Run logs it)
  std::optional<ParityReport> parity_;
  std::optional<NamedParams> first_step_grads_;
  std::vector<StepRecord> history_;
};

// Writes every parameter of `model` (MoeLmParamShapes names and shapes) from `params` as one
// fp32 safetensors file with metadata "step" (the dumps' weights, --export).
absl::Status WriteParamsFile(const std::string& path, const ModelConfig& model,
                             const NamedParams& params, int64_t step);

// Reads such a file (--init_from): exactly the parameters of `model`, f32, their shapes. A
// missing, extra or misshapen tensor is InvalidArgument naming it; read errors name `path`.
absl::StatusOr<NamedParams> ReadParamsFile(const std::string& path, const ModelConfig& model);

// The directory of the checkpoint after `step` inside `checkpoint_dir`.
std::string CheckpointPath(const std::string& checkpoint_dir, int64_t step);

// The step of the newest complete checkpoint in `checkpoint_dir` (one with its commit
// marker), or NotFound.
absl::StatusOr<int64_t> LatestCheckpointStep(const std::string& checkpoint_dir);

// Steps after `step` whose directories in `checkpoint_dir` have no commit marker (saves
// interrupted before they committed), ascending.
std::vector<int64_t> IncompleteCheckpointsAfter(const std::string& checkpoint_dir, int64_t step);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_TRAINER_H_
