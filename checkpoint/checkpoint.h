#ifndef GRADSUM_CHECKPOINT_CHECKPOINT_H_
#define GRADSUM_CHECKPOINT_CHECKPOINT_H_

// Sharded checkpoints of flat parameter groups and their AdamW state, and a consolidated
// export of the full parameters.
//
//   // every rank, collective over the world:
//   GRADSUM_RETURN_IF_ERROR(SaveCheckpoint("/ckpt/step1000", *world, *opt, {{"data_pos", "42"}}));
//   ... new process, same world size and group layout ...
//   GRADSUM_ASSIGN_OR_RETURN(CheckpointInfo info, LoadCheckpoint("/ckpt/step1000", *world, *opt));
//   // offline, any process: one safetensors file with every full parameter
//   GRADSUM_RETURN_IF_ERROR(ExportConsolidated("/ckpt/step1000", "/export/model.safetensors"));
//
// Loading reshards: a checkpoint written at any world size and group layout loads into
// any other holding the same parameters.
//
// Directory layout (every file written atomically: temp file, fsync, rename, fsync dir):
//   rank-00003.safetensors     this rank's owned slices, f32 [local_numel], as
//                              "<group>/master", "<group>/exp_avg", "<group>/exp_avg_sq"
//                              (padding is never stored)
//   rank-00003.manifest.json   rank, world, step, and per group: name, mode, group_size,
//                              group_rank, numel, padded_numel, shard_offset, local_numel,
//                              params (name, shape, offset); plus the tensor file's
//                              size and 64-bit fingerprint
//   checkpoint.json            the commit marker, written by world rank 0 only after every
//                              rank's files are complete: world, step, per rank the
//                              fingerprints of its manifest and tensor files, extra
//                              metadata (moe_lm puts its config and run id there), and the
//                              marker's own fingerprint over all of that
// Both JSON files are the proto3 JSON of checkpoint/checkpoint.proto (format version 3;
// docs/CHECKPOINTS.md has the details, such as int64 values being JSON strings).
// Fingerprints are XXH3-64 (io/fingerprint.h), written as 16 hex digits.
// A directory without checkpoint.json is an incomplete checkpoint. Saving removes an old
// marker and the temporary files (*.tmp.*) of interrupted saves first, so a save that dies
// half-way never passes for a complete one. A rank file that is not the one the marker
// recorded (copied from another run, or left from another save at the same step) is
// DataLoss naming the rank and the file.

// Both sharding modes store the same owned slices, so a checkpoint saved in one mode
// loads in the other. Resuming is bit-exact: master values, both moments and the step
// count are restored exactly, on the same layout or another.
//
// Errors: a truncated, corrupt or inconsistent file is DataLoss naming the file and the
// problem; a checkpoint of other parameters is FailedPrecondition naming the parameter;
// a missing checkpoint is NotFound.
// Collective calls agree on the outcome (collectives/status_agreement.h): if any rank fails,
// every rank returns the same error, with the code of the lowest failing rank and every
// failing rank's message, instead of some ranks hanging in a collective.

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "core/dtype.h"
#include "optim/adamw.h"

namespace gradsum {

struct CheckpointInfo {
  int64_t step = 0;                          // the optimizer's step() when saved
  int64_t world = 0;                         // the world size that saved it
  std::map<std::string, std::string> extra;  // SaveCheckpoint's `extra`, verbatim
};

// Writes this rank's shards and optimizer state of `optimizer.groups()` into `dir`
// (created if missing, parents must exist). Collective over `world`: every rank calls it
// with the same `dir`; `extra` is taken from world rank 0. FailedPrecondition if a group
// has a collective in flight; file-system errors name the path.
absl::Status SaveCheckpoint(const std::string& dir, Communicator& world,
                            const ShardedAdamW& optimizer,
                            const std::map<std::string, std::string>& extra = {});

// Restores every group of `optimizer.groups()` (master values, exp_avg, exp_avg_sq) and
// the step count from `dir`, zeroes the gradients and drops unsharded compute buffers.
// The checkpoint may come from any world size, group layout (unit names and grouping) and
// sharding mode, as long as it holds exactly the parameters of the groups, by name and
// shape: each rank reads every manifest and, from the rank tensor files, only the byte
// ranges of its owned slices (pread; a file is fingerprinted streaming before its first
// read), so no rank holds a whole file (docs/CHECKPOINTS.md, "Resharding"). A parameter
// missing from the checkpoint, one of another shape, or a saved parameter that no rank's
// groups hold is FailedPrecondition naming it.
// Collective over `world` (replicated groups all-gather their slices over their group).
// On error nothing has been modified on any rank.
absl::StatusOr<CheckpointInfo> LoadCheckpoint(const std::string& dir, Communicator& world,
                                              ShardedAdamW& optimizer);

// The step, saving world size and extra metadata of the checkpoint in `dir`, from its
// commit marker alone (verified against its own fingerprint). Not collective. NotFound
// without a marker; DataLoss for a corrupt one.
absl::StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& dir);

// Removes the temporary files (*.tmp.*) that interrupted saves left in `dir`; returns how
// many. SaveCheckpoint does this itself; a resume calls it for the incomplete saves it skips.
// Only while no save into `dir` is running.
int RemoveStaleTempFiles(const std::string& dir);

// Writes one safetensors file at `out_path` holding each parameter of the checkpoint in
// `dir` with its full, unpadded value and shape, named as in its ParamSpec, in `dtype`
// (kF32 or kBF16, rounded to nearest even), with metadata "step". Each parameter is read
// as LoadCheckpoint reads it (from the byte ranges of the shards holding it, each file
// fingerprinted first). Not collective. Unit names must identify one set of shards across
// the world (FailedPrecondition naming the unit if two ranks hold the same shard or a
// needed shard is missing); a parameter recorded in two places is DataLoss.
absl::Status ExportConsolidated(const std::string& dir, const std::string& out_path,
                                DType dtype = DType::kF32);

}  // namespace gradsum

#endif  // GRADSUM_CHECKPOINT_CHECKPOINT_H_
