#include "train/moe_lm.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/exact_sum.h"
#include "core/grad_sink.h"
#include "core/half.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "losses/linear_cross_entropy.h"
#include "losses/router_losses.h"
#include "sharding/bucketed_reduce.h"
#include "train/layers.h"

namespace gradsum::train {
namespace {

std::string LayerName(int l, const char* what) { return absl::StrCat("layers.", l, ".", what); }
std::string ExpertName(int l, int e, const char* what) {
  return absl::StrCat("layers.", l, ".experts.", e, ".", what);
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

moe::MoeLayerConfig LayerConfig(const ModelConfig& m) {
  moe::MoeLayerConfig c;
  c.d_model = m.dim();
  c.hidden = m.expert_dim();
  c.num_experts = m.experts();
  c.top_k = m.top_k();
  c.norm_topk_prob = m.norm_topk_prob();
  c.router_scale = m.router_scale();
  return c;
}

// The host model's units: FlatParams gathered and reduced over the host communicators.
// Replicated mode reduces through BucketedUnitReducers (one GradBucketer per communicator:
// the world's units, the EDP group's), on the last micro-batch.
class HostUnitStore : public UnitStore {
 public:
  static absl::StatusOr<std::unique_ptr<HostUnitStore>> Create(std::vector<FlatParam*> units,
                                                               const MoeLmOptions& options) {
    auto store = std::unique_ptr<HostUnitStore>(new HostUnitStore());
    store->units_ = units;
    store->bf16_ = options.compute_dtype == DType::kBF16;
    store->widened.resize(units.size());
    store->widened_version_.assign(units.size(), 0);
    store->widened_valid_.assign(units.size(), false);
    if (options.sharding == ShardingMode::kReplicated) {
      GRADSUM_ASSIGN_OR_RETURN(BucketedUnitReducers r,
                               BucketedUnitReducers::Create(units, options.bucket_cap_bytes,
                                                            options.first_bucket_cap_bytes));
      store->reducers_ = std::make_unique<BucketedUnitReducers>(std::move(r));
    }
    return store;
  }

  absl::Status StartGather(int u) override { return units_[u]->StartUnshard(); }

  absl::Status WaitGather(int u) override {
    FlatParam* g = units_[u];
    if (g->unshard_in_flight()) GRADSUM_RETURN_IF_ERROR(g->WaitUnshard());
    if (!g->is_unsharded()) {
      return absl::FailedPreconditionError(
          absl::StrCat("unit ", g->name(), " was not gathered before it was read"));
    }
    if (!bf16_ || (widened_valid_[u] && widened_version_[u] == g->master_version())) {
      return absl::OkStatus();
    }
    // bf16 parameters (halved all-gather traffic); the CPU kernels read them widened to
    // fp32, which is exact.
    std::vector<float>& f32 = widened[u];
    f32.resize(g->numel());
    for (int i = 0; i < g->num_params(); ++i) {
      GRADSUM_ASSIGN_OR_RETURN(TensorView view, g->param(i));
      const BF16* src = view.data<BF16>();
      const FlatParamEntry& e = g->entries()[i];
      for (int64_t k = 0; k < e.numel; ++k) f32[e.offset + k] = src[k].ToFloat();
    }
    widened_valid_[u] = true;
    widened_version_[u] = g->master_version();
    return absl::OkStatus();
  }

  absl::Status Release(int u) override {
    if (bf16_) {
      std::vector<float>().swap(widened[u]);
      widened_valid_[u] = false;
    }
    return units_[u]->Reshard();
  }

  absl::Status StartReduce(int u, bool last_micro_batch) override {
    if (reducers_ == nullptr) return units_[u]->StartGradReduce(last_micro_batch);
    // Replicated: accumulate (no_sync); FlatParam only tidies its buffer (zero padding;
    // exact mode: canonical limbs each micro-batch).
    if (!last_micro_batch) return units_[u]->StartGradReduce(false);
    return reducers_->Ready(u);
  }

  absl::Status WaitReduce(int u) override {
    return reducers_ == nullptr ? units_[u]->FinishGradReduce() : absl::OkStatus();
  }

  absl::Status FinishReductions() override {
    for (FlatParam* g : units_) GRADSUM_RETURN_IF_ERROR(g->FinishGradReduce());
    return reducers_ != nullptr ? reducers_->Finish() : absl::OkStatus();
  }

  int64_t UnshardedBytes() const override {
    int64_t n = 0;
    for (const FlatParam* g : units_) n += g->unsharded_bytes();
    return n;
  }
  int64_t FullBytes() const override {
    int64_t n = 0;
    for (const FlatParam* g : units_) n += g->full_compute_bytes();
    return n;
  }

  std::vector<std::vector<float>> widened;  // per unit, bf16 compute only

 private:
  HostUnitStore() = default;
  std::vector<FlatParam*> units_;
  bool bf16_ = false;
  std::vector<uint64_t> widened_version_;
  std::vector<bool> widened_valid_;
  std::unique_ptr<BucketedUnitReducers> reducers_;  // replicated mode
};

// Reproducible mode: entries [first, first + count) of a unit, back to back, as one exact
// gradient (a single parameter, or moe/experts.h's "all Wg, then all Wu, then all Wd" run of
// one layer's experts). The entries' limb spans are taken on the rank's thread at
// creation; Add only adds into them (exact::AddFloats), so kernels may call it from pool
// threads on disjoint ranges. The rejected-contribution count goes to the unit when the
// sink goes away (before the unit's reduction starts).
class EntriesGradSink : public ExactGradSink {
 public:
  static absl::StatusOr<std::unique_ptr<EntriesGradSink>> Create(FlatParam* unit, int first,
                                                                 int count) {
    auto sink = std::unique_ptr<EntriesGradSink>(new EntriesGradSink(unit));
    for (int i = first; i < first + count; ++i) {
      GRADSUM_ASSIGN_OR_RETURN(absl::Span<int64_t> limbs, unit->exact_grad(i));
      sink->limbs_.push_back(limbs);
    }
    return sink;
  }
  ~EntriesGradSink() override { unit_->CountRejectedExactGrad(rejected_.load()); }

  absl::Status Add(int64_t offset, absl::Span<const float> c) override {
    const int64_t size = static_cast<int64_t>(c.size());
    for (absl::Span<int64_t> limbs : limbs_) {
      if (c.empty()) break;
      const int64_t numel = static_cast<int64_t>(limbs.size()) / exact::kLimbs;
      if (offset >= numel) {
        offset -= numel;
        continue;
      }
      const int64_t n = std::min<int64_t>(numel - offset, static_cast<int64_t>(c.size()));
      int64_t rejected = 0;
      GRADSUM_RETURN_IF_ERROR(exact::AddFloats(
          c.first(n), limbs.subspan(offset * exact::kLimbs, n * exact::kLimbs), &rejected));
      if (rejected > 0) rejected_.fetch_add(rejected);
      c.remove_prefix(n);
      offset = 0;
    }
    if (!c.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("exact gradient of unit ", unit_->name(),
                                                     ": a contribution of ", size,
                                                     " values runs past its entries"));
    }
    return absl::OkStatus();
  }

 private:
  explicit EntriesGradSink(FlatParam* unit) : unit_(unit) {}
  FlatParam* unit_;
  std::vector<absl::Span<int64_t>> limbs_;
  std::atomic<int64_t> rejected_{0};
};

// Adds blocks [b * n, (b + 1) * n) of `blocks` (each one sequence's contribution) to the
// sink's elements [0, n), in block order, split into element ranges over the threads
// (disjoint ranges may be added concurrently, core/grad_sink.h).
absl::Status AddBlocksExact(ExactGradSink& sink, absl::Span<const float> blocks, int64_t n) {
  const int64_t num_blocks = n == 0 ? 0 : static_cast<int64_t>(blocks.size()) / n;
  constexpr int64_t kMinRange = 4096;
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(ComputeThreads(), n / kMinRange));
  return ParallelForStatus(ComputeThreads(), ranges, [&](int64_t r) -> absl::Status {
    const int64_t begin = n * r / ranges, end = n * (r + 1) / ranges;
    for (int64_t b = 0; b < num_blocks; ++b) {
      GRADSUM_RETURN_IF_ERROR(sink.Add(begin, blocks.subspan(b * n + begin, end - begin)));
    }
    return absl::OkStatus();
  });
}

}  // namespace

