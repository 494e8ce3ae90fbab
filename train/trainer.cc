#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "collectives/status_agreement.h"
#include "core/status.h"
#include "data/corpus.h"
#include "data/document_source.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/token_files.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "io/path_checks.h"
#include "optim/grad_norm.h"
#include "train/checkpointing.h"
#include "train/config.h"
#include "train/config_agreement.h"
#include "train/debugging.h"
#include "train/fault_injection.h"
#include "train/metrics_file.h"
#include "train/stop_signal.h"

namespace gradsum::train {
namespace {

losses::CeWeightMode ToCeWeightMode(TrainConfig::CeMode m) {
  switch (m) {
    case TrainConfig::sample:
      return losses::CeWeightMode::kSample;
    case TrainConfig::square:
      return losses::CeWeightMode::kSquare;
    case TrainConfig::token:
      break;
  }
  return losses::CeWeightMode::kToken;
}

// The held-out documents of --eval_data (data.eval_path), or nullptr when the run has no
// such file (ValidateConfig allows one only with --data and --eval_every). Its path is
// checked first (a FIFO would block), and its errors name --eval_data.
absl::StatusOr<std::shared_ptr<const data::DocumentSource>> LoadEvalData(const DataConfig& data) {
  if (data.eval_path().empty()) return std::shared_ptr<const data::DocumentSource>();
  if (!data::IsTokenFilePath(data.eval_path())) {
    GRADSUM_RETURN_IF_ERROR(CheckInputFile("--eval_data", data.eval_path()));
  }
  absl::StatusOr<std::shared_ptr<const data::DocumentSource>> held_out =
      data::MakeHeldOutCorpus(data);
  if (held_out.ok()) return held_out;
  // The text-file loader (data/text_corpus.cc) labels its errors with the --data flag
  // whatever file it reads; this one is --eval_data's.
  std::string message(held_out.status().message());
  const std::string as_data = absl::StrCat("--data=", data.eval_path());
  if (const size_t at = message.find(as_data); at != std::string::npos) {
    message.replace(at, as_data.size(), absl::StrCat("--eval_data=", data.eval_path()));
  }
  return absl::Status(held_out.status().code(), message);
}

// Runs a start-up load (`what` names its flag) and turns running out of memory into a
// status, so that it reaches the agreement after the loads and ends every rank promptly with
// this rank's message, instead of escaping it while the peers wait in the agreement for
// the collective timeout (issue 50, item 2).
template <typename Load>
auto CatchingOutOfMemory(absl::string_view what, Load load) -> decltype(load()) {
  try {
    return load();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what,
                     ": out of memory while loading it at start-up (std::bad_alloc); "
                     "use a smaller file or a machine with more memory"));
  }
}

