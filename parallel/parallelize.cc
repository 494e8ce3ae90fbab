#include "parallel/parallelize.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "parallel/host_unit_store.h"

namespace gradsum::parallel {

absl::StatusOr<std::unique_ptr<UnitStore>> HostUnitDevice::MakeStore(
    std::vector<FlatParam*> units, std::vector<bool> /*expert_unit*/,
    const ParallelOptions& options) {
  return MakeHostUnitStore(std::move(units), options);
}

ParallelParams::~ParallelParams() = default;

absl::StatusOr<std::unique_ptr<ParallelParams>> Parallelize(const model::MoeLmSpec& spec,
                                                            const Mesh& mesh,
                                                            const ParallelOptions& options,
                                                            UnitDevice& device) {
  const int P = mesh.ep_size();
  const model::MoeLmConfig& m = spec.config();
  if (m.experts % P != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.experts=", m.experts, " is not divisible by ep=", P, " (SEMANTICS.md §7)"));
  }
  if (mesh.hsdp() && options.sharding != ShardingMode::kSharded) {
    return absl::InvalidArgumentError(absl::StrCat("mesh: HSDP groups with sharding ",
                                                   ShardingModeName(options.sharding),
                                                   " (HSDP shards inside a group: sharded only)"));
  }
  if (options.repro_block < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("repro_block=", options.repro_block, ": must be >= 0"));
  }
  if (options.layers_per_unit < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers_per_unit=", options.layers_per_unit, ": must be >= 1"));
  }
  auto params = std::unique_ptr<ParallelParams>(new ParallelParams());
  ParallelParams& pp = *params;
  pp.spec_ = spec;
  pp.options_ = options;
  pp.mesh_ = &mesh;
  const int ep_rank = mesh.p_index();
  const int local = m.experts / P, first = ep_rank * local;
  pp.local_experts_ = local;
  pp.first_local_expert_ = first;
  const FlatParamOptions fp_options = options.flat_param_options();
  const std::vector<model::ParamDef>& defs = spec.params();
  pp.dense_.assign(defs.size(), {});
  pp.experts_.assign(spec.moe_layers(), {});

  // Units from the spec's parameters: `params` (indices into defs) in this order.
  auto add_unit = [&](std::string name, const std::vector<int>& members,
                      bool expert) -> absl::Status {
    std::vector<ParamSpec> specs;
    for (int p : members) specs.push_back({defs[p].name, defs[p].shape});
    // §7: reduced over the world (dense) or the EDP group (experts); with HSDP over the
    // shard groups, then across their replicas.
    Communicator* group = &mesh.group(expert ? MeshAxis::kEdpShard : MeshAxis::kDpShard);
    FlatParamOptions unit_options = fp_options;
    if (mesh.hsdp()) {
      unit_options.replica_group =
          &mesh.group(expert ? MeshAxis::kEdpReplicate : MeshAxis::kDpReplicate);
    }
    GRADSUM_ASSIGN_OR_RETURN(
        std::unique_ptr<FlatParam> unit,
        FlatParam::Create(std::move(name), std::move(specs), group, unit_options));
    const int u = static_cast<int>(pp.units_.size());
    for (size_t i = 0; i < members.size(); ++i) {
      if (!expert) pp.dense_[members[i]] = {u, static_cast<int>(i), 1};
    }
    pp.units_.push_back(std::move(unit));
    pp.expert_unit_.push_back(expert);
    return absl::OkStatus();
  };
  const int L = m.layers, k = options.layers_per_unit;
  // Layer l's dense parameters into `dense`, this EP slot's experts stacked per matrix into
  // `experts` (recording where they start in `expert_unit`).
  auto add_layer_params = [&](int l, int expert_unit, std::vector<int>& dense,
                              std::vector<int>& experts) {
    if (m.attention) {
      for (int p : {spec.attn_norm(l), spec.wq(l), spec.wk(l), spec.wv(l), spec.wo(l)}) {
        dense.push_back(p);
      }
    }
    dense.push_back(spec.norm(l));
    dense.push_back(spec.router(l));
    pp.experts_[l] = {expert_unit, static_cast<int>(experts.size()),
                      model::kNumExpertMatrices * local};
    for (int mat = 0; mat < model::kNumExpertMatrices; ++mat) {
      for (int j = 0; j < local; ++j) {
        experts.push_back(spec.expert_param(l, first + j, static_cast<model::ExpertMatrix>(mat)));
      }
    }
  };
  std::vector<std::vector<int>> stage_units;
  // The embedding.
  stage_units.push_back({0});
  GRADSUM_RETURN_IF_ERROR(add_unit("emb", {spec.emb()}, false));
  // Layers a..b: their dense parameters, then this EP slot's experts stacked per layer and
  // per matrix, so moe/experts.h sees [E/P, ...] blocks.
  for (int a = 0; a < L; a += k) {
    const int b = std::min(L, a + k) - 1;
    const std::string name =
        a == b ? absl::StrCat("layers.", a) : absl::StrCat("layers.", a, "-", b);
    const int dense_unit = static_cast<int>(pp.units_.size());
    const int expert_unit = dense_unit + 1;
    std::vector<int> dense, experts;
    for (int l = a; l <= b; ++l) {
      add_layer_params(l, expert_unit, dense, experts);
      stage_units.push_back({dense_unit, expert_unit});
    }
    GRADSUM_RETURN_IF_ERROR(add_unit(name, dense, false));
    GRADSUM_RETURN_IF_ERROR(add_unit(absl::StrCat(name, ".experts.ep", ep_rank), experts, true));
  }
  // The blocks between the layers and the head (MoeLmSpec::extra_blocks): one dense unit
  // (the block's own parameters, then its layer's) and one expert unit each, whatever
  // layers_per_unit is.
  for (const model::MoeLmSpec::ExtraBlock& block : spec.extra_blocks()) {
    const int dense_unit = static_cast<int>(pp.units_.size());
    const int expert_unit = dense_unit + 1;
    std::vector<int> dense = block.dense;
    std::vector<int> experts;
    add_layer_params(block.layer, expert_unit, dense, experts);
    stage_units.push_back({dense_unit, expert_unit});
    GRADSUM_RETURN_IF_ERROR(add_unit(block.name, dense, false));
    GRADSUM_RETURN_IF_ERROR(
        add_unit(absl::StrCat(block.name, ".experts.ep", ep_rank), experts, true));
  }
  // The head.
  const int head_unit = static_cast<int>(pp.units_.size());
  GRADSUM_RETURN_IF_ERROR(add_unit("head", {spec.final_norm(), spec.out()}, false));
  stage_units.push_back({head_unit});