absl::Status CheckMicroBatchTokens(const MicroBatch& batch, int64_t vocab) {
  if (batch.labels.size() != batch.tokens.size() || batch.mask.size() != batch.tokens.size()) {
    return absl::InvalidArgumentError("micro-batch: tokens, labels and mask differ in length");
  }
  for (size_t t = 0; t < batch.tokens.size(); ++t) {
    if (batch.tokens[t] < 0 || batch.tokens[t] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token ", batch.tokens[t], " at position ",
                                                     t, " outside [0, ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<const float>> MicroBatchTokenWeights(const losses::StepStats& stats,
                                                               int micro_index, int64_t tokens) {
  if (micro_index < 0 || micro_index >= stats.num_micro_batches) {
    return absl::InvalidArgumentError(absl::StrCat("micro_index ", micro_index, " outside [0, ",
                                                   stats.num_micro_batches, ")"));
  }
  if (stats.mode == losses::CeWeightMode::kToken) return absl::Span<const float>();
  if (micro_index >= static_cast<int>(stats.token_weights.size()) ||
      static_cast<int64_t>(stats.token_weights[micro_index].size()) != tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step statistics hold no CE weights for the ", tokens, " tokens of micro-batch ",
        micro_index, " (", losses::CeWeightModeName(stats.mode), " mode)"));
  }
  return absl::MakeConstSpan(stats.token_weights[micro_index]);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> MoeLmParamShapes(const ModelConfig& m) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  const int64_t V = m.vocab(), D = m.dim(), E = m.experts(), H = m.expert_dim();
  shapes.push_back({"emb", {V, D}});
  for (int l = 0; l < m.layers(); ++l) {
    shapes.push_back({LayerName(l, "norm"), {D}});
    shapes.push_back({LayerName(l, "router"), {D, E}});
    for (int e = 0; e < E; ++e) {
      shapes.push_back({ExpertName(l, e, "wg"), {D, H}});
      shapes.push_back({ExpertName(l, e, "wu"), {D, H}});
      shapes.push_back({ExpertName(l, e, "wd"), {H, D}});
    }
  }
  shapes.push_back({"final_norm", {D}});
  shapes.push_back({"out", {D, V}});
  return shapes;
}