// Each parallelism field named after a mesh axis (collectives/mesh.h MeshAxisName) takes
// that axis's size, so that a new axis is recorded without a line here.
void RecordMeshSizes(const Mesh& mesh, ParallelismConfig* parallelism) {
  const google::protobuf::Descriptor* fields = parallelism->GetDescriptor();
  const google::protobuf::Reflection* values = parallelism->GetReflection();
  for (int a = 0; a < kNumMeshAxes; ++a) {
    const MeshAxis axis = static_cast<MeshAxis>(a);
    const google::protobuf::FieldDescriptor* f = fields->FindFieldByName(MeshAxisName(axis));
    if (f != nullptr && f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_INT32) {
      values->SetInt32(parallelism, f, mesh.size(axis));
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainConfig& config,
                                                         const RankComms& comms) {
  GRADSUM_RETURN_IF_ERROR(ValidateConfig(config));
  if (comms.mesh == nullptr) return absl::InvalidArgumentError("Trainer needs the rank's mesh");
  if (config.debug().parity_check() && !comms.parity_check) {
    // The fp64 reference is not linked into this binary (train/parity_report.h).
    return absl::FailedPreconditionError(
        "--parity_check (debug.parity_check): this binary has no parity check linked in; run "
        "moe_lm_parity (//train:moe_lm_parity) with the same flags, or a moe_lm built beside it");
  }
  Communicator& world = comms.mesh->world();
  // Ranks launched separately must agree on every setting and on the data before anything
  // else is collective.
  // The data file is read once: its loaded bytes give the fingerprint the ranks compare.
  // Its path is checked first, since opening a FIFO would block (a token file's reader opens
  // its files non-blocking and refuses all but regular files itself; a Megatron PREFIX is
  // no file).
  const absl::Status data_path =
      config.data().path().empty() || data::IsTokenFilePath(config.data().path())
          ? absl::OkStatus()
          : CheckInputFile("--data", config.data().path());
  absl::StatusOr<std::shared_ptr<const data::DocumentSource>> corpus =
      data_path.ok()
          ? CatchingOutOfMemory(
                !config.data().data_path().empty()
                    ? absl::StrCat("--data_path=", config.data().data_path())
                : config.data().path().empty() ? "the embedded corpus"
                                               : absl::StrCat("--data=", config.data().path()),
                [&]() -> absl::StatusOr<std::shared_ptr<const data::DocumentSource>> {
                  MaybeInjectStartupAllocFailure(world.rank());
                  return data::MakeCorpus(config.data());
                })
          : absl::StatusOr<std::shared_ptr<const data::DocumentSource>>(data_path);
  // A token file's ids must fit the model's vocabulary (byte corpora: 256).
  if (corpus.ok()) {
    const absl::Status fits = data::CheckCorpusVocab(**corpus, config.model().vocab());
    if (!fits.ok()) corpus = fits;
  }
  // --eval_data likewise: its content joins the agreement (ranks evaluating on different
  // files would log a mixed held-out CE).
  absl::StatusOr<std::shared_ptr<const data::DocumentSource>> eval_file =
      corpus.ok() ? CatchingOutOfMemory("--eval_data", [&] { return LoadEvalData(config.data()); })
                  : std::shared_ptr<const data::DocumentSource>();
  GRADSUM_RETURN_IF_ERROR(CheckRanksAgree(config, corpus, eval_file, world));
  // What a data file's longest document decides, known only now. The ranks agreed on the
  // files, so every rank fails here alike.
  if (ReadsDataFiles(config.data())) {
    GRADSUM_RETURN_IF_ERROR(MarkAgreed(ValidateLongestDocument(
        config, (*corpus)->MaxDocumentLength(),
        config.data().path().empty() ? (*corpus)->Describe()
                                     : absl::StrCat("--data=", config.data().path()))));
  }
  auto trainer = std::unique_ptr<Trainer>(new Trainer());
  trainer->corpus_ = *std::move(corpus);
  trainer->eval_file_ = *std::move(eval_file);
  trainer->config_ = config;
  // The mesh is the one source of the group sizes (MakeRankMesh built it from the config
  // and checked the world size); what the trainer records (the checkpoints' config, the
  // global batch, the data place) is the mesh's.
  RecordMeshSizes(*comms.mesh, trainer->config_.mutable_parallelism());
  trainer->comms_ = comms;
  if (trainer->comms_.timer == nullptr) trainer->comms_.timer = std::make_shared<CommTimer>();
  trainer->fresh_start_ = !config.checkpoint().resume();
  // Every destination before anything is built: a run whose results could not be written
  // stops here, not after its steps.
  GRADSUM_RETURN_IF_ERROR(trainer->PrepareOutputs());

  GRADSUM_ASSIGN_OR_RETURN(trainer->model_, BuildModel(trainer->config_, trainer->comms_));
  const std::string& init_from = config.checkpoint().init_from();
  model::ExpertBias initial_bias;  // an --init_from file's (§5.1), if it has one
  absl::StatusOr<NamedParams> initial =
      init_from.empty() ? MoeLm::InitialParameters(config.model(), config.model().seed())
                        : ReadParamsFile(init_from, config.model(), &initial_bias);
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, initial.status(), "--init_from"));
  GRADSUM_RETURN_IF_ERROR(trainer->model_->SetFullParameters(*initial));
  GRADSUM_RETURN_IF_ERROR(trainer->model_->SetExpertBias(std::move(initial_bias)));
  AdamWOptions adam;
  adam.lr = config.optim().lr();
  adam.beta1 = config.optim().beta1();
  adam.beta2 = config.optim().beta2();
  adam.eps = config.optim().eps();
  adam.weight_decay = config.optim().weight_decay();
  adam.decay_vectors = config.optim().decay_norms();
  GRADSUM_ASSIGN_OR_RETURN(trainer->optimizer_,
                           ShardedAdamW::Create(trainer->model_->groups(), adam));
  // The display sums exactly when the gradients are exact: the precision the model was
  // built with (BuildModel chose it once from the config).
  // Every MoE layer of the model is a display layer (the main ones, then the extra blocks').
  trainer->display_ =
      losses::StepDisplay(trainer->model_->spec().moe_layers(), config.model().experts(),
                          trainer->model_->options().parallel.precision);
  GRADSUM_RETURN_IF_ERROR(trainer->model_->RegisterDisplayTerms(&trainer->display_));
  // Rank-local start-up work (the data loader): every rank learns at once if any rank
  // failed, with that rank's message.
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, trainer->PrepareLocal(), "start-up"));
  if (config.checkpoint().resume()) {
    GRADSUM_ASSIGN_OR_RETURN(ResumedRun resumed,
                             ResumeRun(trainer->config_, world, *trainer->optimizer_,
                                       *trainer->loader_, trainer->corpus_->ContentFingerprint()));
    trainer->step_ = resumed.step;
    trainer->saved_step_ = resumed.step;
    trainer->run_id_ = std::move(resumed.run_id);
    trainer->start_notes_.push_back(std::move(resumed.note));
    trainer->config_ = std::move(resumed.config);
    GRADSUM_RETURN_IF_ERROR(
        MarkAgreed(trainer->model_->SetExpertBias(std::move(resumed.expert_bias))));
  } else {
    GRADSUM_ASSIGN_OR_RETURN(trainer->run_id_, NewRunId(world));
  }
  GRADSUM_ASSIGN_OR_RETURN(trainer->meters_, RunMeters::Create(trainer->corpus_, trainer->config_));
  if (!trainer->fresh_start_) trainer->meters_->Resume(trainer->loader_->position());
  if (config.checkpoint().save_on_signal()) {
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, InstallStopSignalHandlers(), "--save_on_signal"));
  }
  GRADSUM_RETURN_IF_ERROR(trainer->model_->Unshard());
  return trainer;
}

