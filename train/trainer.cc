#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "collectives/status_agreement.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "io/atomic_file.h"
#include "io/proto_json.h"
#include "io/safetensors.h"
#include "losses/step_stats.h"
#include "sharding/checkpoint.h"
#include "sharding/grad_norm.h"
#include "train/config.h"
#include "train/config_agreement.h"
#include "train/fault_injection.h"
#include "train/metrics.pb.h"
#include "train/metrics_file.h"

namespace gradsum::train {
namespace {

namespace fs = std::filesystem;

// The commit marker's record of the data stream's position (RankDataLoader::position).
constexpr char kDataNextDocument[] = "data_next_document";
constexpr char kDataSequences[] = "data_sequences";

// The config's choices as the types of the code that implements them.
DType ToDType(TrainConfig::FloatDType d) {
  return d == TrainConfig::bf16 ? DType::kBF16 : DType::kF32;
}
ShardingMode ToShardingMode(TrainConfig::Sharding s) {
  return s == TrainConfig::fsdp ? ShardingMode::kSharded : ShardingMode::kReplicated;
}
losses::CeWeightMode ToCeWeightMode(TrainConfig::CeMode m) {
  switch (m) {
    case TrainConfig::sample: return losses::CeWeightMode::kSample;
    case TrainConfig::square: return losses::CeWeightMode::kSquare;
    case TrainConfig::token: break;
  }
  return losses::CeWeightMode::kToken;
}

std::string HumanRate(double per_second) {
  if (per_second >= 1e6) return absl::StrFormat("%.2fM", per_second / 1e6);
  if (per_second >= 1e3) return absl::StrFormat("%.1fk", per_second / 1e3);
  return absl::StrFormat("%.0f", per_second);
}

// The median of `v` (the mean of the middle two for an even count); -1 when empty.
double Median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

absl::Status WriteParamsFile(const std::string& path, const ModelConfig& model,
                             const NamedParams& params, int64_t step) {
  SafetensorsWriter w;
  for (const auto& [name, shape] : MoeLmParamShapes(model)) {
    GRADSUM_ASSIGN_OR_RETURN(
        TensorView view,
        TensorView::Create(const_cast<float*>(params.at(name).data()), DType::kF32, shape));
    GRADSUM_RETURN_IF_ERROR(w.Add(name, view));
  }
  GRADSUM_RETURN_IF_ERROR(w.AddMetadata("step", absl::StrCat(step)));
  return w.WriteFile(path);
}

absl::StatusOr<NamedParams> ReadParamsFile(const std::string& path, const ModelConfig& model) {
  const std::string what = absl::StrCat("--init_from=", path);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(path);
  if (!file.ok()) return Annotate(file.status(), what);
  const auto shapes = MoeLmParamShapes(model);
  std::set<std::string> expected;
  NamedParams params;
  for (const auto& [name, shape] : shapes) {
    expected.insert(name);
    absl::StatusOr<TensorView> t = file->Get(name);
    if (!t.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": no tensor \"", name,
                                                     "\", which this model needs with shape [",
                                                     absl::StrJoin(shape, ","), "]"));
    }
    if (t->dtype() != DType::kF32 || t->shape() != shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": tensor \"", name, "\" is ", t->DebugString(), ", this model needs f32[",
          absl::StrJoin(shape, ","), "]"));
    }
    params[name].assign(t->data<float>(), t->data<float>() + t->numel());
  }
  for (const std::string& name : file->names()) {
    if (expected.count(name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": tensor \"", name, "\" is not a parameter of this model"));
    }
  }
  return params;
}

std::string StepRecord::ToLogLine(int64_t total_steps) const {
  const double exposed_pct =
      step_seconds > 0 ? 100.0 * comm_exposed_seconds / step_seconds : 0.0;
  return absl::StrFormat(
      "step %*d/%d | ce %.4f | bal %.6f | z %.6f | valid %d | gnorm %.4f | lr %.2e | "
      "%s tok/s | comm %.1f ms, exposed %.1f ms (%.0f%%) | wait %.1f ms | params %.0f%%",
      static_cast<int>(absl::StrCat(total_steps).size()), step, total_steps, ce, bal, z,
      valid_tokens, grad_norm, lr, HumanRate(tokens_per_second), comm_seconds * 1e3,
      comm_exposed_seconds * 1e3, exposed_pct, wait_seconds * 1e3,
      full_param_bytes > 0 ? 100.0 * peak_unsharded_param_bytes / full_param_bytes : 0.0);
}