absl::StatusOr<std::unique_ptr<MoeLm>> MoeLm::Create(const MoeLmOptions& options,
                                                     const MoeLmGroups& groups) {
  auto model = std::unique_ptr<MoeLm>(new MoeLm());
  GRADSUM_RETURN_IF_ERROR(Init(options, groups, model.get()));
  return model;
}

absl::Status MoeLm::Init(const MoeLmOptions& options, const MoeLmGroups& groups, MoeLm* model) {
  if (groups.world == nullptr || groups.ep_group == nullptr || groups.edp_group == nullptr) {
    return absl::InvalidArgumentError("MoeLm needs the world, EP and EDP communicators");
  }
  const ModelConfig& m = options.model;
  const int P = groups.ep_group->size();
  if (P * groups.edp_group->size() != groups.world->size()) {
    return absl::InvalidArgumentError(absl::StrCat("mesh: ep_group size ", P, " * edp_group size ",
                                                   groups.edp_group->size(), " != world size ",
                                                   groups.world->size()));
  }
  for (const auto& [name, v] : {std::pair<const char*, int>{"vocab", m.vocab()},
                                {"dim", m.dim()},
                                {"layers", m.layers()},
                                {"experts", m.experts()},
                                {"top_k", m.top_k()},
                                {"expert_dim", m.expert_dim()}}) {
    if (v <= 0)
      return absl::InvalidArgumentError(absl::StrCat("model.", name, "=", v, ": must be > 0"));
  }
  if (m.top_k() > m.experts()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.top_k=", m.top_k(), ": exceeds model.experts=", m.experts()));
  }
  if (m.experts() % P != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.experts=", m.experts(), " is not divisible by ep=", P, " (SEMANTICS.md §7)"));
  }
  if (options.layers_per_unit < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers_per_unit=", options.layers_per_unit, ": must be >= 1"));
  }
  model->options_ = options;
  model->comm_ = groups;
  model->ep_rank_ = groups.ep_group->rank();
  FlatParamOptions fp_options;
  fp_options.mode = options.sharding;
  fp_options.compute_dtype = options.compute_dtype;
  fp_options.reduce_dtype = options.reduce_dtype;
  fp_options.reduce_every_micro_batch = options.reduce_every_micro_batch;
  fp_options.exact_grads = options.reproducible;

  const int64_t V = m.vocab(), D = m.dim(), E = m.experts(), H = m.expert_dim();
  const int L = m.layers(), k = options.layers_per_unit;
  const int local = m.experts() / P, first = model->ep_rank_ * local;
  auto add_unit = [&](std::string name, std::vector<ParamSpec> specs, bool expert) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(
        std::unique_ptr<FlatParam> unit,
        FlatParam::Create(std::move(name), std::move(specs),
                          expert ? groups.edp_group : groups.world, fp_options));
    model->units_.push_back(std::move(unit));
    model->expert_unit_.push_back(expert);
    return absl::OkStatus();
  };
  const int emb_unit = 0;
  model->emb_ = {emb_unit, 0};
  GRADSUM_RETURN_IF_ERROR(add_unit("emb", {{"emb", {V, D}}}, false));
  std::vector<std::vector<int>> stage_units = {{emb_unit}};
  model->norm_.resize(L);
  model->router_.resize(L);
  model->gate_.resize(L);
  for (int a = 0; a < L; a += k) {
    const int b = std::min(L, a + k) - 1;
    const std::string name =
        a == b ? absl::StrCat("layers.", a) : absl::StrCat("layers.", a, "-", b);
    const int dense_unit = static_cast<int>(model->units_.size());
    const int expert_unit = dense_unit + 1;
    std::vector<ParamSpec> dense, experts;
    for (int l = a; l <= b; ++l) {
      model->norm_[l] = {dense_unit, static_cast<int>(dense.size())};
      dense.push_back({LayerName(l, "norm"), {D}});
      model->router_[l] = {dense_unit, static_cast<int>(dense.size())};
      dense.push_back({LayerName(l, "router"), {D, E}});
      // This EP slot's experts, stacked per kind so moe/experts.h sees [E/P, ...] blocks.
      model->gate_[l] = {expert_unit, static_cast<int>(experts.size())};
      for (const char* kind : {"wg", "wu", "wd"}) {
        for (int j = 0; j < local; ++j) {
          const bool down = std::string(kind) == "wd";
          experts.push_back({ExpertName(l, first + j, kind),
                             down ? std::vector<int64_t>{H, D} : std::vector<int64_t>{D, H}});
        }
      }
      stage_units.push_back({dense_unit, expert_unit});
    }
    GRADSUM_RETURN_IF_ERROR(add_unit(name, std::move(dense), false));
    GRADSUM_RETURN_IF_ERROR(
        add_unit(absl::StrCat(name, ".experts.ep", model->ep_rank_), std::move(experts), true));
  }
  const int head_unit = static_cast<int>(model->units_.size());
  model->final_norm_ = {head_unit, 0};
  model->out_ = {head_unit, 1};
  GRADSUM_RETURN_IF_ERROR(add_unit("head", {{"final_norm", {D}}, {"out", {D, V}}}, false));
  stage_units.push_back({head_unit});
  // Every stage's backward reads its parameters except the embedding's (a scatter-add).
  std::vector<bool> backward_reads(stage_units.size(), true);
  backward_reads[0] = false;
  UnitScheduleOptions schedule_options;
  schedule_options.sharded = options.sharding == ShardingMode::kSharded;
  schedule_options.reshard_after_forward = options.reshard_after_forward;
  GRADSUM_ASSIGN_OR_RETURN(
      model->schedule_,
      UnitSchedule::Create(static_cast<int>(model->units_.size()), std::move(stage_units),
                           std::move(backward_reads), schedule_options));
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<HostUnitStore> store,
                           HostUnitStore::Create(model->groups(), options));
  model->widened_ = &store->widened;
  model->store_ = std::move(store);
  model->layer_state_.resize(m.layers());
  return absl::OkStatus();
}