absl::Status Trainer::PrepareLocal() {
  GRADSUM_ASSIGN_OR_RETURN(
      const data::DataPlace place,
      data::DataPlaceOf(config_.parallelism(), config_.data().seq_len(), world().rank()));
  GRADSUM_ASSIGN_OR_RETURN(data::RankDataLoader loader,
                           data::RankDataLoader::Create(corpus_, config_.data(), place));
  GRADSUM_RETURN_IF_ERROR(loader.SetLabelStreams(model_->spec().label_streams()));
  loader_ = std::make_unique<data::RankDataLoader>(std::move(loader));
  if (config_.log().eval_every() > 0) {
    // The held-out batch, the same at every evaluation (so the values compare).
    std::shared_ptr<const data::DocumentSource> held_out = eval_file_;
    if (held_out == nullptr) {
      GRADSUM_ASSIGN_OR_RETURN(held_out, data::MakeHeldOutCorpus(config_.data()));
    }
    GRADSUM_RETURN_IF_ERROR(data::CheckCorpusVocab(*held_out, config_.model().vocab()));
    GRADSUM_ASSIGN_OR_RETURN(data::RankDataLoader eval_loader,
                             data::RankDataLoader::Create(held_out, config_.data(), place));
    eval_batches_ = eval_loader.NextStep(config_.log().eval_micro_batches());
  }
  return absl::OkStatus();
}

// The held-out CE (log.eval_every): every evaluation micro-batch forward only, its CE
// summed as the display sums training's (exact in reproducible mode), over the
// evaluation's own global statistics (computed once: the batch never changes).
absl::StatusOr<double> Trainer::Evaluate() {
  if (eval_batches_.empty()) {
    return absl::FailedPreconditionError("Evaluate: no held-out batch (log.eval_every is 0)");
  }
  if (!eval_stats_.has_value()) {
    GRADSUM_ASSIGN_OR_RETURN(eval_stats_, ComputeStatistics(eval_batches_, /*extra_streams=*/0));
  }
  losses::StepDisplay display(0, 0, model_->options().parallel.precision);
  GRADSUM_RETURN_IF_ERROR(display.RegisterTerm("ce"));
  if (config_.loss().alpha_lse() > 0) GRADSUM_RETURN_IF_ERROR(display.RegisterTerm("z_out"));
  for (size_t m = 0; m < eval_batches_.size(); ++m) {
    GRADSUM_RETURN_IF_ERROR(
        model_->Evaluate(eval_batches_[m], *eval_stats_, static_cast<int>(m), &display).status());
  }
  GRADSUM_ASSIGN_OR_RETURN(const losses::StepDisplayValues values, display.Reduce(world()));
  return values.Value("ce");
}

