#include "parallel/cuda/device_unit_store.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/device_stream.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/device_buffer.h"
#include "core/half.h"
#include "core/status.h"
#include "model/cuda/model_kernels.h"
#include "parallel/bucketed_reduce.h"

namespace gradsum::parallel {
namespace {

using cuda::DeviceBuffer;
using cuda::Fence;
using cuda::Reserve;

// One parameter unit on the device: its compute values (fp32, padded_numel() elements in
// the host unit's flat layout; allocated while gathered) and its fp32 gradient (kept, in
// the same layout: the expert kernels address a unit's stacked experts as one block).
struct DeviceGroup {
  FlatParam* host = nullptr;
  Communicator* comm = nullptr;  // NCCL
  DeviceBuffer param;            // f32 [padded] while gathered, else empty
  DeviceBuffer gather_bf16;      // bf16 [padded] while a bf16 gather is in flight
  DeviceBuffer grad;             // f32 [padded], this micro-batch (fsdp) or the step
  DeviceBuffer reduce_bf16;      // bf16 [padded] send buffer of a bf16 reduce-scatter
  DeviceBuffer shard;            // reduce-scatter output [shard], reduce dtype
  std::unique_ptr<Work> gather_work, reduce_work;
  bool gathering = false, gathered = false;
  bool reduce_last = false;       // the reduction in flight is the last micro-batch's
  uint64_t gathered_version = 0;  // host master_version() of the gathered values

  float* param_ptr(int index) const { return param.as<float>() + host->entries()[index].offset; }
  float* grad_ptr(int index) const { return grad.as<float>() + host->entries()[index].offset; }
};

// GradBucketer storage in device memory, zeroed on the compute stream (which writes the
// gradients); read back after the bucket's NCCL all-reduce was waited for.
class DeviceBucketMemory final : public BucketMemory {
 public:
  explicit DeviceBucketMemory(cudaStream_t stream) : stream_(stream) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* p = nullptr;
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes), "allocate a gradient bucket");
    absl::Status s = Zero(p, bytes);
    if (!s.ok()) {
      cudaFree(p);
      return s;
    }
    return p;
  }
  void Free(void* storage) override { cudaFree(storage); }
  absl::Status Zero(void* storage, size_t bytes) override {
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(storage, 0, bytes, stream_),
                                 "zero a gradient bucket");
    return absl::OkStatus();
  }
  absl::Status CopyToHost(const void* storage, void* host, size_t bytes) override {
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpy(host, storage, bytes, cudaMemcpyDeviceToHost),
                                 "download a reduced gradient bucket");
    return absl::OkStatus();
  }

 private:
  cudaStream_t stream_;
};

// A unit's gradient is copied into its bucket views when handed over (not accumulated in
// them: the buckets hold parameters in reverse order, possibly split over buckets, and the
// expert kernels write a unit's stacked experts as one block).
class DeviceUnitStore : public UnitStore {
 public:
  DeviceUnitStore(std::shared_ptr<cuda::ComputeContext> ctx, std::vector<DeviceGroup> groups,
                  const ParallelOptions& options)
      : ctx_(std::move(ctx)),
        groups_(std::move(groups)),
        stream_(ctx_->stream.get()),
        fence_(ctx_->fence),
        bf16_compute_(options.compute_dtype == DType::kBF16),
        bf16_reduce_(GradWireDType(options.precision) == DType::kBF16),
        every_micro_batch_(options.reduce_every_micro_batch),
        bucket_memory_(stream_) {}