MoeLm::ParamRef MoeLm::up_ref(int layer) const {
  const int local = options_.model.experts() / comm_.ep_group->size();
  return {gate_[layer].unit, gate_[layer].index + local};
}
MoeLm::ParamRef MoeLm::down_ref(int layer) const {
  const int local = options_.model.experts() / comm_.ep_group->size();
  return {gate_[layer].unit, gate_[layer].index + 2 * local};
}

NamedParams MoeLm::InitialParameters(const ModelConfig& m, uint64_t seed) {
  SplitMix64 rng(MixSeed(seed, 0x696e6974ull));
  NamedParams params;
  for (const auto& [name, shape] : MoeLmParamShapes(m)) {
    std::vector<float>& v = params[name];
    v.resize(NumElements(shape));
    const bool gain = name == "final_norm" || absl::EndsWith(name, ".norm");
    for (float& x : v) {
      if (gain) {
        x = 1.0f;
      } else if (name == "emb") {
        x = static_cast<float>(rng.Normal());
      } else {
        x = static_cast<float>(rng.Normal() * m.init_std());
      }
    }
  }
  return params;
}

std::vector<FlatParam*> MoeLm::groups() {
  std::vector<FlatParam*> g;
  for (auto& u : units_) g.push_back(u.get());
  return g;
}

absl::Status MoeLm::SetFullParameters(const NamedParams& params) {
  for (FlatParam* g : groups()) {
    for (int i = 0; i < g->num_params(); ++i) {
      const FlatParamEntry& entry = g->entries()[i];
      auto it = params.find(entry.name);
      if (it == params.end()) {
        return absl::InvalidArgumentError(absl::StrCat("missing parameter ", entry.name));
      }
      if (static_cast<int64_t>(it->second.size()) != entry.numel) {
        return absl::InvalidArgumentError(absl::StrCat("parameter ", entry.name, " has ",
                                                       it->second.size(), " elements, expected ",
                                                       entry.numel));
      }
      GRADSUM_RETURN_IF_ERROR(g->SetFullValue(i, it->second));
    }
    GRADSUM_RETURN_IF_ERROR(g->MasterUpdated());
  }
  return absl::OkStatus();
}