absl::Status Trainer::PrepareOutputs() {
  const CheckpointConfig& checkpoint = config_.checkpoint();
  // The checkpoint directory first: while another run owns it, nothing else of this run
  // may touch a file (not even truncate a --metrics file the other run may share).
  if (!checkpoint.dir().empty()) {
    absl::Status local = PrepareOutputDir("--checkpoint_dir", checkpoint.dir());
    if (local.ok() && is_rank0()) {
      absl::StatusOr<OwnedCheckpointDir> owned = TakeCheckpointDir(checkpoint);
      if (owned.ok()) {
        checkpoint_lock_ = std::move(owned->lock);
        if (!owned->note.empty()) start_notes_.push_back(std::move(owned->note));
      }
      local = owned.status();
    }
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world(), local, "--checkpoint_dir"));
  }
  if (!config_.log().metrics().empty()) {
    absl::Status local = absl::OkStatus();
    if (is_rank0()) {
      absl::StatusOr<MetricsFile> opened =
          MetricsFile::Open(config_.log().metrics(), /*append=*/!fresh_start_);
      if (opened.ok()) metrics_ = std::move(*opened);
      local = opened.status();
    }
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world(), local, "--metrics"));
  }
  if (!config_.log().tensorboard_dir().empty()) {  // rank 0's file; a resume appends
    absl::Status local = absl::OkStatus();
    if (is_rank0()) {
      absl::StatusOr<TfEventsWriter> opened =
          TfEventsWriter::Open(config_.log().tensorboard_dir(), /*append=*/!fresh_start_);
      if (opened.ok()) tensorboard_ = std::move(*opened);
      local = opened.status();
    }
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world(), local, "--tensorboard_dir"));
  }
  if (!checkpoint.export_path().empty()) {
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(
        world(),
        is_rank0() ? CheckOutputFile("--export", checkpoint.export_path()) : absl::OkStatus(),
        "--export"));
  }
  if (fresh_start_ && !config_.debug().dump_dir().empty()) {  // written after step 1
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(
        world(), PrepareOutputDir("--dump_dir", config_.debug().dump_dir()), "--dump_dir"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepMetrics> Trainer::Step() {
  StepTimes times;
  times.start = absl::Now();
  comms_.timer->Take();
  comms_.timer->TakeBusy();
  model_->TakePeakUnshardedBytes();
  model_->TakePeakActivationBytes();
  model_->TakePeakHeadScratchBytes();
  const bool first = fresh_start_ && step_ == 0;
  const bool gather_full =
      first && (config_.debug().parity_check() || !config_.debug().dump_dir().empty());

  meters_->BeginStep(loader_->position());
  const absl::Time data_start = absl::Now();
  std::vector<data::MicroBatch> batches = loader_->NextStep(config_.parallelism().grad_acc());
  times.data = absl::Now() - data_start;
  GRADSUM_ASSIGN_OR_RETURN(const losses::StepStats stats,
                           ComputeStatistics(batches, model_->spec().label_streams() - 1));
  NamedParams weights;     // step 1's full parameters, for the dump and the parity check
  model::ExpertBias bias;  // and the expert bias step 1 routes with (§5.1)
  if (gather_full) {
    GRADSUM_ASSIGN_OR_RETURN(weights, model_->GatherFull(/*grads=*/false));
    bias = model_->expert_bias();
  }

  const absl::Time model_start = absl::Now();
  GRADSUM_RETURN_IF_ERROR(RunMicroBatches(batches, stats));
  GRADSUM_RETURN_IF_ERROR(FinishReductions());
  times.model = absl::Now() - model_start;
  if (gather_full) {
    GRADSUM_ASSIGN_OR_RETURN(NamedParams grads, model_->GatherFull(/*grads=*/true));
    first_step_grads_ = std::move(grads);
  }

  const absl::Time update_start = absl::Now();
  GRADSUM_ASSIGN_OR_RETURN(const double grad_norm, ClipGradients());
  GRADSUM_ASSIGN_OR_RETURN(const double lr, ApplyAdamW());
  UpdateExpertBias();
  times.update = absl::Now() - update_start;
  const double local_ce = LocalMeanCe(stats);
  GRADSUM_ASSIGN_OR_RETURN(const losses::StepDisplayValues display, ReduceDisplay());
  GRADSUM_RETURN_IF_ERROR(WaitForSlowestRank(&times, local_ce));

  ++step_;
  GRADSUM_ASSIGN_OR_RETURN(const StepMetrics record,
                           MakeRecord(stats, display, grad_norm, lr, times));
  if (first) GRADSUM_RETURN_IF_ERROR(RunFirstStepChecks(weights, bias, batches, record));
  history_.push_back(record);
  return record;
}

// Phase 1: the step's global statistics before the first forward: D and N (§3, §4) and
// every further label stream's D_j, in one all-reduce.
absl::StatusOr<losses::StepStats> Trainer::ComputeStatistics(
    const std::vector<data::MicroBatch>& batches, int extra_streams) {
  const size_t G = batches.size();
  std::vector<std::vector<int64_t>> labels(G);
  std::vector<std::vector<uint8_t>> masks(G);
  std::vector<losses::MicroBatchTokens> tokens(G);
  for (size_t m = 0; m < G; ++m) {
    const data::MicroBatch& mb = batches[m];
    labels[m].assign(mb.labels.begin(), mb.labels.end());
    masks[m].assign(mb.mask.begin(), mb.mask.end());
    tokens[m].labels = labels[m];
    tokens[m].sample_ids = mb.sample_ids;
    tokens[m].sample_sizes = mb.sample_valid;
    tokens[m].input_mask = masks[m];
    for (const data::MicroBatch::Stream& s : mb.extra_streams) {
      tokens[m].extra_streams.push_back({s.labels, s.sample_valid});
    }
  }
  losses::StepStatsOptions options;
  options.mode = ToCeWeightMode(config_.loss().ce_mode());
  options.extra_streams = extra_streams;
  return losses::ComputeStepStats(world(), tokens, options);
}

// Phase 2: every micro-batch's forward and backward through the unit schedule, which
// issues each unit's SUM reduction as backward completes its gradient.
absl::Status Trainer::RunMicroBatches(const std::vector<data::MicroBatch>& batches,
                                      const losses::StepStats& stats) {
  for (size_t m = 0; m < batches.size(); ++m) {
    GRADSUM_RETURN_IF_ERROR(
        model_->ForwardBackward(batches[m], stats, static_cast<int>(m), &display_).status());
  }
  return absl::OkStatus();
}

// The first element of this rank's owned reduced gradients that is NaN or infinite, as an
// Internal error naming its parameter, index and value (OK when there is none).
absl::Status Trainer::FirstNonFiniteGradient() {
  for (FlatParam* g : model_->groups()) {
    const absl::Span<const float> owned = g->owned_grad();
    for (size_t i = 0; i < owned.size(); ++i) {
      if (std::isfinite(owned[i])) continue;
      const int64_t flat = g->owned_offset() + static_cast<int64_t>(i);
      for (const FlatParamEntry& e : g->entries()) {
        if (flat < e.offset || flat >= e.offset + e.numel) continue;
        return absl::InternalError(absl::StrCat("the reduced gradient of ", e.name, "[",
                                                flat - e.offset, "] is ", owned[i], " (unit \"",
                                                g->name(), "\")"));
      }
    }
  }
  return absl::OkStatus();
}

// Phase 3: wait for the reductions; every unit's master_grad() is then complete.
absl::Status Trainer::FinishReductions() { return model_->FinishGradReduce(); }

// Phase 4: the global gradient norm, and clipping to optim.grad_clip (§7; 0: no clipping).
absl::StatusOr<double> Trainer::ClipGradients() {
  if (MaybeInjectNanGradient(world().rank(), step_ + 1) && !model_->groups().empty()) {
    FlatParam* g = model_->groups().front();
    const int64_t at = g->owned_offset() - g->master_offset();
    if (g->owned_numel() > 0) g->master_grad()[at] = std::nanf("");
  }
  const double clip = config_.optim().grad_clip();
  GRADSUM_ASSIGN_OR_RETURN(const double grad_norm,
                           clip > 0 ? ClipGradNorm(model_->groups(), world(), clip)
                                    : GlobalGradNorm(model_->groups(), world()));
  if (!std::isfinite(grad_norm)) {
    // Every rank got the same norm: each names the first non-finite element it owns, and
    // the agreement reports every such rank's (rank 0 prints them).
    const std::string what = absl::StrCat("step ", step_ + 1, ": gradient norm is ", grad_norm,
                                          " (training diverged; "
                                          "lower --lr)");
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world(), FirstNonFiniteGradient(), what));
    return MarkAgreed(absl::InternalError(absl::StrCat(
        what, "; every reduced gradient element is finite: the sum of their squares overflowed")));
  }
  return grad_norm;
}