  // Allocates and zeroes each unit's gradient (on the compute stream: the legacy default
  // stream does not order the non-blocking streams that later read these buffers), and in
  // replicated mode the bucketed reduction.
  absl::Status Init(const ParallelOptions& options) {
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device), "cudaSetDevice");
    if (options.sharding == ShardingMode::kReplicated) {
      std::vector<FlatParam*> units;
      std::vector<Communicator*> comms;
      for (const DeviceGroup& g : groups_) {
        units.push_back(g.host);
        comms.push_back(g.comm);
      }
      GRADSUM_ASSIGN_OR_RETURN(
          BucketedUnitReducers r,
          BucketedUnitReducers::Create(units, options.bucket_cap_bytes,
                                       options.first_bucket_cap_bytes, &comms, &bucket_memory_));
      reducers_ = std::make_unique<BucketedUnitReducers>(std::move(r));
    }
    for (DeviceGroup& g : groups_) {
      GRADSUM_ASSIGN_OR_RETURN(g.grad,
                               DeviceBuffer::Create(g.host->padded_numel() * sizeof(float)));
    }
    GRADSUM_RETURN_IF_ERROR(ZeroGradBuffers());
    return ctx_->stream.Synchronize();
  }

  const float* Values(int u, int index) override { return groups_[u].param_ptr(index); }

  absl::StatusOr<GradTarget> Grad(int u, int first, int count) override {
    const DeviceGroup& g = groups_[u];
    int64_t numel = 0;
    for (int i = first; i < first + count; ++i) numel += g.host->entries()[i].numel;
    return GradTarget::Accumulate(g.grad_ptr(first), numel);
  }

  // A new step: nothing of a failed one stays in flight; the units are gathered from the
  // current host masters by the schedule as the stages need them.
  absl::Status PrepareStep() override {
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device), "cudaSetDevice");
    Abandon();
    GRADSUM_RETURN_IF_ERROR(ctx_->stream.Synchronize());
    uploaded_version_.clear();
    for (const DeviceGroup& g : groups_) uploaded_version_.push_back(g.host->master_version());
    step_failed_ = false;
    return absl::OkStatus();
  }

  absl::Status CheckMicroBatch() override {
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device), "cudaSetDevice");
    if (uploaded_version_.size() != groups_.size()) {
      return absl::FailedPreconditionError(
          "device units: the step was not prepared: call Unshard() before ForwardBackward");
    }
    for (size_t i = 0; i < groups_.size(); ++i) {
      if (groups_[i].host->master_version() != uploaded_version_[i]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "device units: parameter group \"", groups_[i].host->name(),
            "\" changed on the host since the last Unshard(): call Unshard() after every "
            "optimizer step or parameter load"));
      }
    }
    if (step_failed_) {
      return absl::FailedPreconditionError(
          "device units: an earlier micro-batch of this step failed; call Unshard() to start a "
          "new step");
    }
    return absl::OkStatus();
  }

  // The step's device gradients are incomplete: drop them and refuse to reduce them.
  void MicroBatchFailed() override {
    step_failed_ = true;
    Abandon();
    DropGradients().IgnoreError();
    (void)ctx_->stream.Synchronize();
  }

  absl::Status StartGather(int u) override {
    DeviceGroup& g = groups_[u];
    FlatParam* fp = g.host;
    if (g.gathering) return absl::OkStatus();
    if (g.gathered && g.gathered_version == fp->master_version()) return absl::OkStatus();
    const bool sharded = fp->options().mode == ShardingMode::kSharded;
    const int64_t padded = fp->padded_numel();
    // The values this rank contributes, padded: its shard (fsdp) or everything (replicated).
    const int64_t count = sharded ? fp->shard_numel() : padded;
    const int64_t at = sharded ? fp->shard_offset() : 0;
    std::vector<float> values(count, 0.0f);
    absl::Span<const float> master = fp->master();
    std::copy(master.begin(), master.end(), values.begin());
    GRADSUM_RETURN_IF_ERROR(Reserve(&g.param, padded * sizeof(float)));
    cudaStream_t cs = g.comm->device_stream()->stream();
    absl::StatusOr<std::unique_ptr<Work>> work;
    if (!bf16_compute_) {
      // Pageable source: the call returns once `values` is staged.
      GRADSUM_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(g.param.as<float>() + at, values.data(), count * sizeof(float),
                          cudaMemcpyHostToDevice, cs),
          "upload master parameters");
      if (sharded) {
        work = g.comm->AllGatherAsync(g.param.as<float>() + at, g.param.get(), count, DType::kF32);
      }
    } else {
      // bf16: round once on the host (as FlatParam does), gather half the bytes.
      std::vector<BF16> rounded(count);
      for (int64_t i = 0; i < count; ++i) rounded[i] = BF16::FromFloat(values[i]);
      GRADSUM_RETURN_IF_ERROR(Reserve(&g.gather_bf16, padded * sizeof(BF16)));
      BF16* dst = g.gather_bf16.as<BF16>();
      GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst + at, rounded.data(), count * sizeof(BF16),
                                                   cudaMemcpyHostToDevice, cs),
                                   "upload bf16 parameters");
      if (sharded) work = g.comm->AllGatherAsync(dst + at, dst, count, DType::kBF16);
    }
    if (sharded) {
      if (!work.ok()) return work.status();
      g.gather_work = std::move(*work);
    }
    g.gathering = true;
    g.gathered = false;
    g.gathered_version = fp->master_version();
    return absl::OkStatus();
  }

  absl::Status WaitGather(int u) override {
    DeviceGroup& g = groups_[u];
    if (g.gathered) return absl::OkStatus();
    if (!g.gathering) {
      return absl::FailedPreconditionError(
          absl::StrCat("unit ", g.host->name(), " was not gathered before it was read"));
    }
    if (g.gather_work) {
      absl::Status s = g.gather_work->Wait(g.comm->timeout());
      g.gather_work.reset();
      if (!s.ok()) {
        g.gathering = false;
        return s;
      }
    }
    // The compute stream reads what the NCCL stream wrote (upload and gather).
    GRADSUM_RETURN_IF_ERROR(Fence(g.comm->device_stream()->stream(), stream_, fence_));
    if (bf16_compute_) {
      GRADSUM_RETURN_IF_ERROR(model::Bf16ToF32Cuda(
          g.gather_bf16.as<uint16_t>(), g.param.as<float>(), g.host->padded_numel(), stream_));
    }
    g.gathering = false;
    g.gathered = true;
    return absl::OkStatus();
  }

  absl::Status Release(int u) override {
    DeviceGroup& g = groups_[u];
    if (g.gathering) GRADSUM_RETURN_IF_ERROR(WaitGather(u));
    // Kernels enqueued on the compute stream may still read the buffers.
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "release a unit");
    g.param = DeviceBuffer();
    g.gather_bf16 = DeviceBuffer();
    g.gathered = false;
    return absl::OkStatus();
  }

  absl::Status StartReduce(int u, bool last_micro_batch) override {
    DeviceGroup& g = groups_[u];
    FlatParam* fp = g.host;
    const bool sharded = fp->options().mode == ShardingMode::kSharded;
    if (!last_micro_batch && (!sharded || !every_micro_batch_)) return absl::OkStatus();
    if (reducers_ != nullptr) {
      // The step's gradient into its bucket views on the compute stream (copied, or
      // rounded for a bf16 reduce dtype), as the host store copies FlatParam gradients.
      for (int k = 0; k < fp->num_params(); ++k) {
        const int64_t n = fp->entries()[k].numel;
        TensorView view = reducers_->grad_view(u, k);
        if (bf16_reduce_) {
          GRADSUM_RETURN_IF_ERROR(
              model::F32ToBf16Cuda(g.grad_ptr(k), view.data<uint16_t>(), n, stream_));
        } else if (n > 0) {
          GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(view.raw(), g.grad_ptr(k), n * sizeof(float),
                                                       cudaMemcpyDeviceToDevice, stream_),
                                       "copy a gradient into its bucket");
        }
      }
      // The buckets' all-reduces on the NCCL stream read what the compute stream wrote.
      GRADSUM_RETURN_IF_ERROR(Fence(stream_, g.comm->device_stream()->stream(), fence_));
      return reducers_->Ready(u);
    }
    const int64_t padded = fp->padded_numel();
    const void* send = g.grad.get();
    DType dtype = DType::kF32;
    if (bf16_reduce_) {
      GRADSUM_RETURN_IF_ERROR(Reserve(&g.reduce_bf16, padded * sizeof(BF16)));
      GRADSUM_RETURN_IF_ERROR(
          model::F32ToBf16Cuda(g.grad.as<float>(), g.reduce_bf16.as<uint16_t>(), padded, stream_));
      send = g.reduce_bf16.get();
      dtype = DType::kBF16;
    }
    GRADSUM_RETURN_IF_ERROR(Fence(stream_, g.comm->device_stream()->stream(), fence_));
    GRADSUM_RETURN_IF_ERROR(Reserve(&g.shard, fp->shard_numel() * DTypeSize(dtype)));
    absl::StatusOr<std::unique_ptr<Work>> work =
        g.comm->ReduceScatterAsync(send, g.shard.get(), fp->shard_numel(), dtype, ReduceOp::kSum);
    if (!work.ok()) return work.status();
    g.reduce_work = std::move(*work);
    g.reduce_last = last_micro_batch;
    return absl::OkStatus();
  }

  absl::Status WaitReduce(int u) override {
    DeviceGroup& g = groups_[u];
    if (!g.reduce_work) return absl::OkStatus();
    absl::Status s = g.reduce_work->Wait(g.comm->timeout());
    g.reduce_work.reset();
    GRADSUM_RETURN_IF_ERROR(s);
    // The reduce-scatter's output (replicated mode reduces through the buckets).
    FlatParam* fp = g.host;
    const int64_t out_count = fp->shard_numel();
    const void* out = g.shard.get();
    std::vector<float> reduced(out_count);
    if (bf16_reduce_) {
      std::vector<BF16> raw(out_count);
      GRADSUM_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(raw.data(), out, out_count * sizeof(BF16), cudaMemcpyDeviceToHost),
          "download reduced gradient");
      for (int64_t i = 0; i < out_count; ++i) reduced[i] = raw[i].ToFloat();
    } else {
      GRADSUM_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(reduced.data(), out, out_count * sizeof(float), cudaMemcpyDeviceToHost),
          "download reduced gradient");
    }
    GRADSUM_RETURN_IF_ERROR(fp->FoldReducedGrad(reduced, g.reduce_last));
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(g.grad.get(), 0, fp->padded_numel() * sizeof(float), stream_),
        "zero device gradient");
    return absl::OkStatus();
  }

  absl::Status FinishReductions() override {
    if (step_failed_) {
      return absl::FailedPreconditionError(
          "device units: a micro-batch of this step failed; its gradients cannot be reduced");
    }
    for (size_t u = 0; u < groups_.size(); ++u) {
      GRADSUM_RETURN_IF_ERROR(WaitReduce(static_cast<int>(u)));
    }
    // HSDP: the replica stages the last folds started (host collectives, overlapping the
    // rest of backward) are complete here.
    for (DeviceGroup& g : groups_) GRADSUM_RETURN_IF_ERROR(g.host->FinishGradReduce());
    if (reducers_ == nullptr) return absl::OkStatus();
    GRADSUM_RETURN_IF_ERROR(reducers_->Finish());
    return ZeroGradBuffers();
  }

  int64_t UnshardedBytes() const override {
    int64_t n = 0;
    for (const DeviceGroup& g : groups_) n += g.param.size() + g.gather_bf16.size();
    return n;
  }
  int64_t FullBytes() const override {
    int64_t n = 0;
    for (const DeviceGroup& g : groups_) n += g.host->padded_numel() * sizeof(float);
    return n;
  }

 private:
  // Drops what is in flight without folding it.
  void Abandon() {
    for (DeviceGroup& g : groups_) {
      if (g.gather_work) g.gather_work->Wait(g.comm->timeout()).IgnoreError();
      if (g.reduce_work) g.reduce_work->Wait(g.comm->timeout()).IgnoreError();
      g.host->FinishGradReduce().IgnoreError();  // an HSDP replica stage a fold started
      g.gather_work.reset();
      g.reduce_work.reset();
      g.gathering = false;
    }
  }

  // Drops the step's gradients: waits for the buckets in flight (discarded) and zeroes
  // every gradient on the compute stream.
  absl::Status DropGradients() {
    if (reducers_ != nullptr) GRADSUM_RETURN_IF_ERROR(reducers_->Abandon());
    return ZeroGradBuffers();
  }

  absl::Status ZeroGradBuffers() {
    for (DeviceGroup& g : groups_) {
      GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(g.grad.get(), 0, g.grad.size(), stream_),
                                   "zero device gradient");
    }
    return absl::OkStatus();
  }

  std::shared_ptr<cuda::ComputeContext> ctx_;
  std::vector<DeviceGroup> groups_;  // one per host unit, same order
  cudaStream_t stream_;
  cudaEvent_t fence_;
  bool bf16_compute_, bf16_reduce_, every_micro_batch_;
  // The host units' master_version() at the last PrepareStep(): a micro-batch refuses to
  // read device parameters the host has moved past.
  std::vector<uint64_t> uploaded_version_;
  bool step_failed_ = false;
  DeviceBucketMemory bucket_memory_;                // outlives reducers_ (declared first)
  std::unique_ptr<BucketedUnitReducers> reducers_;  // replicated mode
};

}  // namespace