absl::StatusOr<std::string> StepRecord::ToJson() const {
  StepMetrics j;
  j.set_step(static_cast<int32_t>(step));  // <= TrainConfig.steps, an int32
  j.set_ce(ce);
  j.set_z(z);
  j.set_bal(bal);
  j.set_loss(loss);
  j.set_valid_tokens(valid_tokens);
  j.set_routed_tokens(routed_tokens);
  j.set_grad_norm(grad_norm);
  j.set_lr(lr);
  for (double v : maxvio) j.add_maxvio(v);
  j.set_step_s(step_seconds);
  j.set_comm_s(comm_seconds);
  j.set_comm_exposed_s(comm_exposed_seconds);
  j.set_exposed_all_gather_s(comm_exposed_by_kind_seconds[static_cast<int>(CommKind::kAllGather)]);
  j.set_exposed_reduce_scatter_s(
      comm_exposed_by_kind_seconds[static_cast<int>(CommKind::kReduceScatter)]);
  j.set_exposed_all_reduce_s(comm_exposed_by_kind_seconds[static_cast<int>(CommKind::kAllReduce)]);
  j.set_exposed_all_to_all_s(comm_exposed_by_kind_seconds[static_cast<int>(CommKind::kAllToAll)]);
  j.set_exposed_other_s(comm_exposed_by_kind_seconds[static_cast<int>(CommKind::kOther)]);
  j.set_peak_unsharded_param_bytes(peak_unsharded_param_bytes);
  j.set_full_param_bytes(full_param_bytes);
  j.set_wait_s(wait_seconds);
  j.set_model_s(model_seconds);
  j.set_update_s(update_seconds);
  j.set_tokens_per_s(tokens_per_second);
  return ProtoToJson(j);
}