// Phase 5: AdamW on the shards at the schedule's learning rate (optim/lr_schedule.h); then
// the gradients are zeroed and the model prepared for the next step's forward.
absl::StatusOr<double> Trainer::ApplyAdamW() {
  const double lr = optim::LearningRate(ToLrSchedule(config_.optim()), step_);
  GRADSUM_RETURN_IF_ERROR(optimizer_->set_lr(lr));
  GRADSUM_RETURN_IF_ERROR(optimizer_->Step());
  for (FlatParam* g : model_->groups()) GRADSUM_RETURN_IF_ERROR(g->ZeroGrad());
  GRADSUM_RETURN_IF_ERROR(model_->Unshard());
  return lr;
}

// Phase 5b: the expert bias's sign update from the step's global counts (§5.1); nothing
// collective, the counts are already the world's. A no-op without --expert_bias_speed.
void Trainer::UpdateExpertBias() { model_->UpdateExpertBias(); }

// Phase 6: the step's global display losses (§8).
absl::StatusOr<losses::StepDisplayValues> Trainer::ReduceDisplay() {
  return display_.Reduce(world());
}

// The step's communication as the timer took it, then how long this rank idles at the
// step's end for the slowest rank (the barrier is not communication of the step).
absl::Status Trainer::WaitForSlowestRank(StepTimes* times, double local_ce) {
  times->exposed = comms_.timer->TakeByKind();
  times->comm = comms_.timer->TakeBusy();
  const absl::Time wait_start = absl::Now();
  // The barrier carries the ranks' own mean CE: a MAX all-reduce waits for every rank as a
  // barrier does, and its time and call are dropped below with the barrier's.
  double max_ce = 0;
  GRADSUM_RETURN_IF_ERROR(world().AllReduce(&local_ce, &max_ce, 1, DType::kF64, ReduceOp::kMax));
  times->ce_max_rank = std::max(0.0, max_ce);
  times->wait = absl::Now() - wait_start;
  comms_.timer->Take();
  comms_.timer->TakeBusy();
  return absl::OkStatus();
}