absl::StatusOr<std::unique_ptr<UnitStore>> CudaUnitDevice::MakeStore(
    std::vector<FlatParam*> units, std::vector<bool> expert_unit, const ParallelOptions& options) {
  if (IsExact(options.precision)) {
    return absl::UnimplementedError(
        "exact gradients (reproducible mode) are not implemented on the GPU: use a CPU backend");
  }
  if (options.compute_dtype != DType::kF32 && options.compute_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute_dtype=", DTypeName(options.compute_dtype), ": must be f32 or bf16"));
  }
  Communicator& dense = mesh_->device_group(MeshAxis::kDpShard);
  Communicator& experts = mesh_->device_group(MeshAxis::kEdpShard);
  if (context_ == nullptr || !mesh_->has_device_view() || dense.device_stream() == nullptr ||
      experts.device_stream() == nullptr) {
    return absl::InvalidArgumentError(
        "device units need a compute context and a mesh with an NCCL device view");
  }
  std::vector<DeviceGroup> groups;
  for (size_t u = 0; u < units.size(); ++u) {
    DeviceGroup g;
    g.host = units[u];
    g.comm = expert_unit[u] ? &experts : &dense;
    // The device collectives must split the unit as its host layout does.
    if (g.host->options().mode == ShardingMode::kSharded &&
        g.host->padded_numel() != g.host->shard_numel() * g.comm->size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("device units: unit \"", g.host->name(), "\" is sharded ",
                       g.host->padded_numel() / std::max<int64_t>(g.host->shard_numel(), 1),
                       " ways on the host but its NCCL group has ", g.comm->size(), " ranks"));
    }
    groups.push_back(std::move(g));
  }
  auto store = std::make_unique<DeviceUnitStore>(context_, std::move(groups), options);
  GRADSUM_RETURN_IF_ERROR(store->Init(options));
  return std::unique_ptr<UnitStore>(std::move(store));
}

}  // namespace gradsum::parallel