std::string TrainSummary::ToString() const {
  if (first_step > last_step) return "summary: no steps run\n";
  std::string out = absl::StrFormat(
      "summary: steps %d-%d in %.1f s, %s tok/s, comm %.0f%% (exposed %.0f%%), wait %.0f%% of "
      "step time\n",
      first_step, last_step, seconds, HumanRate(tokens_per_second),
      seconds > 0 ? 100 * comm_seconds / seconds : 0.0,
      seconds > 0 ? 100 * comm_exposed_seconds / seconds : 0.0,
      seconds > 0 ? 100 * wait_seconds / seconds : 0.0);
  if (seconds > 0) {
    absl::StrAppend(&out, "summary: exposed by collective (% of step time):");
    for (int k = 0; k < kNumCommKinds; ++k) {
      absl::StrAppendFormat(&out, "%s %s %.1f%%", k == 0 ? "" : ",",
                            CommKindName(static_cast<CommKind>(k)),
                            100 * comm_exposed_by_kind_seconds[k] / seconds);
    }
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppendFormat(&out,
                        "summary: median exposed / comm %.3f; median peak unsharded / full "
                        "parameter bytes %.3f\n",
                        median_exposed_fraction, median_peak_param_fraction);
  absl::StrAppendFormat(&out, "summary: ce %.4f -> %.4f (mean of the last steps %.4f)\n", first_ce,
                        last_ce, tail_mean_ce);
  if (entropy_floor > 0) {
    absl::StrAppendFormat(&out,
                          "summary: entropy floor %.4f nats/token; ce / floor = %.3f (%s 1.10)\n",
                          entropy_floor, tail_mean_ce / entropy_floor,
                          tail_mean_ce <= 1.1 * entropy_floor ? "within" : "NOT within");
  }
  if (parity) absl::StrAppend(&out, "summary: parity ", parity->ok ? "passed" : "FAILED", "\n");
  return out;
}

std::string CheckpointPath(const std::string& checkpoint_dir, int64_t step) {
  return absl::StrFormat("%s/step-%08d", checkpoint_dir, step);
}

namespace {

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

}  // namespace

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

namespace {
// A fresh run's id (16 hex digits): drawn on rank 0, the same on every rank. It goes into
// every checkpoint's commit marker and is kept by --resume.
absl::StatusOr<std::string> NewRunId(Communicator& world) {
  uint64_t id = 0;
  if (world.rank() == 0) {
    std::random_device rd;
    id = (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  }
  GRADSUM_RETURN_IF_ERROR(world.Broadcast(&id, 1, DType::kI64, 0));
  return absl::StrFormat("%016x", id);
}
}  // namespace

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainConfig& config,
                                                         const RankComms& comms) {
  GRADSUM_RETURN_IF_ERROR(ValidateConfig(config));
  if (comms.world == nullptr || comms.ep_group == nullptr || comms.edp_group == nullptr) {
    return absl::InvalidArgumentError("Trainer needs the world, EP and EDP communicators");
  }
  if (comms.world->size() != config.parallelism().world()) {
    return absl::InvalidArgumentError(absl::StrCat("parallelism.world=", config.parallelism().world(), ": the backend has ",
                                                   comms.world->size(), " ranks"));
  }
  if (comms.ep_group->size() != config.parallelism().ep()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallelism.ep=", config.parallelism().ep(), ": the EP group has ", comms.ep_group->size(), " ranks"));
  }
  // Ranks launched separately must agree on every setting and on the data before anything
  // else is collective.
  // The data file is read once: its loaded bytes give the fingerprint the ranks compare.
  absl::StatusOr<std::shared_ptr<const DocumentSource>> corpus = MakeCorpus(config.data());
  GRADSUM_RETURN_IF_ERROR(CheckRanksAgree(config, corpus, *comms.world));
  auto trainer = std::unique_ptr<Trainer>(new Trainer());
  trainer->corpus_ = *std::move(corpus);
  trainer->config_ = config;
  trainer->comms_ = comms;
  if (trainer->comms_.timer == nullptr) trainer->comms_.timer = std::make_shared<CommTimer>();

  MoeLmOptions options;
  options.model = config.model();
  options.alpha_b = config.loss().alpha_b();
  options.alpha_z = config.loss().alpha_z();
  parallel::ParallelOptions& p = options.parallel;
  p.sharding = ToShardingMode(config.parallelism().sharding());
  p.compute_dtype = ToDType(config.precision().compute_dtype());
  p.reduce_dtype = ToDType(config.precision().reduce_dtype());
  p.precision =
      config.precision().reproducible() ? parallel::GradPrecision::kExact : parallel::GradPrecision::kF32;
  p.layers_per_unit = config.parallelism().layers_per_unit();
  p.reshard_after_forward = config.parallelism().reshard_after_forward();
  p.reduce_every_micro_batch = config.parallelism().reduce_every_micro_batch();
  p.bucket_cap_bytes = static_cast<size_t>(config.comm().bucket_cap_mb() * (1 << 20));
  p.first_bucket_cap_bytes = static_cast<size_t>(config.comm().first_bucket_mb() * (1 << 20));
  // The ranks of a thread run share the cores; the kernels use what is left per rank.
  const int cores = AvailableCores();
  options.num_threads = config.comm().backend() == TrainConfig::thread ? std::max(1, cores / config.parallelism().world()) : 1;
  const MoeLmGroups groups{comms.world, comms.ep_group, comms.edp_group};
  GRADSUM_ASSIGN_OR_RETURN(trainer->model_, comms.make_model ? comms.make_model(options, groups)
                                                             : MoeLm::Create(options, groups));
  absl::StatusOr<NamedParams> initial =
      config.checkpoint().init_from().empty() ? MoeLm::InitialParameters(config.model(), config.model().seed())
                                 : ReadParamsFile(config.checkpoint().init_from(), config.model());
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(*comms.world, initial.status(), "--init_from"));
  GRADSUM_RETURN_IF_ERROR(trainer->model_->SetFullParameters(*initial));
  AdamWOptions adam;
  adam.lr = config.optim().lr();
  adam.beta1 = config.optim().beta1();
  adam.beta2 = config.optim().beta2();
  adam.eps = config.optim().eps();
  adam.weight_decay = config.optim().weight_decay();
  GRADSUM_ASSIGN_OR_RETURN(trainer->optimizer_,
                           ShardedAdamW::Create(trainer->model_->groups(), adam));
  trainer->display_ = losses::StepDisplay(config.model().layers(), config.model().experts(),
                                          /*exact=*/config.precision().reproducible());
  GRADSUM_RETURN_IF_ERROR(MoeLm::RegisterDisplayTerms(&trainer->display_));
  // Rank-local start-up work (the data file, the data loader, the checkpoint directory):
  // every rank learns at once if any rank failed, with that rank's message.
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(*comms.world, trainer->PrepareLocal(), "start-up"));
  if (config.checkpoint().resume()) {
    GRADSUM_RETURN_IF_ERROR(trainer->Resume());
  } else {
    GRADSUM_ASSIGN_OR_RETURN(trainer->run_id_, NewRunId(*comms.world));
  }
  GRADSUM_RETURN_IF_ERROR(trainer->model_->Unshard());
  return trainer;
}

