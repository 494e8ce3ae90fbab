#include "parallel/bucketed_reduce.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/grad_precision.h"
#include "core/status.h"

namespace gradsum {

absl::StatusOr<std::unique_ptr<BucketedGradReducer>> BucketedGradReducer::Create(
    std::vector<FlatParam*> groups, size_t bucket_cap_bytes, size_t first_bucket_cap_bytes,
    const BucketedGradDevice* device) {
  if (groups.empty()) return absl::InvalidArgumentError("BucketedGradReducer: no groups");
  for (const FlatParam* g : groups) {
    if (g == nullptr) return absl::InvalidArgumentError("BucketedGradReducer: null group");
    if (g->options().mode != ShardingMode::kReplicated) {
      return absl::InvalidArgumentError(
          absl::StrCat("BucketedGradReducer: group \"", g->name(), "\" is not replicated"));
    }
    // The norm and the trainer take exact and fp32 groups as different runs: one reducer
    // holds one kind (f32 and bf16 wire may mix, in buckets of their own dtype).
    if (IsExact(g->precision()) != IsExact(groups[0]->precision())) {
      return absl::InvalidArgumentError(
          absl::StrCat("BucketedGradReducer: group \"", g->name(), "\" has precision ",
                       GradPrecisionName(g->precision()), " but \"", groups[0]->name(), "\" has ",
                       GradPrecisionName(groups[0]->precision())));
    }
    if (g->group() != groups[0]->group()) {
      return absl::InvalidArgumentError(absl::StrCat("BucketedGradReducer: group \"", g->name(),
                                                     "\" uses another communicator than \"",
                                                     groups[0]->name(), "\""));
    }
  }
  if (bucket_cap_bytes == 0) {
    return absl::InvalidArgumentError("BucketedGradReducer: bucket_cap_bytes must be >= 1");
  }
  Communicator* comm = groups[0]->group();
  GradBucketerOptions options;
  options.mode = GradBucketerOptions::Mode::kAllReduce;
  options.bucket_cap_bytes = bucket_cap_bytes;
  options.first_bucket_cap_bytes = first_bucket_cap_bytes;
  if (device != nullptr && IsExact(groups[0]->precision())) {
    return absl::UnimplementedError(absl::StrCat("BucketedGradReducer: exact gradients (group \"",
                                                 groups[0]->name(),
                                                 "\") are reduced in host buckets only"));
  }
  if (device != nullptr) {
    if (device->comm == nullptr || device->memory == nullptr) {
      return absl::InvalidArgumentError(
          "BucketedGradReducer: device buckets need a communicator and a memory");
    }
    if (device->comm->rank() != comm->rank() || device->comm->size() != comm->size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("BucketedGradReducer: the device communicator is rank ",
                       device->comm->rank(), " of ", device->comm->size(), " but group \"",
                       groups[0]->name(), "\"'s is rank ", comm->rank(), " of ", comm->size()));
    }
    comm = device->comm;
    options.memory = device->memory;
  }
  std::unique_ptr<BucketedGradReducer> r(new BucketedGradReducer(comm, options));
  r->device_ = device != nullptr;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const FlatParam* g = groups[gi];
    const UnitGrad& grad = g->unit_grad();
    std::vector<int> ids;
    for (int k = 0; k < g->num_params(); ++k) {
      const FlatParamEntry& e = g->entries()[k];
      // Each element as the precision puts it on the wire (exact: its int64 limbs,
      // SEMANTICS.md §11).
      GRADSUM_ASSIGN_OR_RETURN(int id,
                               r->bucketer_.Register(absl::StrCat(g->name(), "/", e.name),
                                                     GradWireDType(grad.precision()),
                                                     e.numel * grad.wire_words_per_element()));
      ids.push_back(id);
      r->owner_.push_back({static_cast<int>(gi), k});
    }
    int rejected_id = -1;
    if (grad.carries_rejected_count()) {
      // The group's rejected-contribution count travels in the same buckets, last.
      GRADSUM_ASSIGN_OR_RETURN(
          rejected_id,
          r->bucketer_.Register(absl::StrCat(g->name(), "/#rejected"), DType::kI64, 1));
      r->owner_.push_back({static_cast<int>(gi), -1});
    }
    r->param_ids_.push_back(std::move(ids));
    r->rejected_ids_.push_back(rejected_id);
  }
  GRADSUM_RETURN_IF_ERROR(r->bucketer_.Finalize());
  r->handed_.assign(groups.size(), false);
  r->groups_ = std::move(groups);
  return r;
}

absl::Status BucketedGradReducer::GroupReady(int index) {
  if (index < 0 || index >= static_cast<int>(groups_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("BucketedGradReducer: group index ", index,
                                                   " out of range [0, ", groups_.size(), ")"));
  }
  FlatParam& g = *groups_[index];
  // Checked before touching the bucket storage: an all-reduce may be reading it now.
  if (handed_[index]) {
    return absl::FailedPreconditionError(absl::StrCat("BucketedGradReducer: group \"", g.name(),
                                                      "\" was already handed over this step"));
  }
  handed_[index] = true;
  UnitGrad& grad = g.unit_grad();
  if (rejected_ids_[index] >= 0) {
    const int id = rejected_ids_[index];
    *bucketer_.grad(id).data<int64_t>() = grad.rejected();
    GRADSUM_RETURN_IF_ERROR(bucketer_.MarkReady(id));
  }
  // Backward produces the last parameters first: mark them in that order.
  for (int k = g.num_params() - 1; k >= 0; --k) {
    const FlatParamEntry& e = g.entries()[k];
    const int id = param_ids_[index][k];
    // Device buckets: the gradient is already in the bucket view.
    if (!device_) {
      GRADSUM_RETURN_IF_ERROR(grad.ToWire(e.offset, e.numel, bucketer_.grad(id).raw()));
    }
    GRADSUM_RETURN_IF_ERROR(bucketer_.MarkReady(id));
  }
  return absl::OkStatus();
}

