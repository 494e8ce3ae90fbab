#include "train/checkpointing.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "collectives/status_agreement.h"
#include "core/status.h"
#include "io/atomic_file.h"
#include "train/config.h"

namespace gradsum::train {
namespace {

namespace fs = std::filesystem;

// The commit marker's record of the run (SaveRunCheckpoint).
constexpr char kConfig[] = "config";
constexpr char kRunId[] = "run_id";
constexpr char kDataNextDocument[] = "data_next_document";
constexpr char kDataSequences[] = "data_sequences";
// The data files' ContentFingerprint (hex), so that a resume on changed files is refused.
constexpr char kDataFingerprint[] = "data_fingerprint";
constexpr char kExpertBias[] = "expert_bias";

// The step-NNNNNNNN directories of checkpoint_dir: (step, whether its save completed, i.e.
// it has its commit marker).
std::vector<std::pair<int64_t, bool>> CheckpointSteps(const std::string& checkpoint_dir) {
  std::error_code ec;
  std::vector<std::pair<int64_t, bool>> out;
  for (const fs::directory_entry& e : fs::directory_iterator(checkpoint_dir, ec)) {
    const std::string name = e.path().filename().string();
    int64_t step;
    if (name.rfind("step-", 0) != 0 || !absl::SimpleAtoi(name.substr(5), &step)) continue;
    out.emplace_back(step, fs::exists(e.path() / "checkpoint.json"));
  }
  return out;
}

// The saved config of the checkpoint of `step`: FailedPrecondition if the marker has none
// (nothing shows that it continues this run), DataLoss if it does not parse.
absl::StatusOr<TrainConfig> SavedConfig(const CheckpointInfo& info, int64_t step,
                                        const std::string& checkpoint_dir) {
  auto it = info.extra.find(kConfig);
  if (it == info.extra.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--resume: the checkpoint of step ", step, " in ", checkpoint_dir,
        " has no \"config\" in its commit marker, so nothing shows that it continues this "
        "run's data stream and model; refusing it"));
  }
  absl::StatusOr<TrainConfig> parsed = ParseConfigText(it->second);
  if (!parsed.ok()) {
    return absl::DataLossError(
        absl::StrCat("--resume: the checkpoint of step ", step,
                     ": its saved config does not parse: ", parsed.status().message()));
  }
  // Every save writes each field (ConfigToShortText resolves the defaults), so a field
  // missing from a marker predates it: the run had what the field now names explicitly,
  // not today's default (the per-token model on the first-order corpus).
  if (!parsed->model().has_attention()) parsed->mutable_model()->set_attention(ModelConfig::none);
  if (!parsed->data().has_corpus()) parsed->mutable_data()->set_corpus(DataConfig::markov1);
  return parsed;
}

// Seeks `loader` to the position the checkpoint recorded (DataLoss if it is not the end of
// `step` steps of the global batch), or replays `step` steps if it has none.
absl::Status RestoreDataPosition(const CheckpointInfo& info, const std::string& dir,
                                 const TrainConfig& config, int64_t step,
                                 data::RankDataLoader& loader) {
  auto next = info.extra.find(kDataNextDocument);
  auto sequences = info.extra.find(kDataSequences);
  if (next == info.extra.end() || sequences == info.extra.end()) {
    // A checkpoint from before the position was recorded: replay the stream.
    loader.SkipSteps(step, config.parallelism().grad_acc());
    return absl::OkStatus();
  }
  data::DataPosition position;
  if (!absl::SimpleAtoi(next->second, &position.next_document) ||
      !absl::SimpleAtoi(sequences->second, &position.sequences) ||
      position.sequences != step * GlobalBatch(config)) {
    return absl::DataLossError(absl::StrCat(
        "--resume: the checkpoint ", dir, " records the data position ", kDataNextDocument, "=",
        next->second, ", ", kDataSequences, "=", sequences->second, ", which is not the end of ",
        step, " steps of ", GlobalBatch(config), " sequences"));
  }
  return loader.Seek(position);
}