absl::Status Trainer::PrepareLocal() {
  GRADSUM_ASSIGN_OR_RETURN(RankDataLoader loader,
                           RankDataLoader::Create(corpus_, config_.data(), comms_.world->rank(),
                                                  comms_.world->size()));
  loader_ = std::make_unique<RankDataLoader>(std::move(loader));
  if (!config_.checkpoint().dir().empty()) {
    std::error_code ec;
    fs::create_directories(config_.checkpoint().dir(), ec);
    if (ec) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint_dir=", config_.checkpoint().dir(),
                                                        ": cannot create: ", ec.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Trainer::CheckResumeCompatible(const CheckpointInfo& info, int64_t step) const {
  auto it = info.extra.find("config");
  if (it == info.extra.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--resume: the checkpoint of step ", step, " in ", config_.checkpoint().dir(),
        " has no \"config\" in its commit marker, so nothing shows that it continues this "
        "run's data stream and model; refusing it"));
  }
  absl::StatusOr<TrainConfig> parsed = ParseConfigText(it->second);
  if (!parsed.ok()) {
    return absl::DataLossError(absl::StrCat("--resume: the checkpoint of step ", step,
                                            ": its saved config does not parse: ",
                                            parsed.status().message()));
  }
  const TrainConfig& saved = *parsed;
  // What decides the data stream and what the parameters are. The mesh (world, ep, G,
  // micro_batch), the sharding mode and the unit grouping may change as long as the global
  // batch B = world x grad_acc x micro_batch stays (the stream is global, RankDataLoader;
  // LoadCheckpoint reshards); so may the optimizer settings, step count, logging, dtypes,
  // CE weighting and backend.
  const DataConfig &a = saved.data(), &b = config_.data();
  auto batch_text = [](const TrainConfig& c) {
    return absl::StrCat(GlobalBatch(c), " (world x grad_acc x micro_batch = ", c.parallelism().world(), " x ",
                        c.parallelism().grad_acc(), " x ", c.data().micro_batch(), ")");
  };
  if (GlobalBatch(saved) != GlobalBatch(config_)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--resume: the checkpoint of step ", step, " was written with global batch B=",
        batch_text(saved), " but this run has global batch B=", batch_text(config_),
        "; the data stream continues only with the same B (choose world, grad_acc and "
        "micro_batch with that product, or start a new checkpoint_dir)"));
  }
  const std::pair<const char*, std::pair<std::string, std::string>> fields[] = {
      {"data.path", {a.path(), b.path()}},
      {"data.seq_len", {absl::StrCat(a.seq_len()), absl::StrCat(b.seq_len())}},
      {"data.corpus_seed", {absl::StrCat(a.corpus_seed()), absl::StrCat(b.corpus_seed())}},
      {"data.min_doc_len", {absl::StrCat(a.min_doc_len()), absl::StrCat(b.min_doc_len())}},
      {"data.max_doc_len", {absl::StrCat(a.max_doc_len()), absl::StrCat(b.max_doc_len())}},
      {"data.corpus_documents",
       {absl::StrCat(a.corpus_documents()), absl::StrCat(b.corpus_documents())}},
  };
  const ModelConfig &ma = saved.model(), &mb = config_.model();
  const std::pair<const char*, std::pair<std::string, std::string>> model_fields[] = {
      {"model.vocab", {absl::StrCat(ma.vocab()), absl::StrCat(mb.vocab())}},
      {"model.dim", {absl::StrCat(ma.dim()), absl::StrCat(mb.dim())}},
      {"model.layers", {absl::StrCat(ma.layers()), absl::StrCat(mb.layers())}},
      {"model.experts", {absl::StrCat(ma.experts()), absl::StrCat(mb.experts())}},
      {"model.top_k", {absl::StrCat(ma.top_k()), absl::StrCat(mb.top_k())}},
      {"model.expert_dim", {absl::StrCat(ma.expert_dim()), absl::StrCat(mb.expert_dim())}},
      {"model.norm_topk_prob",
       {absl::StrCat(ma.norm_topk_prob()), absl::StrCat(mb.norm_topk_prob())}},
      {"model.router_scale", {absl::StrCat(ma.router_scale()), absl::StrCat(mb.router_scale())}},
  };
  std::vector<std::pair<const char*, std::pair<std::string, std::string>>> all(
      std::begin(fields), std::end(fields));
  all.insert(all.end(), std::begin(model_fields), std::end(model_fields));
  for (const auto& [name, values] : all) {
    if (values.first != values.second) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--resume: the checkpoint of step ", step, " was written with ", name, "=",
          values.first, " but this run has ", name, "=", values.second,
          "; resuming would continue a different data stream or model (start a new "
          "checkpoint_dir, or resume with the saved value)"));
    }
  }
  return absl::OkStatus();
}

