#ifndef GRADSUM_TRAIN_CONFIG_H_
#define GRADSUM_TRAIN_CONFIG_H_

// Loading and validating the training configuration (train/config.proto).
//
// A config is a textproto file, then single-field overrides (from absl flags in the
// binary, see train/config_flags.h), then validation. Every bad value is rejected at
// start with InvalidArgument naming the field and the value, never later in training.
//
//   GRADSUM_ASSIGN_OR_RETURN(TrainConfig c, LoadConfigFile("run.textproto"));
//   GRADSUM_RETURN_IF_ERROR(
//       ApplyOverrides({{"model.dim", "32"}, {"parallelism.world", "4"}}, &c));
//   GRADSUM_RETURN_IF_ERROR(ValidateConfig(c));

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "optim/lr_schedule.h"
#include "train/config.pb.h"

namespace gradsum::train {

// Parses textproto `text` (empty text gives all defaults). A syntax error or an unknown
// field is InvalidArgument with the parser's line and column. An enum field reads its word
// bare or quoted (`backend: mpi`, `backend: "mpi"`); an unknown word is InvalidArgument
// naming the field, the word and the allowed words.
//
// Files (and checkpoint markers) written before the config had sections set top-level
// fields (`world: 4 ep: 2 steps: 100`); each is read into its section
// (parallelism.world, parallelism.ep, optim.steps; the table is kLegacyFieldPaths in
// config.cc), so such a file gives the same config as before. A file that sets a field in
// both spellings with different values is InvalidArgument naming both.
absl::StatusOr<TrainConfig> ParseConfigText(absl::string_view text);

// Reads and parses `path`, which must be a regular file of at most 1 MiB. A missing or
// unreadable file (NotFound, PermissionDenied, ...), a directory, FIFO, socket or device
// (InvalidArgument, found by stat(2) before any open, so a FIFO never blocks) or a bigger
// file (OutOfRange) is an error naming "--config=" and the path.
absl::StatusOr<TrainConfig> LoadConfigFile(const std::string& path);

// One override: a dotted field path of TrainConfig ("parallelism.world", "model.dim",
// "optim.lr") and the value as text ("4", "0.5", "true", "bf16").
struct FieldOverride {
  std::string path;
  std::string value;
};

// The fields that decide the data stream and what the parameters are: a resumed run must
// keep them (train/checkpointing.h CheckResumeCompatible). The first of them whose value
// differs between `saved` and `config` (its dotted path and both values as text), or none.
// Without attention on both sides the head layout and the RoPE base decide nothing and are
// not compared.
struct ResumeFieldChange {
  std::string name, saved, now;
};
std::optional<ResumeFieldChange> FirstResumeFieldChange(const TrainConfig& saved,
                                                        const TrainConfig& config);

// Sets each field in order. An unknown path, a path that names a message, or a value
// that does not parse as the field's type (or overflows it) is InvalidArgument naming
// the path and the value; for an enum field ("sharding") also the allowed words
// ("parallelism.sharding=zero: must be fsdp, replicated or hsdp").
absl::Status ApplyOverrides(const std::vector<FieldOverride>& overrides, TrainConfig* config);

// Checks everything that can be checked before any rank starts: positive sizes,
// world % ep == 0 and experts % ep == 0 (SEMANTICS.md §7; the EP size is checked here once,
// and the mesh built from it is the source of the group sizes after), an hsdp shard group
// (shard_group, only with sharding=hsdp) that divides world and is a multiple of ep (0, the
// ranks of one host, is resolved and checked by MakeRankMesh), top_k <= experts,
// vocab == 256 without data.path (the embedded corpora are byte-level; a file's corpus is
// checked against vocab when read, data/corpus.h CheckCorpusVocab), document lengths that fit a
// sequence, optimiser ranges, resume needing a checkpoint directory. Returns the first violation as
// InvalidArgument "field=value: reason", the field as its dotted path
// ("parallelism.ep=3: must divide parallelism.world=4"). Each section is checked on its own
// first (ValidateModel, ValidateData, ... in config.cc), then the checks that relate sections.
absl::Status ValidateConfig(const TrainConfig& config);

// The checks that need a data file's longest document (`longest` tokens of `source`, as the
// message names it), known only once the files are read (ValidateConfig checks the embedded
// corpus's bound): InvalidArgument "field=value: reason" as ValidateConfig's.
absl::Status ValidateLongestDocument(const TrainConfig& config, int64_t longest,
                                     absl::string_view source);

// Every scalar field of `config` as (dotted path, value as text), defaults included, in
// declaration order: what a run actually uses (for comparing the ranks' configs).
std::vector<FieldOverride> ConfigFields(const TrainConfig& config);

// `config` with every field set explicitly, defaults included. Reading a resolved config
// never touches protobuf's lazily built default values, so rank threads can share it.
TrainConfig ResolvedConfig(const TrainConfig& config);

// The global batch B = world x grad_acc x micro_batch: sequences per step (data/loader.h).
int64_t GlobalBatch(const TrainConfig& config);

// Whether the run reads data files (data.path, --data, or data.data_path, --data_path) rather
// than an embedded corpus.
bool ReadsDataFiles(const DataConfig& data);

// Reproducible mode's row block (SEMANTICS.md §11, §12, §16): precision.repro_block when
// set, else DefaultReproBlock(data.seq_len). A function of the sequence length, not of the
// mesh, so runs at different SP and CP sizes compute every contribution over the same
// blocks and give the same bits (ValidateConfig refuses a mesh whose pieces it does not
// tile).
int64_t ReproBlock(const TrainConfig& config);

// The default row block: the largest divisor of seq_len that is at most seq_len / 4 (at
// least 1): seq_len / 4 whenever 4 divides it. It tiles the pieces of SP sizes up to 4
// without CP (every SP the default 4 heads permit) and of CP 2 with SP up to 2; deeper
// meshes are refused, naming a smaller block. Not smaller, because reproducible mode adds
// every block's weight-gradient contribution exactly, so its cost grows with the number of
// blocks (docs/BENCHMARKS.md: a step at seq_len / 8 took 1.1x-1.9x one at seq_len / 4).
int64_t DefaultReproBlock(int64_t seq_len);

// Every setting of `config` that differs from its default, as the command-line flags that
// give it ("--world=4 --sp=2 --resume"), in config.proto's order; empty for the defaults.
// Generated from the fields' (flag) options, so a new option appears in the banner
// (train/rank_main.h PrintBanner) without a line of its own.
std::string NonDefaultFlags(const TrainConfig& config);

// The learning-rate schedule of the optim section (optim/lr_schedule.h): the decay ends at
// decay_steps, or at steps when decay_steps is 0. ValidateConfig checks its ends by name.
optim::LrSchedule ToLrSchedule(const OptimConfig& optim);

// The config as one-line textproto with every field written out, defaults included
// (for logs, losses.json and checkpoints); ParseConfigText reads it back.
std::string ConfigToShortText(const TrainConfig& config);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_CONFIG_H_