// The fields of `saved` that the checkpoint fixes (kCheckpointFixedFields) set in `config`;
// returns "model.seed=1 (this run gave 9)" for each that differed, joined, or "".
std::string TakeFixedFields(const TrainConfig& saved, TrainConfig* config) {
  std::vector<FieldOverride> taken;
  std::vector<std::string> differed;
  const std::vector<FieldOverride> mine = ConfigFields(*config);
  for (const FieldOverride& f : ConfigFields(saved)) {
    if (std::find(std::begin(kCheckpointFixedFields), std::end(kCheckpointFixedFields), f.path) ==
        std::end(kCheckpointFixedFields)) {
      continue;
    }
    auto it = std::find_if(mine.begin(), mine.end(),
                           [&](const FieldOverride& m) { return m.path == f.path; });
    if (it == mine.end() || it->value == f.value) continue;
    differed.push_back(absl::StrCat(f.path, "=", f.value, " (this run gave ", it->value, ")"));
    taken.push_back(f);
  }
  // Values printed from a config of the same type parse back.
  if (!ApplyOverrides(taken, config).ok()) return "";
  return absl::StrJoin(differed, ", ");
}

// "optim.lr 0.01 -> 0.003, ..." for the settings of the optimizer, the loss and the
// precision (what shapes the training from here on) that differ from the checkpoint's, but
// the step count, which a resume is for.
std::string ChangedSettings(const TrainConfig& saved, const TrainConfig& config) {
  const std::vector<FieldOverride> now = ConfigFields(config);
  std::vector<std::string> changed;
  for (const FieldOverride& f : ConfigFields(saved)) {
    const bool shapes_training = absl::StartsWith(f.path, "optim.") ||
                                 absl::StartsWith(f.path, "loss.") ||
                                 absl::StartsWith(f.path, "precision.");
    if (!shapes_training || f.path == "optim.steps") continue;
    auto it = std::find_if(now.begin(), now.end(),
                           [&](const FieldOverride& n) { return n.path == f.path; });
    if (it != now.end() && it->value != f.value) {
      changed.push_back(absl::StrCat(f.path, " ", f.value, " -> ", it->value));
    }
  }
  return absl::StrJoin(changed, ", ");
}

// A resume line's words for a learning-rate schedule that differs from the checkpoint's at
// the step the run continues from (empty when it does not): under a decay that ends at
// optim.steps (decay_steps 0) more steps move the rest of the curve, and the lr can jump
// back up. ChangedSettings names lr, min_lr, ... but not optim.steps, which a resume
// changes all the time without consequence under the constant schedule.
std::string ScheduleChange(const OptimConfig& saved, const OptimConfig& now, int64_t step) {
  const double before = optim::LearningRate(ToLrSchedule(saved), step);
  const double after = optim::LearningRate(ToLrSchedule(now), step);
  if (before == after) return "";
  std::string why;
  if (saved.steps() != now.steps() && now.lr_decay() != OptimConfig::constant &&
      now.decay_steps() == 0) {
    why = absl::StrCat(" (optim.steps ", saved.steps(), " -> ", now.steps(),
                       " under optim.lr_decay=", OptimConfig::LrDecay_Name(now.lr_decay()),
                       ", which decays to optim.min_lr at optim.steps)");
  }
  return absl::StrCat("the learning-rate schedule changed", why, ": step ", step + 1, "'s lr is ",
                      after, ", the checkpoint's schedule gave ", before);
}

// The mesh a resume line names: "world=2 ep=2 grad_acc=2 sharding=fsdp layers_per_unit=1".
std::string MeshText(const TrainConfig& c) {
  const ParallelismConfig& p = c.parallelism();
  return absl::StrCat("world=", p.world(), " ep=", p.ep(), " grad_acc=", p.grad_acc(),
                      " sharding=", TrainConfig::Sharding_Name(p.sharding()),
                      p.sharding() == TrainConfig::hsdp
                          ? absl::StrCat(" shard_group=", p.shard_group())
                          : std::string(),
                      " layers_per_unit=", p.layers_per_unit());
}

}  // namespace