absl::Status Trainer::Resume() {
  // Every rank must pick the same checkpoint: rank 0 decides, the others follow.
  int64_t step = -1;
  absl::Status found = absl::OkStatus();
  if (is_rank0()) {
    absl::StatusOr<int64_t> latest = LatestCheckpointStep(config_.checkpoint().dir());
    if (latest.ok()) step = *latest;
    found = latest.status();
  }
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(*comms_.world, found, "--resume"));
  GRADSUM_RETURN_IF_ERROR(comms_.world->Broadcast(&step, 1, DType::kI64, 0));
  const std::string dir = CheckpointPath(config_.checkpoint().dir(), step);
  // The saved config first, so that another model or global batch is refused by name
  // before any parameter is read.
  absl::StatusOr<CheckpointInfo> marker = ReadCheckpointInfo(dir);
  absl::Status compatible = marker.status();
  if (compatible.ok()) compatible = CheckResumeCompatible(*marker, step);
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(*comms_.world, compatible, "--resume"));
  GRADSUM_ASSIGN_OR_RETURN(CheckpointInfo info, LoadCheckpoint(dir, *comms_.world, *optimizer_));
  auto run_id = info.extra.find("run_id");
  if (run_id == info.extra.end() || run_id->second.empty()) {
    return MarkAgreed(absl::FailedPreconditionError(absl::StrCat(
        "--resume: the checkpoint ", dir, " has no run_id in its commit marker")));
  }
  run_id_ = run_id->second;
  resume_note_ = absl::StrCat("resumed from step ", info.step, " of run ", run_id_, " in ", dir);
  if (is_rank0()) {
    const std::vector<int64_t> skipped = IncompleteCheckpointsAfter(config_.checkpoint().dir(), step);
    int removed = 0;
    for (int64_t s : skipped) {
      removed += RemoveStaleTempFiles(CheckpointPath(config_.checkpoint().dir(), s));
    }
    if (!skipped.empty()) {
      absl::StrAppend(&resume_note_, " (skipped ", skipped.size(),
                      " incomplete newer save(s), the newest step ", skipped.back(),
                      ": interrupted before its commit marker; removed ", removed,
                      " temporary file(s))");
    }
  }
  step_ = info.step;
  fresh_start_ = false;
  GRADSUM_RETURN_IF_ERROR(MarkAgreed(RestoreDataPosition(info, dir)));
  auto mesh = [](const TrainConfig& c) {
    return absl::StrCat("world=", c.parallelism().world(), " ep=", c.parallelism().ep(), " grad_acc=", c.parallelism().grad_acc(),
                        " sharding=", TrainConfig::Sharding_Name(c.parallelism().sharding()),
                        " layers_per_unit=", c.parallelism().layers_per_unit());
  };
  absl::StatusOr<TrainConfig> saved = ParseConfigText(info.extra.at("config"));
  if (saved.ok() && mesh(*saved) != mesh(config_)) {
    absl::StrAppend(&resume_note_, "; resharded from ", mesh(*saved), " to ", mesh(config_));
  }
  return absl::OkStatus();
}

absl::Status Trainer::SaveCheckpointNow() {
  const DataPosition position = loader_->position();
  return SaveCheckpoint(CheckpointPath(config_.checkpoint().dir(), step_), *comms_.world, *optimizer_,
                        {{"config", ConfigToShortText(config_)},
                         {"run_id", run_id_},
                         {kDataNextDocument, absl::StrCat(position.next_document)},
                         {kDataSequences, absl::StrCat(position.sequences)}});
}

absl::Status Trainer::RestoreDataPosition(const CheckpointInfo& info, const std::string& dir) {
  auto next = info.extra.find(kDataNextDocument);
  auto sequences = info.extra.find(kDataSequences);
  if (next == info.extra.end() || sequences == info.extra.end()) {
    // A checkpoint from before the position was recorded: replay the stream.
    loader_->SkipSteps(step_, config_.parallelism().grad_acc());
    return absl::OkStatus();
  }
  DataPosition position;
  if (!absl::SimpleAtoi(next->second, &position.next_document) ||
      !absl::SimpleAtoi(sequences->second, &position.sequences) ||
      position.sequences != step_ * GlobalBatch(config_)) {
    return absl::DataLossError(absl::StrCat(
        "--resume: the checkpoint ", dir, " records the data position ", kDataNextDocument, "=",
        next->second, ", ", kDataSequences, "=", sequences->second, ", which is not the end of ",
        step_, " steps of ", GlobalBatch(config_), " sequences"));
  }
  return loader_->Seek(position);
}

