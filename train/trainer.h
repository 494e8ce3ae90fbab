#ifndef GRADSUM_TRAIN_TRAINER_H_
#define GRADSUM_TRAIN_TRAINER_H_

// The training loop of one rank. Every rank runs the same Trainer; rank 0 writes the shared
// files.
//
//   RankMesh mesh = ...;                                   // train/rank_main.h
//   GRADSUM_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(config, mesh.comms()));
//   GRADSUM_ASSIGN_OR_RETURN(TrainSummary s, trainer->Run(rank == 0 ? &std::cout : nullptr));
//
// One step (Step, SEMANTICS.md), in named phases:
//   1. statistics     this rank's rows of the step's global sequences (data/loader.h) and
//                     ComputeStepStats: one all-reduce of D and N (§3-4)
//   2. micro-batches  MoeLm::ForwardBackward for each of the G micro-batches, through the
//                     unit schedule (parallel/unit_schedule.h): units gathered and freed, each
//                     unit's SUM reduction issued as its gradient completes (§7)
//   3. reductions     MoeLm::FinishGradReduce waits for them
//   4. clip           the global grad norm, clipped to optim.grad_clip (§7)
//   5. AdamW          on this rank's shards, at the warmup schedule's lr; then the expert
//                     bias's sign update from the step's global counts (§5.1; no collective)
//   6. display        StepDisplay::Reduce, the step's global losses (§8)
// and the record (StepMetrics, train/metrics.proto). Around the steps, Run logs
// (train/step_log.h), saves checkpoints (train/checkpointing.h) and, after step 1 of a
// fresh run, writes the dump (train/debugging.h) and runs the parity check
// (RankComms::parity_check; train/parity.h).

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/timed_communicator.h"
#include "data/document_source.h"
#include "data/loader.h"
#include "io/dir_lock.h"
#include "losses/display.h"
#include "losses/step_stats.h"
#include "losses/token_weights.h"
#include "optim/adamw.h"
#include "train/build_model.h"
#include "train/config.pb.h"
#include "train/metrics.pb.h"
#include "train/metrics_file.h"
#include "train/moe_lm.h"
#include "train/parity_report.h"
#include "train/run_metrics.h"
#include "train/step_log.h"
#include "train/tfevents.h"

namespace gradsum::train {

class Trainer {
 public:
  // Validates `config` (ValidateConfig), checks that every rank has the same config and data
  // (train/config_agreement.h; --data must be a regular file), checks every output and takes
  // the checkpoint directory (PrepareOutputs: a run refused there writes nothing), builds
  // the model (BuildModel) with the initial parameters
  // (--init_from's file if given), or with checkpoint.resume loads the latest checkpoint,
  // written on any mesh with the same model and global batch (train/checkpointing.h). The
  // group sizes are comms.mesh's (MakeRankMesh builds it from config.parallelism()).
  // Collective over the world.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const TrainConfig& config,
                                                         const RankComms& comms);

  // Runs until optim.steps steps are done. `log` (rank 0 usually) gets one line per step
  // and the summary. Writes metrics / dumps / checkpoints / the --export file when
  // configured (rank 0 for the shared files; a checkpoint after the step's metrics line).
  // Collective.
  absl::StatusOr<TrainSummary> Run(std::ostream* log);

  // One optimizer step (no logging, no checkpoint). Collective.
  absl::StatusOr<StepMetrics> Step();

  // Steps completed so far (including those restored from a checkpoint).
  int64_t step() const { return step_; }
  MoeLm& model() { return *model_; }
  // The parity report of step 1 when --parity_check ran.
  const std::optional<ParityReport>& parity() const { return parity_; }
  // The full SUM-reduced gradients of step 1 (before clipping), when a dump or the parity
  // check asked for them.
  const std::optional<NamedParams>& first_step_grads() const { return first_step_grads_; }
  const std::vector<StepMetrics>& history() const { return history_; }

  // The held-out CE of the evaluation batch (log.eval_every > 0: Run calls it every
  // eval_every steps and after the last; the same batch each time): forward only, nothing
  // reduced, no parameter or statistic of training moved. FailedPrecondition without
  // log.eval_every. Collective.
  absl::StatusOr<double> Evaluate();