absl::StatusOr<OwnedCheckpointDir> TakeCheckpointDir(const CheckpointConfig& config) {
  const std::string& dir = config.dir();
  const std::string name = absl::StrCat("--checkpoint_dir=", dir);
  OwnedCheckpointDir owned;
  absl::StatusOr<DirLock> lock = DirLock::Acquire(dir, kCheckpointLockFile);
  if (lock.status().code() == absl::StatusCode::kFailedPrecondition) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, " is in use by another run: ", lock.status().message(),
                     "; wait for that run to end, or choose another --checkpoint_dir"));
  }
  if (!lock.ok()) return Annotate(lock.status(), name);
  owned.lock = *std::move(lock);
  if (config.resume()) return owned;  // it continues the run whose checkpoints are there

  std::vector<int64_t> complete, incomplete;
  for (const auto& [step, done] : CheckpointSteps(dir)) {
    (done ? complete : incomplete).push_back(step);
  }
  std::sort(complete.begin(), complete.end());
  if (complete.empty() && (incomplete.empty() || !config.overwrite())) return owned;
  std::string run, steps;
  if (!complete.empty()) {
    const int64_t newest = complete.back();
    absl::StatusOr<CheckpointInfo> info = ReadCheckpointInfo(CheckpointPath(dir, newest));
    if (!info.ok()) {
      run = absl::StrCat("a run whose newest commit marker does not read (",
                         info.status().message(), ")");
    } else {
      auto id = info->extra.find(kRunId);
      run = id == info->extra.end() || id->second.empty() ? "a run without a run id"
                                                          : absl::StrCat("run ", id->second);
    }
    steps = complete.size() == 1 ? absl::StrCat("step ", newest)
                                 : absl::StrCat(complete.size(), " checkpoints, steps ",
                                                complete.front(), " to ", newest);
  }
  if (!config.overwrite()) {
    return absl::FailedPreconditionError(absl::StrCat(
        name, " holds the checkpoints of ", run, " (", steps,
        "); --resume continues that run, --overwrite_checkpoints replaces it (removing its "
        "checkpoints first), or choose another --checkpoint_dir"));
  }
  std::vector<int64_t> all = complete;
  all.insert(all.end(), incomplete.begin(), incomplete.end());
  for (int64_t step : all) {
    std::error_code ec;
    fs::remove_all(CheckpointPath(dir, step), ec);
    if (ec) {
      return ErrnoStatus(ec.value(), absl::StrCat(name, ": --overwrite_checkpoints: cannot remove ",
                                                  CheckpointPath(dir, step)));
    }
  }
  owned.note = absl::StrCat("--overwrite_checkpoints: removed from ", dir, " ");
  if (!complete.empty()) absl::StrAppend(&owned.note, "the checkpoints of ", run, " (", steps, ")");
  if (!incomplete.empty()) {
    absl::StrAppend(&owned.note, complete.empty() ? "" : " and ", incomplete.size(),
                    " incomplete save(s)");
  }
  return owned;
}

std::string CheckpointPath(const std::string& checkpoint_dir, int64_t step) {
  return absl::StrFormat("%s/step-%08d", checkpoint_dir, step);
}

absl::StatusOr<int64_t> LatestCheckpointStep(const std::string& checkpoint_dir) {
  int64_t best = -1;
  for (const auto& [step, complete] : CheckpointSteps(checkpoint_dir)) {
    if (complete) best = std::max(best, step);  // an incomplete save does not count
  }
  if (best < 0) {
    return absl::NotFoundError(
        absl::StrCat("--resume: no complete checkpoint in checkpoint_dir=", checkpoint_dir));
  }
  return best;
}