absl::StatusOr<StepRecord> Trainer::Step() {
  const absl::Time start = absl::Now();
  comms_.timer->Take();
  comms_.timer->TakeBusy();
  model_->TakePeakUnshardedBytes();
  const int G = config_.parallelism().grad_acc();
  const bool first = fresh_start_ && step_ == 0;
  const bool need_full = first && (config_.debug().parity_check() || !config_.debug().dump_dir().empty());

  // Global statistics D and N before the first forward (§3, §4).
  std::vector<MicroBatch> batches = loader_->NextStep(G);
  std::vector<std::vector<int64_t>> labels(G);
  std::vector<std::vector<uint8_t>> masks(G);
  std::vector<losses::MicroBatchTokens> tokens(G);
  for (int m = 0; m < G; ++m) {
    labels[m].assign(batches[m].labels.begin(), batches[m].labels.end());
    masks[m].assign(batches[m].mask.begin(), batches[m].mask.end());
    tokens[m].labels = labels[m];
    tokens[m].sample_ids = batches[m].sample_ids;
    tokens[m].input_mask = masks[m];
  }
  losses::StepStatsOptions stats_options;
  stats_options.mode = ToCeWeightMode(config_.loss().ce_mode());
  GRADSUM_ASSIGN_OR_RETURN(losses::StepStats stats,
                           losses::ComputeStepStats(*comms_.world, tokens, stats_options));

  NamedParams weights;
  if (need_full) {
    GRADSUM_ASSIGN_OR_RETURN(weights, model_->GatherFull(/*grads=*/false));
  }

  std::vector<FlatParam*> groups = model_->groups();
  const absl::Time model_start = absl::Now();
  for (int m = 0; m < G; ++m) {
    GRADSUM_RETURN_IF_ERROR(model_->ForwardBackward(batches[m], stats, m, &display_).status());
  }
  GRADSUM_RETURN_IF_ERROR(model_->FinishGradReduce());
  const absl::Duration model_time = absl::Now() - model_start;
  if (need_full) {
    GRADSUM_ASSIGN_OR_RETURN(NamedParams grads, model_->GatherFull(/*grads=*/true));
    first_step_grads_ = std::move(grads);
  }

  const absl::Time update_start = absl::Now();
  double grad_norm;
  if (config_.optim().grad_clip() > 0) {
    GRADSUM_ASSIGN_OR_RETURN(grad_norm,
                             ClipGradNorm(groups, *comms_.world, config_.optim().grad_clip()));
  } else {
    GRADSUM_ASSIGN_OR_RETURN(grad_norm, GlobalGradNorm(groups, *comms_.world));
  }
  if (!std::isfinite(grad_norm)) {
    return absl::InternalError(absl::StrCat("step ", step_ + 1, ": gradient norm is ", grad_norm,
                                            " (training diverged; lower --lr)"));
  }
  const int warmup = config_.optim().warmup_steps();
  const double lr =
      config_.optim().lr() * (warmup > 0 ? std::min(1.0, (step_ + 1.0) / warmup) : 1.0);
  GRADSUM_RETURN_IF_ERROR(optimizer_->set_lr(lr));
  GRADSUM_RETURN_IF_ERROR(optimizer_->Step());
  for (FlatParam* g : groups) GRADSUM_RETURN_IF_ERROR(g->ZeroGrad());
  GRADSUM_RETURN_IF_ERROR(model_->Unshard());
  const absl::Duration update_time = absl::Now() - update_start;
  GRADSUM_ASSIGN_OR_RETURN(losses::StepDisplayValues values, display_.Reduce(*comms_.world));

  // Waiting: how long this rank idles at the step's end for the slowest rank.
  const CommTimer::Exposed exposed = comms_.timer->TakeByKind();
  const absl::Duration comm = comms_.timer->TakeBusy();
  const absl::Time wait_start = absl::Now();
  GRADSUM_RETURN_IF_ERROR(comms_.world->Barrier());
  const absl::Duration wait = absl::Now() - wait_start;
  comms_.timer->Take();  // the barrier is not communication of the step
  comms_.timer->TakeBusy();

  ++step_;
  StepRecord r;
  r.step = step_;
  GRADSUM_ASSIGN_OR_RETURN(r.ce, values.Value("ce"));
  GRADSUM_ASSIGN_OR_RETURN(r.z, values.Value("z"));
  GRADSUM_ASSIGN_OR_RETURN(r.bal, values.Value("bal"));
  r.loss = values.total_loss;
  r.valid_tokens = stats.global_valid_tokens;
  r.routed_tokens = stats.global_routed_tokens;
  r.grad_norm = grad_norm;
  r.lr = lr;
  r.step_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  r.comm_seconds = absl::ToDoubleSeconds(comm);
  r.comm_exposed_seconds = absl::ToDoubleSeconds(exposed.total);
  for (int k = 0; k < kNumCommKinds; ++k) {
    r.comm_exposed_by_kind_seconds[k] = absl::ToDoubleSeconds(exposed.by_kind[k]);
  }
  r.peak_unsharded_param_bytes = model_->TakePeakUnshardedBytes();
  r.full_param_bytes = model_->FullParamBytes();
  r.wait_seconds = absl::ToDoubleSeconds(wait);
  r.model_seconds = absl::ToDoubleSeconds(model_time);
  r.update_seconds = absl::ToDoubleSeconds(update_time);
  r.tokens_per_second = r.step_seconds > 0 ? r.routed_tokens / r.step_seconds : 0;
  r.maxvio = values.maxvio;

  if (first && !config_.debug().dump_dir().empty()) {
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(
        *comms_.world, WriteDump(weights, *first_step_grads_, batches, r), "--dump_dir"));
  }
  if (first && config_.debug().parity_check()) {
    // Rank 0 runs the reference; every rank learns the verdict, so all fail together.
    int64_t ok = 0;
    absl::Status local = absl::OkStatus();
    if (is_rank0()) local = [&]() -> absl::Status {
      const bool f32 =
          config_.precision().compute_dtype() == TrainConfig::f32 && config_.precision().reduce_dtype() == TrainConfig::f32;
      // bf16 rounds parameters or gradients to 8 bits of mantissa: a looser bar, the one
      // moe/cuda's bf16 layer test uses (the tiny test models' expert gradients reach 2.1e-2).
      const double tol =
          f32 ? config_.debug().parity_tolerance() : std::max(config_.debug().parity_tolerance(), 3e-2);
      GRADSUM_ASSIGN_OR_RETURN(auto global_batch, GlobalBatchForStep(config_, 0));
      GRADSUM_ASSIGN_OR_RETURN(
          ParityReport report,
          CheckParity(config_, weights, global_batch, *first_step_grads_, {r.ce, r.z, r.bal}, tol));
      ok = report.ok ? 1 : 0;
      parity_ = std::move(report);
      return absl::OkStatus();
    }();
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(*comms_.world, local, "--parity_check"));
    GRADSUM_RETURN_IF_ERROR(comms_.world->Broadcast(&ok, 1, DType::kI64, 0));
    if (!is_rank0()) {
      ParityReport verdict;
      verdict.ok = ok == 1;
      parity_ = verdict;
    }
  }
  history_.push_back(r);
  return r;
}