  std::vector<bool> backward_reads;
  for (const model::StageDef& s : spec.stages()) backward_reads.push_back(s.backward_reads_params);
  UnitScheduleOptions schedule_options;
  schedule_options.sharded = options.sharding == ShardingMode::kSharded;
  schedule_options.reshard_after_forward = options.reshard_after_forward;
  GRADSUM_ASSIGN_OR_RETURN(
      pp.schedule_, UnitSchedule::Create(static_cast<int>(pp.units_.size()), std::move(stage_units),
                                         std::move(backward_reads), schedule_options));
  GRADSUM_ASSIGN_OR_RETURN(pp.store_, device.MakeStore(pp.units(), pp.expert_unit_, options));
  return params;
}

const float* ParallelParams::Values(int p) {
  const Ref& r = dense_[p];
  return store_->Values(r.unit, r.index);
}

absl::StatusOr<GradTarget> ParallelParams::Grad(int p) {
  const Ref& r = dense_[p];
  if (r.unit < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter ", spec_.params()[p].name, " is an expert's: use the layer's"));
  }
  return store_->Grad(r.unit, r.index, r.count);
}

const float* ParallelParams::LocalExperts(int layer) {
  const Ref& r = experts_[layer];
  return store_->Values(r.unit, r.index);
}

absl::StatusOr<GradTarget> ParallelParams::LocalExpertsGrad(int layer) {
  const Ref& r = experts_[layer];
  return store_->Grad(r.unit, r.index, r.count);
}

int64_t ParallelParams::RowBlock(int64_t local_seq_len) const {
  if (!IsExact(options_.precision)) return 0;
  return options_.repro_block > 0 ? options_.repro_block : local_seq_len;
}

absl::Status ParallelParams::RunMicroBatch(const model::StageFns& stages, bool last_micro_batch) {
  GRADSUM_RETURN_IF_ERROR(store_->CheckMicroBatch());
  UnitSchedule::Stages s{stages.forward, stages.backward};
  absl::Status status = schedule_.RunMicroBatch(*store_, s, last_micro_batch);
  if (!status.ok()) store_->MicroBatchFailed();
  return status;
}

absl::Status ParallelParams::RunForward(const model::StageFns& stages) {
  GRADSUM_RETURN_IF_ERROR(store_->CheckMicroBatch());
  return schedule_.RunForward(*store_, stages.forward);
}

std::vector<FlatParam*> ParallelParams::units() const {
  std::vector<FlatParam*> g;
  for (const auto& u : units_) g.push_back(u.get());
  return g;
}

absl::Status ParallelParams::SetFullParameters(const NamedParams& params) {
  for (FlatParam* g : units()) {
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

absl::StatusOr<NamedParams> ParallelParams::GatherFull(bool grads) {
  const std::vector<model::ParamDef>& defs = spec_.params();
  std::map<std::string, int64_t> offset;
  int64_t total = 0;
  for (const model::ParamDef& d : defs) {
    offset[d.name] = total;
    total += d.numel();
  }
  std::vector<float> all(total, 0.0f);
  const int world_rank = mesh_->world().rank();
  const int P = mesh_->ep_size();
  for (size_t u = 0; u < units_.size(); ++u) {
    FlatParam* g = units_[u].get();
    // What the rank holds of its group's split: the shard (sharded, HSDP), or the slice it
    // owns (replicated); gathered over the group, either gives the whole unit.
    const bool sharded = g->options().mode == ShardingMode::kSharded;
    absl::Span<const float> owned = grads ? g->owned_grad() : g->owned_master();
    if (sharded) owned = grads ? g->master_grad() : g->master();
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
      mesh_->world().AllReduce(all.data(), all.data(), all.size(), DType::kF32, ReduceOp::kSum));
  NamedParams out;
  for (const model::ParamDef& d : defs) {
    out[d.name].assign(all.begin() + offset.at(d.name),
                       all.begin() + offset.at(d.name) + d.numel());
  }
  return out;
}

}  // namespace gradsum::parallel