double Trainer::LocalMeanCe(const losses::StepStats& stats) const {
  // The display's ce terms are this rank's sum_t w_t l_t / D (§3); over its own weights.
  absl::StatusOr<double> ce = display_.LocalValue("ce");
  if (!ce.ok() || !(stats.local_ce_weight_sum > 0)) return -1;
  return *ce * stats.global_ce_weight_sum / stats.local_ce_weight_sum;
}

absl::StatusOr<StepMetrics> Trainer::MakeRecord(const losses::StepStats& stats,
                                                const losses::StepDisplayValues& display,
                                                double grad_norm, double lr,
                                                const StepTimes& times) {
  StepMetrics r;
  r.set_step(static_cast<int32_t>(step_));  // <= optim.steps, an int32
  GRADSUM_ASSIGN_OR_RETURN(const double ce, display.Value("ce"));
  GRADSUM_ASSIGN_OR_RETURN(const double z, display.Value("z"));
  GRADSUM_ASSIGN_OR_RETURN(const double bal, display.Value("bal"));
  r.set_ce(ce);
  r.set_z(z);
  r.set_bal(bal);
  // §3.2's output z-loss, apart from ce, where the model registered it (alpha_lse > 0);
  // absent otherwise, so that the records of runs without it are unchanged.
  if (absl::StatusOr<double> z_out = display.Value("z_out"); z_out.ok()) r.set_z_out(*z_out);
  r.set_loss(display.total_loss);
  // The further label streams' heads, in stream order (the record's field keeps its name).
  for (const std::string& term : model_->ExtraStreamTerms()) {
    GRADSUM_ASSIGN_OR_RETURN(const double v, display.Value(term));
    r.add_mtp(v);
  }
  r.set_valid_tokens(stats.global_valid_tokens);
  r.set_routed_tokens(stats.global_routed_tokens);
  r.set_grad_norm(grad_norm);
  r.set_lr(lr);
  for (double v : display.maxvio) r.add_maxvio(v);
  for (const std::vector<int64_t>& layer : display.tokens_per_expert) {
    for (int64_t c : layer) r.add_tokens_per_expert(c);
  }
  r.set_step_s(absl::ToDoubleSeconds(absl::Now() - times.start));
  r.set_comm_s(absl::ToDoubleSeconds(times.comm));
  SetCommExposed(times.exposed, &r);
  r.set_peak_unsharded_param_bytes(model_->TakePeakUnshardedBytes());
  r.set_full_param_bytes(model_->FullParamBytes());
  r.set_peak_activation_bytes(model_->TakePeakActivationBytes());
  r.set_peak_head_scratch_bytes(model_->TakePeakHeadScratchBytes());
  r.set_wait_s(absl::ToDoubleSeconds(times.wait));
  r.set_model_s(absl::ToDoubleSeconds(times.model));
  r.set_update_s(absl::ToDoubleSeconds(times.update));
  r.set_tokens_per_s(r.step_s() > 0 ? r.routed_tokens() / r.step_s() : 0);
  r.set_data_s(absl::ToDoubleSeconds(times.data));
  r.set_ce_max_rank(times.ce_max_rank);
  meters_->Fill(&r);
  return r;
}