absl::Status Trainer::WriteDump(const NamedParams& weights, const NamedParams& grads,
                                const std::vector<MicroBatch>& batches, const StepRecord& record) {
  const std::string& dir = config_.debug().dump_dir();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("--dump_dir=", dir, ": ", ec.message()));
  // Every rank writes its own micro-batches.
  for (size_t m = 0; m < batches.size(); ++m) {
    const MicroBatch& mb = batches[m];
    std::vector<int64_t> tok(mb.tokens.begin(), mb.tokens.end()),
        lab(mb.labels.begin(), mb.labels.end()), msk(mb.mask.begin(), mb.mask.end()),
        sid(mb.sample_ids.begin(), mb.sample_ids.end());
    SafetensorsWriter w;
    for (auto& [name, v] : {std::pair<const char*, std::vector<int64_t>*>{"tokens", &tok},
                            {"labels", &lab},
                            {"mask", &msk},
                            {"sample_ids", &sid}}) {
      GRADSUM_ASSIGN_OR_RETURN(TensorView view,
                               TensorView::Create(v->data(), DType::kI64, {mb.batch, mb.seq_len}));
      GRADSUM_RETURN_IF_ERROR(w.Add(name, view));
    }
    // The global index of each row in the data stream (train/data.h).
    std::vector<int64_t> seq(mb.sequence_ids.begin(), mb.sequence_ids.end());
    GRADSUM_ASSIGN_OR_RETURN(TensorView seq_view,
                             TensorView::Create(seq.data(), DType::kI64, {mb.batch}));
    GRADSUM_RETURN_IF_ERROR(w.Add("sequence_ids", seq_view));
    GRADSUM_RETURN_IF_ERROR(
        w.WriteFile(absl::StrCat(dir, "/batch.r", comms_.world->rank(), ".m", m, ".safetensors")));
  }
  if (!is_rank0()) return absl::OkStatus();
  for (const auto& [file, tensors] :
       {std::pair<const char*, const NamedParams*>{"weights.safetensors", &weights},
        {"grads.safetensors", &grads}}) {
    GRADSUM_RETURN_IF_ERROR(
        WriteParamsFile(absl::StrCat(dir, "/", file), config_.model(), *tensors, 1));
  }
  DumpedLosses j;
  j.set_step(1);
  j.set_ce(record.ce);
  j.set_z(record.z);
  j.set_bal(record.bal);
  j.set_loss(record.loss);
  j.set_valid_tokens(record.valid_tokens);
  j.set_routed_tokens(record.routed_tokens);
  j.set_config(ConfigToShortText(config_));
  GRADSUM_ASSIGN_OR_RETURN(std::string text, ProtoToJson(j));
  return WriteFileAtomically(absl::StrCat(dir, "/losses.json"), text + "\n");
}