std::vector<int64_t> IncompleteCheckpointsAfter(const std::string& checkpoint_dir, int64_t step) {
  std::vector<int64_t> out;
  for (const auto& [s, complete] : CheckpointSteps(checkpoint_dir)) {
    if (s > step && !complete) out.push_back(s);
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<std::string> NewRunId(Communicator& world) {
  uint64_t id = 0;
  if (world.rank() == 0) {
    std::random_device rd;
    id = (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  }
  GRADSUM_RETURN_IF_ERROR(world.Broadcast(&id, 1, DType::kI64, 0));
  return absl::StrFormat("%016x", id);
}

absl::Status CheckResumeCompatible(const TrainConfig& saved, const TrainConfig& config,
                                   int64_t step) {
  // What decides the data stream and what the parameters are (FirstResumeFieldChange). The
  // mesh (world, ep, G, micro_batch), the sharding mode and the unit grouping may change as
  // long as the global batch B = world x grad_acc x micro_batch stays (the stream is global,
  // RankDataLoader; LoadCheckpoint reshards); so may the optimizer settings, step count,
  // logging, dtypes, CE weighting and backend.
  auto batch_text = [](const TrainConfig& c) {
    return absl::StrCat(GlobalBatch(c),
                        " (world x grad_acc x micro_batch = ", c.parallelism().world(), " x ",
                        c.parallelism().grad_acc(), " x ", c.data().micro_batch(), ")");
  };
  if (GlobalBatch(saved) != GlobalBatch(config)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--resume: the checkpoint of step ", step, " was written with global batch B=",
                     batch_text(saved), " but this run has global batch B=", batch_text(config),
                     "; the data stream continues only with the same B (choose world, grad_acc and "
                     "micro_batch with that product, or start a new checkpoint_dir)"));
  }
  if (const std::optional<ResumeFieldChange> change = FirstResumeFieldChange(saved, config)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--resume: the checkpoint of step ", step, " was written with ", change->name,
                     "=", change->saved, " but this run has ", change->name, "=", change->now,
                     "; resuming would continue a different data stream or model (start a new "
                     "checkpoint_dir, or resume with the saved value)"));
  }
  return absl::OkStatus();
}

std::string ExpertBiasText(const std::vector<std::vector<float>>& bias) {
  std::vector<std::string> layers;
  for (const std::vector<float>& layer : bias) {
    layers.push_back(absl::StrJoin(layer, ",", [](std::string* out, float v) {
      absl::StrAppendFormat(out, "%.9g", v);  // 9 digits: every float reads back exactly
    }));
  }
  return absl::StrJoin(layers, ";");
}

absl::StatusOr<std::vector<std::vector<float>>> ParseExpertBias(const std::string& text) {
  std::vector<std::vector<float>> bias;
  if (text.empty()) return bias;
  for (absl::string_view layer : absl::StrSplit(text, ';')) {
    std::vector<float>& values = bias.emplace_back();
    for (absl::string_view word : absl::StrSplit(layer, ',')) {
      float v;
      if (!absl::SimpleAtof(word, &v) || !std::isfinite(v)) {
        return absl::DataLossError(absl::StrCat("expert bias of layer ", bias.size() - 1, ": \"",
                                                word, "\" is not a finite number"));
      }
      values.push_back(v);
    }
    if (values.size() != bias.front().size()) {
      return absl::DataLossError(absl::StrCat("expert bias of layer ", bias.size() - 1, " has ",
                                              values.size(), " values, layer 0 has ",
                                              bias.front().size()));
    }
  }
  return bias;
}