absl::Status Trainer::RunFirstStepChecks(const NamedParams& weights, const model::ExpertBias& bias,
                                         const std::vector<data::MicroBatch>& batches,
                                         const StepMetrics& record) {
  if (!config_.debug().dump_dir().empty()) {
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(
        world(),
        WriteDump(config_, world().rank(), weights, *first_step_grads_, batches, record, bias),
        "--dump_dir"));
  }
  if (config_.debug().parity_check()) {
    GRADSUM_ASSIGN_OR_RETURN(
        parity_, comms_.parity_check(config_, world(), weights, *first_step_grads_, record, bias));
  }
  return absl::OkStatus();
}

absl::Status Trainer::SaveCheckpointNow() {
  GRADSUM_RETURN_IF_ERROR(SaveRunCheckpoint(config_, world(), *optimizer_, step_, run_id_,
                                            loader_->position(), model_->expert_bias(),
                                            corpus_->ContentFingerprint()));
  saved_step_ = step_;
  return PruneCheckpoints(config_.checkpoint(), world());
}

absl::StatusOr<int> Trainer::AgreeOnStopSignal() {
  const int64_t mine = StopSignal();
  int64_t any = 0;
  GRADSUM_RETURN_IF_ERROR(world().AllReduce(&mine, &any, 1, DType::kI64, ReduceOp::kMax));
  return static_cast<int>(any);
}

absl::Status Trainer::StopOnSignal(int signal, std::ostream* log) {
  const std::string name = absl::StrCat("signal ", signal, " (", ::strsignal(signal), ")");
  std::string saved;
  if (step_ == 0) {
    saved = "no step was done, nothing saved";
  } else {
    if (saved_step_ != step_) GRADSUM_RETURN_IF_ERROR(SaveCheckpointNow());
    saved = absl::StrCat("checkpoint ", CheckpointPath(config_.checkpoint().dir(), step_),
                         " holds them: --resume continues");
  }
  absl::Status stopped = absl::CancelledError(
      absl::StrCat("--save_on_signal: stopped by ", name, " after step ", step_, "; ", saved));
  if (log != nullptr) *log << "moe_lm: " << stopped.message() << std::endl;
  return MarkAgreed(std::move(stopped));
}

void Trainer::SetPeakFlops(std::ostream* log) {
  const double ranks = world().size();
  if (config_.log().peak_tflops() > 0) {
    meters_->SetPeakFlopsPerSecond(config_.log().peak_tflops() * 1e12 * ranks);
    return;
  }
  if (!is_rank0()) return;  // the others' records have mfu 0; rank 0 writes the files
  const int threads = model_->options().num_threads;
  const double per_thread = MeasureGemmFlopsPerThread();
  meters_->SetPeakFlopsPerSecond(per_thread * threads * ranks);
  if (log != nullptr) {
    *log << absl::StrFormat(
                "mfu: peak %.1f GFLOP/s = BLAS GEMM %.1f GFLOP/s per thread (measured now) x %d "
                "threads x %d ranks (--peak_tflops sets a rank's peak instead%s)",
                per_thread * threads * ranks / 1e9, per_thread / 1e9, threads,
                static_cast<int>(ranks),
                config_.comm().backend() == TrainConfig::nccl ? "; a host peak: give a GPU's" : "")
         << std::endl;
  }
}