absl::StatusOr<TrainSummary> Trainer::Run(std::ostream* log) {
  TrainSummary summary;
  summary.first_step = step_ + 1;
  summary.entropy_floor = corpus_->EntropyFloorNats();
  if (log != nullptr && !resume_note_.empty()) *log << resume_note_ << std::endl;
  // Rank-local failures (the metrics file, the fault hook) are agreed on at each step
  // boundary: every rank stops together with the failing rank's message.
  MetricsFile metrics;
  absl::Status local = absl::OkStatus();
  if (is_rank0() && !config_.log().metrics().empty()) {
    absl::StatusOr<MetricsFile> opened = MetricsFile::Open(config_.log().metrics(), !fresh_start_);
    if (opened.ok()) metrics = std::move(*opened);
    local = opened.status();
  }
  double ce_tail_sum = 0;
  std::vector<double> ces;
  while (true) {
    if (local.ok() && step_ < config_.optim().steps()) local = MaybeInjectFault(comms_.world->rank(), step_ + 1);
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(
        *comms_.world, local,
        step_ < config_.optim().steps() ? absl::StrCat("step ", step_ + 1) : "end of training"));
    if (step_ >= config_.optim().steps()) break;
    GRADSUM_ASSIGN_OR_RETURN(StepRecord r, Step());
    if (log != nullptr) *log << r.ToLogLine(config_.optim().steps()) << std::endl;
    if (metrics.is_open()) {
      absl::StatusOr<std::string> line = r.ToJson();
      local = line.ok() ? metrics.WriteLine(*line) : line.status();
    }
    // After the step's log lines, so a run killed right after a checkpoint has logged
    // every step the checkpoint covers.
    if (!config_.checkpoint().dir().empty() &&
        ((config_.checkpoint().every() > 0 && step_ % config_.checkpoint().every() == 0) ||
         step_ == config_.optim().steps())) {
      GRADSUM_RETURN_IF_ERROR(SaveCheckpointNow());
    }
    if (r.step == summary.first_step) summary.first_ce = r.ce;
    summary.last_step = r.step;
    summary.last_ce = r.ce;
    summary.seconds += r.step_seconds;  // steps only: no parity, dump or checkpoint time
    summary.comm_seconds += r.comm_seconds;
    summary.comm_exposed_seconds += r.comm_exposed_seconds;
    for (int k = 0; k < kNumCommKinds; ++k) {
      summary.comm_exposed_by_kind_seconds[k] += r.comm_exposed_by_kind_seconds[k];
    }
    summary.wait_seconds += r.wait_seconds;
    ces.push_back(r.ce);
    if (parity_.has_value() && r.step == 1) {
      if (log != nullptr && !parity_->params.empty()) *log << parity_->ToString() << std::flush;
      if (!parity_->ok) {
        return MarkAgreed(absl::FailedPreconditionError(
            "--parity_check: step 1 differs from the single-process reference beyond the "
            "tolerance (see the parity lines)"));
      }
    }
  }
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(*comms_.world, metrics.Close(), "--metrics"));
  if (!config_.checkpoint().export_path().empty()) {
    GRADSUM_ASSIGN_OR_RETURN(NamedParams params, model_->GatherFull(/*grads=*/false));
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(
        *comms_.world,
        is_rank0() ? WriteParamsFile(config_.checkpoint().export_path(), config_.model(), params, step_)
                   : absl::OkStatus(),
        "--export"));
    if (log != nullptr) *log << "exported the parameters of step " << step_ << " to "
                             << config_.checkpoint().export_path() << std::endl;
  }
  const size_t tail = std::min<size_t>(10, ces.size());
  for (size_t i = ces.size() - tail; i < ces.size(); ++i) ce_tail_sum += ces[i];
  summary.tail_mean_ce = tail > 0 ? ce_tail_sum / tail : 0;
  int64_t tokens = 0;
  for (const StepRecord& r : history_) tokens += r.routed_tokens;
  summary.tokens_per_second = summary.seconds > 0 ? tokens / summary.seconds : 0;
  summary.parity = parity_;
  std::vector<double> exposed, peak;
  for (const StepRecord& r : history_) {
    if (r.step < summary.first_step) continue;
    if (r.comm_seconds > 0) exposed.push_back(r.comm_exposed_seconds / r.comm_seconds);
    if (r.full_param_bytes > 0) {
      peak.push_back(static_cast<double>(r.peak_unsharded_param_bytes) / r.full_param_bytes);
    }
  }
  summary.median_exposed_fraction = Median(exposed);
  summary.median_peak_param_fraction = Median(peak);
  if (log != nullptr) *log << summary.ToString() << std::flush;
  return summary;
}

}  // namespace gradsum::train