absl::Status BucketedGradReducer::Finish() {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!handed_[gi]) {
      return absl::FailedPreconditionError(absl::StrCat("BucketedGradReducer: group \"",
                                                        groups_[gi]->name(),
                                                        "\" was not handed over this step"));
    }
  }
  GRADSUM_RETURN_IF_ERROR(bucketer_.Finish());
  std::fill(handed_.begin(), handed_.end(), false);
  // Each group's global rejected count (exact precision; host buckets only), then bucket
  // by bucket (device buckets: one copy to the host each), each parameter's sum into its
  // group's master_grad() (replicated: the full gradient, numel elements).
  std::vector<int64_t> rejected(groups_.size(), 0);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const int id = rejected_ids_[gi];
    if (id >= 0) rejected[gi] = *bucketer_.grad(id).data<int64_t>();
  }
  std::vector<uint64_t> staging;
  for (int b = 0; b < bucketer_.num_buckets(); ++b) {
    const GradBucketInfo& info = bucketer_.bucket(b);
    const size_t esize = DTypeSize(info.dtype);
    if (device_) {
      staging.resize((static_cast<size_t>(info.padded_numel) * esize + 7) / 8);
      GRADSUM_RETURN_IF_ERROR(bucketer_.CopyBucketToHost(b, staging.data()));
    }
    for (size_t i = 0; i < info.param_ids.size(); ++i) {
      const int id = info.param_ids[i];
      const auto [gi, k] = owner_[id];
      if (k < 0) continue;  // a rejected count, read above
      const FlatParamEntry& e = groups_[gi]->entries()[k];
      const void* src =
          device_ ? reinterpret_cast<const char*>(staging.data()) + info.offsets[i] * esize
                  : bucketer_.grad(id).raw();
      GRADSUM_RETURN_IF_ERROR(
          groups_[gi]->unit_grad().FromWire(e.offset, e.numel, src, rejected[gi]));
    }
  }
  // Device buckets hold the gradients themselves: the next step accumulates from zero.
  if (device_) GRADSUM_RETURN_IF_ERROR(bucketer_.ZeroGrads());
  return absl::OkStatus();
}

absl::Status BucketedGradReducer::Abandon() {
  std::fill(handed_.begin(), handed_.end(), false);
  return bucketer_.AbandonStep();
}

absl::StatusOr<BucketedUnitReducers> BucketedUnitReducers::Create(
    const std::vector<FlatParam*>& units, size_t bucket_cap_bytes, size_t first_bucket_cap_bytes,
    const std::vector<Communicator*>* device_comms, BucketMemory* memory) {
  if (device_comms != nullptr && device_comms->size() != units.size()) {
    return absl::InvalidArgumentError(absl::StrCat("BucketedUnitReducers: ", units.size(),
                                                   " units but ", device_comms->size(),
                                                   " device communicators"));
  }
  auto comm_of = [&](size_t u) {
    return device_comms != nullptr ? (*device_comms)[u] : units[u]->group();
  };
  // Units grouped by communicator, in forward order; each unit's reducer and index.
  std::vector<std::pair<Communicator*, std::vector<FlatParam*>>> by_comm;
  BucketedUnitReducers r;
  r.reducer_of_.resize(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    auto it = std::find_if(by_comm.begin(), by_comm.end(),
                           [&](const auto& e) { return e.first == comm_of(u); });
    if (it == by_comm.end()) {
      by_comm.push_back({comm_of(u), {}});
      it = by_comm.end() - 1;
    }
    r.reducer_of_[u] = {static_cast<int>(it - by_comm.begin()),
                        static_cast<int>(it->second.size())};
    it->second.push_back(units[u]);
  }
  for (auto& [comm, group_units] : by_comm) {
    const BucketedGradDevice device{comm, memory};
    GRADSUM_ASSIGN_OR_RETURN(
        std::unique_ptr<BucketedGradReducer> reducer,
        BucketedGradReducer::Create(group_units, bucket_cap_bytes, first_bucket_cap_bytes,
                                    device_comms != nullptr ? &device : nullptr));
    r.reducers_.push_back(std::move(reducer));
  }
  r.handed_.assign(r.reducers_.size(), false);
  return r;
}

absl::Status BucketedUnitReducers::Ready(int u) {
  if (u < 0 || u >= static_cast<int>(reducer_of_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("BucketedUnitReducers: unit ", u, " outside [0, ", reducer_of_.size(), ")"));
  }
  const auto [r, index] = reducer_of_[u];
  handed_[r] = true;
  return reducers_[r]->GroupReady(index);
}

absl::Status BucketedUnitReducers::Finish() {
  for (size_t r = 0; r < reducers_.size(); ++r) {
    if (!handed_[r]) continue;
    handed_[r] = false;
    GRADSUM_RETURN_IF_ERROR(reducers_[r]->Finish());
  }
  return absl::OkStatus();
}

absl::Status BucketedUnitReducers::Abandon() {
  absl::Status first;
  for (size_t r = 0; r < reducers_.size(); ++r) {
    handed_[r] = false;
    absl::Status s = reducers_[r]->Abandon();
    if (first.ok()) first = s;
  }
  return first;
}

TensorView BucketedUnitReducers::grad_view(int u, int k) const {
  const auto [r, index] = reducer_of_[u];
  return reducers_[r]->grad_view(index, k);
}

}  // namespace gradsum