absl::StatusOr<TrainSummary> Trainer::Run(std::ostream* log) {
  const int64_t first_step = step_ + 1;
  const int64_t steps = config_.optim().steps();
  if (log != nullptr) {
    for (const std::string& note : start_notes_) *log << note << std::endl;
  }
  SetPeakFlops(log);  // before the clock of the ETA starts
  const absl::Time run_start = absl::Now();
  // Rank-local failures (the metrics file, the fault hook) are agreed on at each step
  // boundary: every rank stops together with the failing rank's message.
  absl::Status local = absl::OkStatus();
  while (true) {
    if (local.ok() && step_ < steps) local = MaybeInjectFault(world().rank(), step_ + 1);
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(
        world(), local, step_ < steps ? absl::StrCat("step ", step_ + 1) : "end of training"));
    if (step_ < steps && config_.checkpoint().save_on_signal()) {
      GRADSUM_ASSIGN_OR_RETURN(const int signal, AgreeOnStopSignal());
      if (signal != 0) return StopOnSignal(signal, log);
    }
    if (step_ >= steps) break;
    GRADSUM_ASSIGN_OR_RETURN(StepMetrics r, Step());
    const int eval_every = config_.log().eval_every();
    if (eval_every > 0 && (step_ % eval_every == 0 || step_ == steps)) {
      GRADSUM_ASSIGN_OR_RETURN(const double eval_ce, Evaluate());
      r.set_eval_ce(eval_ce);
      history_.back().set_eval_ce(eval_ce);
    }
    const bool interval =
        step_ == first_step || step_ == steps || step_ % config_.log().every() == 0;
    if (log != nullptr && interval) {
      // The time left at this run's mean step time so far (not before the run's first
      // step is done; none after the last).
      const double per_step = absl::ToDoubleSeconds(absl::Now() - run_start) /
                              static_cast<double>(step_ - first_step + 1);
      *log << StepLogLine(r, steps, step_ < steps ? per_step * (steps - step_) : -1) << std::endl;
    }
    if (metrics_.is_open()) {
      absl::StatusOr<std::string> line = StepJsonLine(r);
      local = line.ok() ? metrics_.WriteLine(*line) : line.status();
    }
    if (tensorboard_.is_open() && local.ok()) {
      tensorboard_.AddStep(r, absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
      if (interval) local = tensorboard_.Flush();  // each log interval
    }
    // After the step's log lines, so a run killed right after a checkpoint has logged
    // every step the checkpoint covers.
    const int every = config_.checkpoint().every();
    if (!config_.checkpoint().dir().empty() &&
        ((every > 0 && step_ % every == 0) || step_ == steps)) {
      GRADSUM_RETURN_IF_ERROR(SaveCheckpointNow());
    }
    if (parity_.has_value() && r.step() == 1) {
      if (log != nullptr && !parity_->params.empty()) *log << parity_->ToString() << std::flush;
      if (!parity_->ok) {
        return MarkAgreed(absl::FailedPreconditionError(
            "--parity_check: step 1 differs from the single-process reference beyond the "
            "tolerance (see the parity lines)"));
      }
    }
  }
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world(), metrics_.Close(), "--metrics"));
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world(), tensorboard_.Close(), "--tensorboard_dir"));
  const std::string& export_path = config_.checkpoint().export_path();
  if (!export_path.empty()) {
    GRADSUM_ASSIGN_OR_RETURN(NamedParams params, model_->GatherFull(/*grads=*/false));
    GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(
        world(),
        is_rank0()
            ? WriteParamsFile(export_path, config_.model(), params, step_, model_->expert_bias())
            : absl::OkStatus(),
        "--export"));
    if (log != nullptr) {
      *log << "exported the parameters of step " << step_ << " to " << export_path << std::endl;
    }
  }
  TrainSummary summary =
      Summarize(history_, first_step, corpus_->EntropyFloorNats(), corpus_->ContextFloorNats());
  summary.parity = parity_;
  if (log != nullptr) *log << summary.ToString() << std::flush;
  return summary;
}

}  // namespace gradsum::train
