#ifndef GRADSUM_TRAIN_CHECKPOINTING_H_
#define GRADSUM_TRAIN_CHECKPOINTING_H_

// The checkpoints of a training run (docs/CHECKPOINTS.md): where they live in
// checkpoint.dir, what a save records besides the parameters and the optimizer state
// (checkpoint/checkpoint.h), and resuming.
//
//   checkpoint.dir/step-NNNNNNNN/   one save; complete once it has its commit marker
//   checkpoint.dir/moe_lm.lock      the lock of the run that owns the directory
//
// A run owns its checkpoint directory (TakeCheckpointDir): rank 0 holds the lock file's
// flock for the run's life (io/dir_lock.h; the kernel drops it when the process ends), so a
// second run on the directory is refused at start-up naming the holder's pid and host; and
// a fresh run into a directory with another run's checkpoints is refused naming that run,
// unless checkpoint.overwrite removes them first (a resume continues the run instead).
//
// The marker's `extra` holds the run's record: "config" (ConfigToShortText of the config
// that wrote it), "run_id" (drawn by a fresh run, kept by every resume), and the data
// stream's position ("data_next_document", "data_sequences"; data/packer.h DataPosition),
// and, when the model holds one, the expert bias of SEMANTICS.md §5.1 ("expert_bias": the
// layers' values joined by ';', each layer's E values by ',', printed with 9 significant
// digits so that every fp32 value reads back exactly). The bias is the same on every rank,
// so any mesh reads it whole; a marker without it (older, or a run without the bias)
// restores none.
// A resume reads the saved config first and refuses, naming both values, another model,
// another data stream or another global batch; everything else (the mesh, sharding, unit
// grouping, backend, dtypes, optimizer settings) may change. A marker written before the
// config had sections holds the old layout, which ParseConfigText still reads.
//
//   if (config.checkpoint().resume()) {
//     GRADSUM_ASSIGN_OR_RETURN(ResumedRun run, ResumeRun(config, world, optimizer, loader));
//   }
//   ...
//   GRADSUM_RETURN_IF_ERROR(SaveRunCheckpoint(config, world, optimizer, step, run_id,
//                                             loader.position()));

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "data/loader.h"
#include "data/packer.h"
#include "io/dir_lock.h"
#include "optim/adamw.h"
#include "train/config.pb.h"