absl::Status MoeLm::Unshard() {
  // Units are gathered by the schedule as the stages need them; the master's changes
  // already dropped every stale compute buffer (FlatParam::MasterUpdated).
  return absl::OkStatus();
}

const float* MoeLm::Param(ParamRef ref) {
  FlatParam* g = units_[ref.unit].get();
  if (options_.compute_dtype == DType::kBF16) {
    return (*widened_)[ref.unit].data() + g->entries()[ref.index].offset;
  }
  return g->param(ref.index)->data<float>();
}

absl::StatusOr<float*> MoeLm::Grad(ParamRef ref) {
  GRADSUM_ASSIGN_OR_RETURN(TensorView view, units_[ref.unit]->grad(ref.index));
  return view.data<float>();
}

absl::Status MoeLm::FinishGradReduce() {
  GRADSUM_RETURN_IF_ERROR(CheckStepReducible());
  return schedule_.FinishStep(*store_);
}

absl::Status MoeLm::RegisterDisplayTerms(losses::StepDisplay* display) {
  for (const char* term : {"ce", "z", "bal"}) GRADSUM_RETURN_IF_ERROR(display->RegisterTerm(term));
  return absl::OkStatus();
}

absl::StatusOr<MicroBatchLosses> MoeLm::ForwardBackward(const MicroBatch& batch,
                                                        const losses::StepStats& stats,
                                                        int micro_index,
                                                        losses::StepDisplay* display) {
  // The GEMMs below (router, experts) use this rank's thread budget.
  ScopedComputeThreads compute_threads(options_.num_threads);
  const ModelConfig& m = options_.model;
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  const int64_t D = m.dim(), V = m.vocab(), E = m.experts();
  const int L = m.layers(), K = m.top_k();
  GRADSUM_RETURN_IF_ERROR(CheckMicroBatchTokens(batch, V));
  GRADSUM_ASSIGN_OR_RETURN(absl::Span<const float> token_weights,
                           MicroBatchTokenWeights(stats, micro_index, T));
  std::vector<uint8_t> mask(batch.mask.begin(), batch.mask.end());
  std::vector<int64_t> labels(batch.labels.begin(), batch.labels.end());
  const bool repro = options_.reproducible;
  // Reproducible mode: the micro-batch's packed sequences (row blocks of S tokens).
  const int64_t S = batch.seq_len, J = batch.batch;
  if (repro && (S < 1 || J * S != T)) {
    return absl::InvalidArgumentError(absl::StrCat("reproducible mode: micro-batch of ", T,
                                                   " tokens is not ", J, " sequences of ", S));
  }
  moe::MoeLayerConfig layer_config = LayerConfig(m);
  if (repro) layer_config.row_block = S;
  const int local = m.experts() / comm_.ep_group->size();
  const int64_t expert_block = local * D * m.expert_dim();

  auto layer_weights = [&](int l) {
    moe::MoeLayerWeights w;
    w.router = absl::MakeConstSpan(Param(router_[l]), D * E);
    w.local_experts.gate = absl::MakeConstSpan(Param(gate_ref(l)), expert_block);
    w.local_experts.up = absl::MakeConstSpan(Param(up_ref(l)), expert_block);
    w.local_experts.down = absl::MakeConstSpan(Param(down_ref(l)), expert_block);
    return w;
  };

  // Buffers kept across micro-batches (buffers_); each is overwritten before it is read,
  // dh is zeroed here (the head's norm backward adds into it).
  MicroBatchBuffers& b = buffers_;
  std::vector<float>& h = b.h;
  std::vector<float>& y = b.y;
  std::vector<float>& dh = b.dh;
  std::vector<float>& du = b.du;
  std::vector<float>& da = b.da;
  std::vector<std::vector<float>>& h_in = b.h_in;
  std::vector<std::vector<float>>& a = b.a;
  std::vector<std::vector<float>>& inv_rms = b.inv_rms;
  h.resize(T * D);
  y.resize(T * D);
  dh.assign(T * D, 0.0f);
  du.resize(T * E);
  da.resize(T * D);
  h_in.resize(L);
  a.resize(L);
  inv_rms.resize(L);
  std::vector<losses::ExpertCountReduction> counts;
  counts.reserve(L);
  MicroBatchLosses result;
  auto sink = [&](ParamRef ref, int count = 1) {
    return EntriesGradSink::Create(units_[ref.unit].get(), ref.index, count);
  };
  // Reproducible mode: RMSNorm backward per sequence, the gain's share of each into its
  // own row of scratch, then added exactly.
  std::vector<float> dgain_blocks;
  auto norm_backward = [&](absl::Span<const float> x, ParamRef gain, absl::Span<const float> r,
                           absl::Span<const float> d_out) -> absl::Status {
    const float* g = Param(gain);
    if (!repro) {
      GRADSUM_ASSIGN_OR_RETURN(float* grad_gain, Grad(gain));
      RmsNormBackward(x, absl::MakeConstSpan(g, D), r, d_out, T, D, absl::MakeSpan(dh),
                      absl::MakeSpan(grad_gain, D));
      return absl::OkStatus();
    }
    dgain_blocks.assign(J * D, 0.0f);
    GRADSUM_RETURN_IF_ERROR(ParallelForStatus(ComputeThreads(), J, [&](int64_t q) {
      RmsNormBackward(x.subspan(q * S * D, S * D), absl::MakeConstSpan(g, D),
                      r.subspan(q * S, S), d_out.subspan(q * S * D, S * D),
                      S, D, absl::MakeSpan(dh).subspan(q * S * D, S * D),
                      absl::MakeSpan(dgain_blocks).subspan(q * D, D));
      return absl::OkStatus();
    }));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<EntriesGradSink> gain_sink, sink(gain));
    return AddBlocksExact(*gain_sink, dgain_blocks, D);
  };
  // Display terms: per sequence in reproducible mode (the exact display sums then give the
  // same bits at every mesh), else one value per micro-batch.
  std::vector<double> seq_ce, seq_z, seq_bal;

  // Stage 0: embedding; 1 + l: layer l; L + 1: the head (forward and backward).
  auto forward = [&](int stage) -> absl::Status {
    if (stage == 0) {
      EmbeddingForward(absl::MakeConstSpan(Param(emb_), V * D), batch.tokens, D,
                       absl::MakeSpan(h));
      return absl::OkStatus();
    }
    if (stage <= L) {
      const int l = stage - 1;
      h_in[l] = h;
      a[l].resize(T * D);
      inv_rms[l].resize(T);
      RmsNormForward(h, absl::MakeConstSpan(Param(norm_[l]), D), T, D, absl::MakeSpan(a[l]),
                     absl::MakeSpan(inv_rms[l]));
      GRADSUM_RETURN_IF_ERROR(moe::MoeLayerForward(*comm_.ep_group, layer_config,
                                                   layer_weights(l), a[l], mask,
                                                   absl::MakeSpan(y), &layer_state_[l]));
      // c[l, m, :] of §5 travels while the next layers compute.
      GRADSUM_ASSIGN_OR_RETURN(losses::ExpertCountReduction c,
                               losses::ExpertCountReduction::Start(
                                   *comm_.world, layer_state_[l].route.local_expert_counts, K));
      counts.push_back(std::move(c));
      for (int64_t i = 0; i < T * D; ++i) h[i] += y[i];
      return absl::OkStatus();
    }
    // The head: final norm, fused LM-head matmul + CE forward and backward (§3), and the
    // final norm's backward.
    std::vector<float>& f = b.f;
    std::vector<float>& inv_rms_final = b.inv_rms_final;
    std::vector<float>& grad_f = b.grad_f;
    f.resize(T * D);
    inv_rms_final.resize(T);
    grad_f.resize(T * D);
    const float* final_norm = Param(final_norm_);
    RmsNormForward(h, absl::MakeConstSpan(final_norm, D), T, D, absl::MakeSpan(f),
                   absl::MakeSpan(inv_rms_final));
    GRADSUM_ASSIGN_OR_RETURN(
        TensorView head_view,
        TensorView::Create(const_cast<float*>(Param(out_)), DType::kF32, {D, V}));
    // The fused head over rows [r0, r0 + rows), its head gradient added into grad_head.
    auto head = [&](int64_t r0, int64_t rows, float* grad_head,
                    const losses::LinearCrossEntropyOptions& ce_options)
        -> absl::StatusOr<double> {
      GRADSUM_ASSIGN_OR_RETURN(TensorView f_view,
                               TensorView::Create(f.data() + r0 * D, DType::kF32, {rows, D}));
      GRADSUM_ASSIGN_OR_RETURN(
          TensorView grad_f_view,
          TensorView::Create(grad_f.data() + r0 * D, DType::kF32, {rows, D}));
      GRADSUM_ASSIGN_OR_RETURN(TensorView grad_head_view,
                               TensorView::Create(grad_head, DType::kF32, {D, V}));
      GRADSUM_ASSIGN_OR_RETURN(
          losses::LinearCrossEntropyResult ce,
          losses::LinearCrossEntropyForwardBackward(
              f_view, head_view, absl::MakeConstSpan(labels).subspan(r0, rows),
              token_weights.empty() ? token_weights : token_weights.subspan(r0, rows),
              stats.global_ce_weight_sum, grad_f_view, grad_head_view, ce_options));
      return ce.ce.local_loss;
    };
    losses::LinearCrossEntropyOptions ce_options;
    if (!repro) {
      ce_options.num_threads = options_.num_threads;
      GRADSUM_ASSIGN_OR_RETURN(float* grad_out, Grad(out_));
      GRADSUM_ASSIGN_OR_RETURN(result.ce, head(0, T, grad_out, ce_options));
    } else {
      // One sequence per call, single-threaded, one chunk: the same GEMMs at every mesh.
      ce_options.num_threads = 1;
      ce_options.chunk_rows = S;
      std::vector<float> grad_head_blocks(J * D * V, 0.0f);
      seq_ce.assign(J, 0.0);
      GRADSUM_RETURN_IF_ERROR(ParallelForStatus(ComputeThreads(), J, [&](int64_t q) -> absl::Status {
        GRADSUM_ASSIGN_OR_RETURN(seq_ce[q],
                                 head(q * S, S, grad_head_blocks.data() + q * D * V, ce_options));
        return absl::OkStatus();
      }));
      GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<EntriesGradSink> out_sink, sink(out_));
      GRADSUM_RETURN_IF_ERROR(AddBlocksExact(*out_sink, grad_head_blocks, D * V));
      for (double v : seq_ce) result.ce += v;
    }
    return norm_backward(h, final_norm_, inv_rms_final, grad_f);
  };

  auto backward = [&](int stage) -> absl::Status {
    if (stage == 0) {
      if (!repro) {
        GRADSUM_ASSIGN_OR_RETURN(float* grad_emb, Grad(emb_));
        EmbeddingBackward(batch.tokens, dh, D, absl::MakeSpan(grad_emb, V * D));
        return absl::OkStatus();
      }
      // Per sequence: each token's rows summed in token order, then added exactly.
      GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<EntriesGradSink> emb_sink, sink(emb_));
      std::vector<float> rows(V * D);
      std::vector<uint8_t> seen(V);
      for (int64_t q = 0; q < J; ++q) {
        std::fill(seen.begin(), seen.end(), 0);
        for (int64_t t = q * S; t < (q + 1) * S; ++t) {
          const int32_t v = batch.tokens[t];
          float* row = rows.data() + static_cast<int64_t>(v) * D;
          if (!seen[v]) std::fill(row, row + D, 0.0f);
          seen[v] = 1;
          for (int64_t i = 0; i < D; ++i) row[i] += dh[t * D + i];
        }
        for (int64_t v = 0; v < V; ++v) {
          if (seen[v]) {
            GRADSUM_RETURN_IF_ERROR(
                emb_sink->Add(v * D, absl::MakeConstSpan(rows).subspan(v * D, D)));
          }
        }
      }
      return absl::OkStatus();
    }
    const int l = stage - 1;
    moe::RouterOutput& route = layer_state_[l].route;
    std::fill(du.begin(), du.end(), 0.0f);
    GRADSUM_ASSIGN_OR_RETURN(absl::Span<const int64_t> global_counts, counts[l].Wait());
    // The z and balancing losses of rows [r0, r0 + rows) (row-wise gradients; the loss
    // values are sums over the rows).
    auto router_losses = [&](int64_t r0, int64_t rows, double* z, double* bal) -> absl::Status {
      GRADSUM_ASSIGN_OR_RETURN(
          TensorView u, TensorView::Create(route.logits.data() + r0 * E, DType::kF32, {rows, E}));
      GRADSUM_ASSIGN_OR_RETURN(TensorView du_view,
                               TensorView::Create(du.data() + r0 * E, DType::kF32, {rows, E}));
      const auto m_rows = absl::MakeConstSpan(mask).subspan(r0, rows);
      GRADSUM_ASSIGN_OR_RETURN(*z, losses::RouterZLossForwardBackward(
                                       u, m_rows, stats.global_routed_tokens, options_.alpha_z,
                                       du_view));
      GRADSUM_ASSIGN_OR_RETURN(*bal, losses::LoadBalancingLossForwardBackward(
                                         u, m_rows, global_counts, K, stats.num_micro_batches,
                                         options_.alpha_b, du_view));
      return absl::OkStatus();
    };
    if (!repro) {
      double z = 0, bal = 0;
      GRADSUM_RETURN_IF_ERROR(router_losses(0, T, &z, &bal));
      result.z += z;
      result.bal += bal;
    } else {
      for (int64_t q = 0; q < J; ++q) {
        double z = 0, bal = 0;
        GRADSUM_RETURN_IF_ERROR(router_losses(q * S, S, &z, &bal));
        seq_z.push_back(z);
        seq_bal.push_back(bal);
        result.z += z;
        result.bal += bal;
      }
    }
    if (display != nullptr)
      GRADSUM_RETURN_IF_ERROR(display->AddGlobalExpertCounts(l, global_counts));

    std::fill(da.begin(), da.end(), 0.0f);
    moe::MoeLayerGrads grads;
    std::unique_ptr<EntriesGradSink> router_sink, experts_sink;
    if (repro) {
      GRADSUM_ASSIGN_OR_RETURN(router_sink, sink(router_[l]));
      GRADSUM_ASSIGN_OR_RETURN(experts_sink, sink(gate_ref(l), 3 * local));
      grads.router_exact = router_sink.get();
      grads.local_experts.exact = experts_sink.get();
    } else {
      GRADSUM_ASSIGN_OR_RETURN(float* grad_router, Grad(router_[l]));
      GRADSUM_ASSIGN_OR_RETURN(float* grad_gate, Grad(gate_ref(l)));
      GRADSUM_ASSIGN_OR_RETURN(float* grad_up, Grad(up_ref(l)));
      GRADSUM_ASSIGN_OR_RETURN(float* grad_down, Grad(down_ref(l)));
      grads.router = absl::MakeSpan(grad_router, D * E);
      grads.local_experts.gate = absl::MakeSpan(grad_gate, expert_block);
      grads.local_experts.up = absl::MakeSpan(grad_up, expert_block);
      grads.local_experts.down = absl::MakeSpan(grad_down, expert_block);
    }
    moe::RouterLossGrads loss_grads;
    loss_grads.d_logits = du;
    // h_out = h_in + y: dL/dy = dL/dh_out, and dL/dh_in = dL/dh_out + the norm branch.
    GRADSUM_RETURN_IF_ERROR(moe::MoeLayerBackward(*comm_.ep_group, layer_config, layer_weights(l),
                                                  a[l], layer_state_[l], dh, loss_grads,
                                                  absl::MakeSpan(da), grads));
    return norm_backward(h_in[l], norm_[l], inv_rms[l], da);
  };

  GRADSUM_RETURN_IF_ERROR(schedule_.RunMicroBatch(
      *store_, {forward, backward}, micro_index == stats.num_micro_batches - 1));
  if (display != nullptr && !repro) {
    GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("ce", result.ce));
    GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("z", result.z));
    GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("bal", result.bal));
  } else if (display != nullptr) {
    for (const auto& [name, values] : {std::pair<const char*, const std::vector<double>*>{
                                           "ce", &seq_ce},
                                       {"z", &seq_z},
                                       {"bal", &seq_bal}}) {
      for (double v : *values) GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm(name, v));
    }
  }
  return result;
}