 private:
  // checkpoint.save_on_signal, at a step boundary: the largest stop signal any rank has
  // received (0: none; one MAX all-reduce). Collective.
  absl::StatusOr<int> AgreeOnStopSignal();
  // Saves the steps done (unless saved already), then returns the run's Cancelled status,
  // naming the signal and the checkpoint; the same on every rank. Collective.
  absl::Status StopOnSignal(int signal, std::ostream* log);
  // MFU's peak (log.peak_tflops on every rank, or measured on rank 0, logged to `log`).
  void SetPeakFlops(std::ostream* log);
  // SaveRunCheckpoint of the steps done, then PruneCheckpoints. Collective.
  absl::Status SaveCheckpointNow();
  // After a non-finite gradient norm: the first NaN or infinite element this rank owns.
  absl::Status FirstNonFiniteGradient();
  Trainer() = default;
  Communicator& world() { return comms_.mesh->world(); }
  bool is_rank0() const { return comms_.mesh->world().rank() == 0; }
  // The rank-local part of Create: the data loader.
  absl::Status PrepareLocal();
  // Every output checked before step 1, each agreed on by every rank under its flag's name:
  // the checkpoint directory (created and probed on every rank; rank 0 takes it,
  // TakeCheckpointDir), the --metrics file (opened by rank 0), the --export destination
  // (probed by rank 0) and, for a fresh run, the --dump_dir (created and probed on every
  // rank). Collective.
  absl::Status PrepareOutputs();

  // When the step's parts began and how long they took (StepMetrics' timings).
  struct StepTimes {
    absl::Time start;
    absl::Duration model, update, wait, comm, data;
    CommTimer::Exposed exposed;
    double ce_max_rank = 0;  // WaitForSlowestRank's MAX over the ranks' own mean CE
  };

  // The phases of Step, in order.
  // D, N and each further label stream's D_j (`extra_streams` of them) in the step's one
  // statistics all-reduce.
  absl::StatusOr<losses::StepStats> ComputeStatistics(const std::vector<data::MicroBatch>& batches,
                                                      int extra_streams);
  absl::Status RunMicroBatches(const std::vector<data::MicroBatch>& batches,
                               const losses::StepStats& stats);
  absl::Status FinishReductions();
  absl::StatusOr<double> ClipGradients();  // the global grad norm before clipping
  absl::StatusOr<double> ApplyAdamW();     // the step's lr
  void UpdateExpertBias();
  absl::StatusOr<losses::StepDisplayValues> ReduceDisplay();
  // The step's end: the communication time taken, the wait for the slowest rank, which is
  // a MAX all-reduce of this rank's own mean CE `local_ce` (< 0: none) into
  // times->ce_max_rank.
  absl::Status WaitForSlowestRank(StepTimes* times, double local_ce);
  // This rank's own mean CE of the step (its CE terms over its own weight sum; -1 if it has
  // no valid token), read before ReduceDisplay.
  double LocalMeanCe(const losses::StepStats& stats) const;
  // The record of the step just done (step_ already counts it).
  absl::StatusOr<StepMetrics> MakeRecord(const losses::StepStats& stats,
                                         const losses::StepDisplayValues& display, double grad_norm,
                                         double lr, const StepTimes& times);
  // Step 1 of a fresh run: the dump and the parity check, each agreed on by every rank.
  absl::Status RunFirstStepChecks(const NamedParams& weights, const model::ExpertBias& bias,
                                  const std::vector<data::MicroBatch>& batches,
                                  const StepMetrics& record);

  TrainConfig config_;
  RankComms comms_;
  std::unique_ptr<MoeLm> model_;
  std::unique_ptr<ShardedAdamW> optimizer_;
  std::unique_ptr<data::RankDataLoader> loader_;
  std::shared_ptr<const data::DocumentSource> corpus_;
  // --eval_data's documents (read before the ranks' agreement); nullptr without the file.
  std::shared_ptr<const data::DocumentSource> eval_file_;
  losses::StepDisplay display_;
  int64_t step_ = 0;
  int64_t saved_step_ = -1;  // the step of this run's newest checkpoint (or the resumed one)
  bool fresh_start_ = true;
  std::string run_id_;  // kept in every checkpoint and across --resume
  // What start-up did that the log should say ("resumed from step ...",
  // "--overwrite_checkpoints: removed ..."); Run logs them.
  std::vector<std::string> start_notes_;
  DirLock checkpoint_lock_;            // rank 0: held while the run owns checkpoint.dir
  MetricsFile metrics_;                // rank 0, --metrics: opened at start-up
  std::unique_ptr<RunMeters> meters_;  // FLOPs, MFU, consumed tokens (train/run_metrics.h)
  TfEventsWriter tensorboard_;         // rank 0, --tensorboard_dir: opened at start-up
  std::optional<ParityReport> parity_;
  std::optional<NamedParams> first_step_grads_;
  std::vector<StepMetrics> history_;
  // log.eval_every: this rank's held-out micro-batches and their global statistics.
  std::vector<data::MicroBatch> eval_batches_;
  std::optional<losses::StepStats> eval_stats_;
};

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_TRAINER_H_