absl::Status SaveRunCheckpoint(const TrainConfig& config, Communicator& world,
                               const ShardedAdamW& optimizer, int64_t step,
                               const std::string& run_id, const data::DataPosition& position,
                               const std::vector<std::vector<float>>& expert_bias,
                               uint64_t data_fingerprint) {
  std::map<std::string, std::string> extra = {
      {kConfig, ConfigToShortText(config)},
      {kRunId, run_id},
      {kDataNextDocument, absl::StrCat(position.next_document)},
      {kDataSequences, absl::StrCat(position.sequences)}};
  if (!expert_bias.empty()) extra[kExpertBias] = ExpertBiasText(expert_bias);
  // Only for data files: the embedded corpora's markers stay as they were.
  if (data_fingerprint != 0) extra[kDataFingerprint] = absl::StrCat(absl::Hex(data_fingerprint));
  return SaveCheckpoint(CheckpointPath(config.checkpoint().dir(), step), world, optimizer, extra);
}

absl::Status PruneCheckpoints(const CheckpointConfig& config, Communicator& world) {
  if (config.keep() <= 0 || config.dir().empty()) return absl::OkStatus();
  absl::Status local = absl::OkStatus();
  if (world.rank() == 0) {
    std::vector<int64_t> complete;
    for (const auto& [step, done] : CheckpointSteps(config.dir())) {
      if (done) complete.push_back(step);
    }
    std::sort(complete.begin(), complete.end(), std::greater<int64_t>());
    for (size_t i = config.keep(); i < complete.size() && local.ok(); ++i) {
      const std::string dir = CheckpointPath(config.dir(), complete[i]);
      std::error_code ec;
      fs::remove(fs::path(dir) / "checkpoint.json", ec);
      if (!ec) fs::remove_all(dir, ec);
      if (ec) {
        local = ErrnoStatus(ec.value(), absl::StrCat("checkpoint.keep=", config.keep(),
                                                     ": cannot remove the old checkpoint ", dir));
      }
    }
  }
  return AgreeOnStatus(world, local, "checkpoint.keep");
}