absl::StatusOr<NamedParams> MoeLm::GatherFull(bool grads) {
  const auto shapes = MoeLmParamShapes(options_.model);
  std::map<std::string, int64_t> offset;
  int64_t total = 0;
  for (const auto& [name, shape] : shapes) {
    offset[name] = total;
    total += NumElements(shape);
  }
  std::vector<float> all(total, 0.0f);
  const int world_rank = comm_.world->rank();
  const int P = comm_.ep_group->size();
  for (size_t u = 0; u < units_.size(); ++u) {
    FlatParam* g = units_[u].get();
    absl::Span<const float> owned = grads ? g->owned_grad() : g->owned_master();
    std::vector<float> send(g->shard_numel(), 0.0f);
    std::copy(owned.begin(), owned.end(), send.begin());
    std::vector<float> full(g->shard_numel() * g->group_size());
    GRADSUM_RETURN_IF_ERROR(
        g->group()->AllGather(send.data(), full.data(), g->shard_numel(), DType::kF32));
    // One writer per parameter: world rank 0 for dense values, the f == 0 rank of each EP
    // slot for its experts. Everyone else adds zeros, so the SUM below is exact.
    const bool writer = expert_unit_[u] ? world_rank < P : world_rank == 0;
    if (!writer) continue;
    for (const FlatParamEntry& e : g->entries()) {
      std::copy(full.begin() + e.offset, full.begin() + e.offset + e.numel,
                all.begin() + offset.at(e.name));
    }
  }
  GRADSUM_RETURN_IF_ERROR(
      comm_.world->AllReduce(all.data(), all.data(), all.size(), DType::kF32, ReduceOp::kSum));
  NamedParams out;
  for (const auto& [name, shape] : shapes) {
    out[name].assign(all.begin() + offset.at(name),
                     all.begin() + offset.at(name) + NumElements(shape));
  }
  return out;
}

}  // namespace gradsum::train