namespace gradsum::train {

// The lock file in checkpoint.dir that makes a run its owner.
inline constexpr char kCheckpointLockFile[] = "moe_lm.lock";

// A checkpoint directory taken by this run: its lock, and what was done to take it.
struct OwnedCheckpointDir {
  DirLock lock;      // held until this goes
  std::string note;  // "--overwrite_checkpoints: removed ..." when it removed something
};

// Rank 0's start-up work on `config.dir` (which must exist), before anything reads or
// writes in it: takes its lock, FailedPrecondition "--checkpoint_dir=D is in use by another
// run: held by pid P on host H since T ..." if another process holds it; then, unless
// `config.resume()`, looks for complete checkpoints: FailedPrecondition naming the run id
// of the newest and the steps there, or with `config.overwrite()` removes every
// step-NNNNNNNN directory (complete or not) and says so in the note. A read-only file
// system, a missing permission or a file system without locks: the errno status naming the
// lock file. Rank-local; the caller agrees on the outcome.
absl::StatusOr<OwnedCheckpointDir> TakeCheckpointDir(const CheckpointConfig& config);

// The directory of the checkpoint after `step` inside `checkpoint_dir`.
std::string CheckpointPath(const std::string& checkpoint_dir, int64_t step);

// The step of the newest complete checkpoint in `checkpoint_dir` (one with its commit
// marker), or NotFound.
absl::StatusOr<int64_t> LatestCheckpointStep(const std::string& checkpoint_dir);

// Steps after `step` whose directories in `checkpoint_dir` have no commit marker (saves
// interrupted before they committed), ascending.
std::vector<int64_t> IncompleteCheckpointsAfter(const std::string& checkpoint_dir, int64_t step);

// A fresh run's id (16 hex digits): drawn on rank 0, the same on every rank. Collective.
absl::StatusOr<std::string> NewRunId(Communicator& world);

// FailedPrecondition naming the first setting that differs between `saved` (the config in
// the marker of the checkpoint of `step`) and `config` among those that decide the data
// stream (data.*, the global batch) and the model (model.* but init_std and seed).
absl::Status CheckResumeCompatible(const TrainConfig& saved, const TrainConfig& config,
                                   int64_t step);

// The expert bias [L][E] as the commit marker holds it, and back. ParseExpertBias:
// DataLoss naming the text's problem (a value that does not parse or is not finite, or
// layers of different sizes).
std::string ExpertBiasText(const std::vector<std::vector<float>>& bias);
absl::StatusOr<std::vector<std::vector<float>>> ParseExpertBias(const std::string& text);

// Saves the optimizer's state after `step` into CheckpointPath(config.checkpoint().dir(),
// step) with the run's record (the config, `run_id`, the data `position`, the model's
// `expert_bias` unless empty, and the data files' `data_fingerprint` unless 0: the corpus's
// ContentFingerprint, "data_fingerprint" in the marker). Collective.
absl::Status SaveRunCheckpoint(const TrainConfig& config, Communicator& world,
                               const ShardedAdamW& optimizer, int64_t step,
                               const std::string& run_id, const data::DataPosition& position,
                               const std::vector<std::vector<float>>& expert_bias = {},
                               uint64_t data_fingerprint = 0);

// checkpoint.keep > 0: removes the complete checkpoints of checkpoint.dir older than the
// newest `keep` (rank 0; each one's commit marker first, so a removal cut short leaves an
// incomplete save, which resume skips, never a marker over missing files). Call it after a
// save committed. Collective: every rank gets rank 0's outcome (an error names the path).
absl::Status PruneCheckpoints(const CheckpointConfig& config, Communicator& world);

// What a resume continues.
struct ResumedRun {
  int64_t step = 0;    // steps done
  std::string run_id;  // the run's id, kept
  // "resumed from step S of run R in DIR", with the incomplete newer saves it skipped, the
  // mesh it was resharded from, the fields taken from the checkpoint and the settings that
  // changed since, if any: the line Trainer::Run logs.
  std::string note;
  // The run's config from now on: the one given, with the fields the checkpoint fixes
  // (kCheckpointFixedFields) taken from the saved config.
  TrainConfig config;
  // The model's expert bias after `step` (SEMANTICS.md §5.1), [L][E]; empty when the
  // checkpoint holds none.
  std::vector<std::vector<float>> expert_bias;
};

// The fields that only decide the initial parameters, which a resume takes from the
// checkpoint along with the parameters: a resumed run uses the saved values (its log says
// so when the command line gave others), and records them in its own checkpoints. The
// model's shape and the data stream are fixed too, but must match (CheckResumeCompatible).
inline constexpr const char* kCheckpointFixedFields[] = {"model.seed", "model.init_std"};

// Resumes from the latest complete checkpoint in config.checkpoint().dir(): rank 0 picks
// it, every rank checks the saved config (CheckResumeCompatible), takes the fields the
// checkpoint fixes from it (kCheckpointFixedFields), loads the parameters and
// both AdamW moments into `optimizer` on this mesh (resharding), and seeks `loader` to the
// recorded data position (DataLoss if it is not the end of `step` steps of the global
// batch; a checkpoint without a position replays the stream), and reads the expert bias
// (DataLoss if it does not parse or does not fit the model's layers and experts). Rank 0
// removes the temporary files of newer saves that never committed. A checkpoint that
// recorded a data fingerprint other than `data_fingerprint` (the data files changed since)
// is refused (FailedPrecondition naming both). Collective; every rank returns the same error.
absl::StatusOr<ResumedRun> ResumeRun(const TrainConfig& config, Communicator& world,
                                     ShardedAdamW& optimizer, data::RankDataLoader& loader,
                                     uint64_t data_fingerprint = 0);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_CHECKPOINTING_H_