absl::StatusOr<ResumedRun> ResumeRun(const TrainConfig& config, Communicator& world,
                                     ShardedAdamW& optimizer, data::RankDataLoader& loader,
                                     uint64_t data_fingerprint) {
  const std::string& checkpoint_dir = config.checkpoint().dir();
  // Every rank must pick the same checkpoint: rank 0 decides, the others follow.
  int64_t step = -1;
  absl::Status found = absl::OkStatus();
  if (world.rank() == 0) {
    absl::StatusOr<int64_t> latest = LatestCheckpointStep(checkpoint_dir);
    if (latest.ok()) step = *latest;
    found = latest.status();
  }
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, found, "--resume"));
  GRADSUM_RETURN_IF_ERROR(world.Broadcast(&step, 1, DType::kI64, 0));
  const std::string dir = CheckpointPath(checkpoint_dir, step);
  // The saved config first, so that another model or global batch is refused by name
  // before any parameter is read.
  absl::StatusOr<CheckpointInfo> marker = ReadCheckpointInfo(dir);
  absl::StatusOr<TrainConfig> saved =
      marker.ok() ? SavedConfig(*marker, step, checkpoint_dir) : marker.status();
  absl::Status compatible = saved.status();
  if (compatible.ok()) compatible = CheckResumeCompatible(*saved, config, step);
  // A checkpoint of a data-file run records its files' fingerprint (older ones do not).
  const std::string* recorded = nullptr;
  if (compatible.ok()) {
    auto it = marker->extra.find(kDataFingerprint);
    if (it != marker->extra.end()) recorded = &it->second;
  }
  if (recorded != nullptr && *recorded != absl::StrCat(absl::Hex(data_fingerprint))) {
    compatible = absl::FailedPreconditionError(absl::StrCat(
        "--resume: the data changed since the checkpoint of step ", step, ": the content of ",
        config.data().data_path().empty() ? absl::StrCat("--data=", config.data().path())
                                          : absl::StrCat("--data_path=", config.data().data_path()),
        " now has fingerprint ", absl::Hex(data_fingerprint), ", the checkpoint recorded ",
        *recorded,
        " (docs/CHECKPOINTS.md); its data position means nothing in other data: restore the "
        "files or start a new checkpoint_dir"));
  }
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, compatible, "--resume"));
  GRADSUM_ASSIGN_OR_RETURN(CheckpointInfo info, LoadCheckpoint(dir, world, optimizer));
  auto run_id = info.extra.find(kRunId);
  if (run_id == info.extra.end() || run_id->second.empty()) {
    return MarkAgreed(absl::FailedPreconditionError(
        absl::StrCat("--resume: the checkpoint ", dir, " has no run_id in its commit marker")));
  }
  ResumedRun run;
  run.step = info.step;
  run.run_id = run_id->second;
  run.note = absl::StrCat("resumed from step ", info.step, " of run ", run.run_id, " in ", dir);
  run.config = config;
  const std::string taken = TakeFixedFields(*saved, &run.config);
  if (world.rank() == 0) {
    const std::vector<int64_t> skipped = IncompleteCheckpointsAfter(checkpoint_dir, step);
    int removed = 0;
    for (int64_t s : skipped) removed += RemoveStaleTempFiles(CheckpointPath(checkpoint_dir, s));
    if (!skipped.empty()) {
      absl::StrAppend(&run.note, " (skipped ", skipped.size(),
                      " incomplete newer save(s), the newest step ", skipped.back(),
                      ": interrupted before its commit marker; removed ", removed,
                      " temporary file(s))");
    }
  }
  GRADSUM_RETURN_IF_ERROR(MarkAgreed(RestoreDataPosition(info, dir, config, run.step, loader)));
  // §5.1's bias: replicated, so every rank reads the same text whole, whatever the mesh.
  bool bias_dropped = false;
  if (auto bias = info.extra.find(kExpertBias); bias != info.extra.end()) {
    absl::StatusOr<std::vector<std::vector<float>>> parsed = ParseExpertBias(bias->second);
    const ModelConfig& m = config.model();
    if (parsed.ok() && !parsed->empty() &&
        (static_cast<int>(parsed->size()) != m.layers() ||
         static_cast<int>(parsed->front().size()) != m.experts())) {
      parsed = absl::DataLossError(absl::StrCat("it holds ", parsed->size(), " layers of ",
                                                parsed->front().size(), " experts, the model ",
                                                m.layers(), " of ", m.experts()));
    }
    if (!parsed.ok()) {
      return MarkAgreed(
          absl::DataLossError(absl::StrCat("--resume: the expert bias in the commit marker of ",
                                           dir, ": ", parsed.status().message())));
    }
    if (config.loss().expert_bias_speed() == 0 && !parsed->empty()) {
      // u = 0 is off (SEMANTICS.md §5.1): no bias is held and routing is §10's, so the
      // checkpoint's bias is not used to choose experts (nor saved again).
      bias_dropped = true;
    } else {
      run.expert_bias = *std::move(parsed);
    }
  }
  if (MeshText(*saved) != MeshText(config)) {
    absl::StrAppend(&run.note, "; resharded from ", MeshText(*saved), " to ", MeshText(config));
  }
  if (!taken.empty()) {
    absl::StrAppend(&run.note,
                    "; taken from the checkpoint, which holds the parameters they "
                    "initialised: ",
                    taken);
  }
  if (const std::string changed = ChangedSettings(*saved, config); !changed.empty()) {
    absl::StrAppend(&run.note, "; changed since the checkpoint: ", changed);
  }
  if (const std::string schedule = ScheduleChange(saved->optim(), config.optim(), run.step);
      !schedule.empty()) {
    absl::StrAppend(&run.note, "; ", schedule);
  }
  if (bias_dropped) {
    absl::StrAppend(&run.note,
                    "; the checkpoint's expert bias is dropped: loss.expert_bias_speed=0 routes "
                    "without one (SEMANTICS.md §5.1)");
  }
  return run;
}

}  // namespace gradsum::train
