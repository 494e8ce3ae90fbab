#include "collectives/bucketer.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/status.h"

namespace gradsum {

namespace {

class HostMemory final : public BucketMemory {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    return static_cast<void*>(new uint64_t[(bytes + 7) / 8]());  // zeroed
  }
  void Free(void* storage) override { delete[] static_cast<uint64_t*>(storage); }
  absl::Status Zero(void* storage, size_t bytes) override {
    std::memset(storage, 0, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(const void* storage, void* host, size_t bytes) override {
    std::memcpy(host, storage, bytes);
    return absl::OkStatus();
  }
};

size_t StorageBytes(const GradBucketInfo& info) {
  return static_cast<size_t>(info.padded_numel) * DTypeSize(info.dtype);
}

}  // namespace

BucketMemory& HostBucketMemory() {
  static HostMemory* memory = new HostMemory();
  return *memory;
}

GradBucketer::GradBucketer(Communicator* comm, GradBucketerOptions options)
    : comm_(comm),
      options_(options),
      memory_(options.memory != nullptr ? options.memory : &HostBucketMemory()) {}

GradBucketer::~GradBucketer() {
  WaitAll().IgnoreError();
  for (Bucket& b : buckets_) {
    if (b.storage != nullptr) memory_->Free(b.storage);
  }
}

absl::StatusOr<int> GradBucketer::Register(absl::string_view name, DType dtype, int64_t numel) {
  if (finalized_) {
    return absl::FailedPreconditionError(
        absl::StrCat("GradBucketer::Register('", name, "') after Finalize()"));
  }
  if (!IsValidDType(static_cast<int>(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GradBucketer::Register('", name, "'): invalid dtype value ", static_cast<int>(dtype)));
  }
  if (numel < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("GradBucketer::Register('", name, "'): numel ", numel, " is negative"));
  }
  Param p;
  p.name = std::string(name);
  p.dtype = dtype;
  p.numel = numel;
  params_.push_back(std::move(p));
  return static_cast<int>(params_.size()) - 1;
}

absl::Status GradBucketer::Finalize() {
  if (finalized_) return absl::FailedPreconditionError("GradBucketer::Finalize() called twice");
  if (comm_ == nullptr) return absl::InvalidArgumentError("GradBucketer: communicator is null");
  if (options_.bucket_cap_bytes == 0) {
    return absl::InvalidArgumentError("GradBucketer: bucket_cap_bytes must be >= 1, got 0");
  }
  // Walk parameters in reverse (backward) order with one open bucket per dtype, as
  // backward interleaves dtypes; a bucket closes when the next parameter would overflow it.
  std::vector<GradBucketInfo> infos;
  std::map<DType, int> open;  // dtype -> index into infos
  const size_t first_cap = options_.first_bucket_cap_bytes > 0 ? options_.first_bucket_cap_bytes
                                                               : options_.bucket_cap_bytes;
  for (int id = num_params() - 1; id >= 0; --id) {
    const Param& p = params_[id];
    const size_t bytes = static_cast<size_t>(p.numel) * DTypeSize(p.dtype);
    auto it = open.find(p.dtype);
    if (it != open.end()) {
      const size_t used = static_cast<size_t>(infos[it->second].numel) * DTypeSize(p.dtype);
      const size_t cap = it->second == 0 ? first_cap : options_.bucket_cap_bytes;
      if (used + bytes > cap) {
        open.erase(it);
        it = open.end();
      }
    }
    if (it == open.end()) {
      GradBucketInfo info;
      info.dtype = p.dtype;
      infos.push_back(std::move(info));
      it = open.emplace(p.dtype, static_cast<int>(infos.size()) - 1).first;
    }
    GradBucketInfo& b = infos[it->second];
    b.param_ids.push_back(id);
    b.offsets.push_back(b.numel);
    b.numel += p.numel;
  }
  // Bucket order = the order in which backward completes them: by the position (in
  // reverse order) of each bucket's last parameter, i.e. by descending smallest id.
  std::stable_sort(infos.begin(), infos.end(),
                   [](const GradBucketInfo& a, const GradBucketInfo& b) {
                     return a.param_ids.back() > b.param_ids.back();
                   });
  const int64_t group = comm_->size();
  buckets_.resize(infos.size());
  for (size_t b = 0; b < infos.size(); ++b) {
    Bucket& bucket = buckets_[b];
    bucket.info = std::move(infos[b]);
    GradBucketInfo& info = bucket.info;
    info.padded_numel = info.numel;
    if (options_.mode == GradBucketerOptions::Mode::kReduceScatter) {
      info.padded_numel = (info.numel + group - 1) / group * group;
    }
    GRADSUM_ASSIGN_OR_RETURN(bucket.storage,
                             memory_->Allocate(std::max<size_t>(StorageBytes(info), 1)));
    bucket.pending = static_cast<int>(info.param_ids.size());
    for (size_t i = 0; i < info.param_ids.size(); ++i) {
      Param& p = params_[info.param_ids[i]];
      p.bucket = static_cast<int>(b);
      p.offset = info.offsets[i];
    }
  }
  finalized_ = true;
  return absl::OkStatus();
}

TensorView GradBucketer::grad(int id) const {
  if (!finalized_ || id < 0 || id >= num_params()) return TensorView();
  const Param& p = params_[id];
  char* base = static_cast<char*>(buckets_[p.bucket].storage);
  absl::StatusOr<TensorView> v =
      TensorView::Create(base + p.offset * DTypeSize(p.dtype), p.dtype, {p.numel});
  return v.ok() ? *v : TensorView();
}

TensorView GradBucketer::shard(int b) const {
  if (!finalized_ || b < 0 || b >= num_buckets() ||
      options_.mode != GradBucketerOptions::Mode::kReduceScatter) {
    return TensorView();
  }
  const GradBucketInfo& info = buckets_[b].info;
  const int64_t block = info.padded_numel / comm_->size();
  char* base = static_cast<char*>(buckets_[b].storage);
  absl::StatusOr<TensorView> v =
      TensorView::Create(base + comm_->rank() * block * DTypeSize(info.dtype), info.dtype, {block});
  return v.ok() ? *v : TensorView();
}

int GradBucketer::bucket_of(int id) const {
  if (!finalized_ || id < 0 || id >= num_params()) return -1;
  return params_[id].bucket;
}

absl::Status GradBucketer::MarkReady(int id) {
  if (!finalized_) {
    return absl::FailedPreconditionError(
        absl::StrCat("GradBucketer::MarkReady(", id, ") before Finalize()"));
  }
  if (id < 0 || id >= num_params()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GradBucketer::MarkReady: id ", id, " is outside [0, ", num_params(), ")"));
  }
  Param& p = params_[id];
  if (p.ready) {
    return absl::FailedPreconditionError(absl::StrCat("GradBucketer::MarkReady: gradient '", p.name,
                                                      "' (id ", id,
                                                      ") was already marked ready in this step"));
  }
  p.ready = true;
  ++marked_;
  --buckets_[p.bucket].pending;
  return IssueReadyBuckets();
}

absl::Status GradBucketer::IssueReadyBuckets() {
  while (next_to_issue_ < num_buckets() && buckets_[next_to_issue_].pending == 0) {
    Bucket& b = buckets_[next_to_issue_++];
    void* data = b.storage;
    const size_t n = static_cast<size_t>(b.info.padded_numel);
    absl::StatusOr<std::unique_ptr<Work>> work;
    if (options_.mode == GradBucketerOptions::Mode::kReduceScatter) {
      const size_t block = n / static_cast<size_t>(comm_->size());
      void* mine = static_cast<char*>(data) + comm_->rank() * block * DTypeSize(b.info.dtype);
      work = comm_->ReduceScatterAsync(data, mine, block, b.info.dtype, ReduceOp::kSum);
    } else {
      work = comm_->AllReduceAsync(data, data, n, b.info.dtype, ReduceOp::kSum);
    }
    if (!work.ok()) {
      absl::Status s(work.status().code(), absl::StrCat("GradBucketer bucket ", next_to_issue_ - 1,
                                                        ": ", work.status().message()));
      if (issue_error_.ok()) issue_error_ = s;
      return s;
    }
    b.work = std::move(*work);
  }
  return absl::OkStatus();
}

absl::Status GradBucketer::WaitAll() {
  absl::Status first;
  for (int b = 0; b < num_buckets(); ++b) {
    if (buckets_[b].work == nullptr) continue;
    absl::Status s = buckets_[b].work->Wait(comm_->OperationWaitLimit());
    if (!s.ok() && first.ok()) {
      first = absl::Status(s.code(), absl::StrCat("GradBucketer bucket ", b, ": ", s.message()));
    }
    buckets_[b].work.reset();
  }
  return first;
}

absl::Status GradBucketer::Finish() {
  if (!finalized_) return absl::FailedPreconditionError("GradBucketer::Finish() before Finalize()");
  if (marked_ < num_params()) {
    for (int id = 0; id < num_params(); ++id) {
      if (!params_[id].ready) {
        return absl::FailedPreconditionError(absl::StrCat(
            "GradBucketer::Finish: gradient '", params_[id].name, "' (id ", id,
            ") was not marked ready (", num_params() - marked_, " of ", num_params(), " missing)"));
      }
    }
  }
  absl::Status s = WaitAll();
  if (s.ok()) s = issue_error_;
  ResetStep();
  return s;
}

void GradBucketer::ResetStep() {
  for (Param& p : params_) p.ready = false;
  for (Bucket& b : buckets_) b.pending = static_cast<int>(b.info.param_ids.size());
  marked_ = 0;
  next_to_issue_ = 0;
  issue_error_ = absl::OkStatus();
}

absl::Status GradBucketer::AbandonStep() {
  if (!finalized_) {
    return absl::FailedPreconditionError("GradBucketer::AbandonStep() before Finalize()");
  }
  absl::Status s = WaitAll();
  ResetStep();
  GRADSUM_RETURN_IF_ERROR(ZeroGrads());
  return s;
}

absl::Status GradBucketer::ZeroGrads() {
  if (!finalized_)
    return absl::FailedPreconditionError("GradBucketer::ZeroGrads() before Finalize()");
  if (marked_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "GradBucketer::ZeroGrads: a step is open (", marked_, " gradients marked); call Finish()"));
  }
  for (Bucket& b : buckets_) {
    GRADSUM_RETURN_IF_ERROR(memory_->Zero(b.storage, StorageBytes(b.info)));
  }
  return absl::OkStatus();
}

absl::Status GradBucketer::CopyBucketToHost(int b, void* host) const {
  if (!finalized_ || b < 0 || b >= num_buckets()) {
    return absl::InvalidArgumentError(absl::StrCat("GradBucketer::CopyBucketToHost: bucket ", b,
                                                   " is outside [0, ", num_buckets(), ")"));
  }
  return memory_->CopyToHost(buckets_[b].storage, host, StorageBytes(buckets_[b].info));
}

}  // namespace gradsum
