#include "train/cuda/moe_lm_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/device_buffer.h"
#include "core/cuda/gemm.h"
#include "core/half.h"
#include "core/status.h"
#include "losses/cuda/cross_entropy_cuda.h"
#include "moe/cuda/experts_cuda.h"
#include "moe/ep_exchange.h"
#include "moe/cuda/layers_cuda.h"
#include "moe/cuda/permute_cuda.h"
#include "moe/cuda/router_cuda.h"
#include "sharding/bucketed_reduce.h"
#include "train/cuda/model_kernels.h"
#include "train/layers.h"

namespace gradsum::train {
namespace {

using cuda::CublasHandle;
using cuda::DeviceBuffer;
using cuda::GemmRowMajor;

// Grows `b` to at least `bytes` (contents are not kept). Never leaves a null buffer, so
// zero-count collectives still get valid device pointers.
absl::Status Reserve(DeviceBuffer* b, size_t bytes) {
  bytes = std::max<size_t>(bytes, 256);
  if (b->size() >= bytes) return absl::OkStatus();
  *b = DeviceBuffer();
  GRADSUM_ASSIGN_OR_RETURN(*b, DeviceBuffer::Create(bytes));
  return absl::OkStatus();
}

// `consumer` waits (on the device) for everything enqueued on `producer` so far.
absl::Status Fence(cudaStream_t producer, cudaStream_t consumer, cudaEvent_t event) {
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaEventRecord(event, producer), "record stream fence");
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(consumer, event, 0), "wait on stream fence");
  return absl::OkStatus();
}

// One parameter unit on the device: its compute values (fp32, padded_numel() elements in
// the host unit's flat layout; allocated while gathered) and its fp32 gradient (kept, in
// the same layout: the expert kernels address a unit's stacked experts as one block).
struct DeviceGroup {
  FlatParam* host = nullptr;
  NcclCommunicator* comm = nullptr;
  DeviceBuffer param;          // f32 [padded] while gathered, else empty
  DeviceBuffer gather_bf16;    // bf16 [padded] while a bf16 gather is in flight
  DeviceBuffer grad;           // f32 [padded], this micro-batch (fsdp) or the step
  DeviceBuffer reduce_bf16;    // bf16 [padded] send buffer of a bf16 reduce-scatter
  DeviceBuffer shard;          // reduce-scatter output [shard], reduce dtype
  std::unique_ptr<Work> gather_work, reduce_work;
  bool gathering = false, gathered = false;
  bool reduce_last = false;    // the reduction in flight is the last micro-batch's
  uint64_t gathered_version = 0;  // host master_version() of the gathered values

  float* param_ptr(int index) const {
    return param.as<float>() + host->entries()[index].offset;
  }
  float* grad_ptr(int index) const { return grad.as<float>() + host->entries()[index].offset; }
};

// Per-layer activations kept from forward for backward.
struct LayerBuffers {
  DeviceBuffer h_in, a, rstd;                          // [T, D], [T, D], [T]
  DeviceBuffer logits, probs, index, weight, lse;      // [T, E], [T, E], [T, K], [T, K], [T]
  DeviceBuffer local_counts, global_counts, gating;    // [E] i64, [E] i64, [E] f64
  DeviceBuffer offsets, permuted_copy, copy_position;  // [E + 1], [T K], [T K] i64
  DeviceBuffer recv, gate, up, hidden;                 // [R, D], [R, H] x 3
  DeviceBuffer back;                                   // [T K, D] expert outputs, send order
  moe::EpExchangePlan exchange;  // send side by expert, receive side by source then expert
  moe::PermutePlanCudaArgs plan;
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

// The device model's units for the shared UnitSchedule: gathers upload the host master
// (this rank's shard in fsdp mode) on the unit's NCCL stream and all-gather it there (bf16
// when compute_dtype is bf16, widened on the compute stream after the wait); reductions
// reduce-scatter (fsdp) the device gradient on the NCCL stream after a fence on the
// compute stream, and their waits fold the result into the host unit
// (FlatParam::FoldReducedGrad). Replicated mode reduces on the last micro-batch through
// the host store's BucketedUnitReducers (sharding/bucketed_reduce.h) with the buckets in
// device memory and NCCL all-reduces: the same buckets, ready order and caps as the CPU.
// A unit's gradient is copied into its bucket views when handed over (not accumulated in
// them: the buckets hold parameters in reverse order, possibly split over buckets, and the
// expert kernels write a unit's stacked experts as one block).
class DeviceUnitStore : public UnitStore {
 public:
  DeviceUnitStore(std::vector<DeviceGroup>* groups, cudaStream_t stream, cudaEvent_t fence,
                  const MoeLmOptions& options)
      : groups_(groups),
        stream_(stream),
        fence_(fence),
        bf16_compute_(options.compute_dtype == DType::kBF16),
        bf16_reduce_(options.reduce_dtype == DType::kBF16),
        every_micro_batch_(options.reduce_every_micro_batch),
        bucket_memory_(stream) {}

  // Allocates and zeroes each unit's gradient (on the compute stream: the legacy default
  // stream does not order the non-blocking streams that later read these buffers), and in
  // replicated mode the bucketed reduction.
  absl::Status Init(const MoeLmOptions& options) {
    std::vector<DeviceGroup>& groups = *groups_;
    if (options.sharding == ShardingMode::kReplicated) {
      std::vector<FlatParam*> units;
      std::vector<Communicator*> comms;
      for (const DeviceGroup& g : groups) {
        units.push_back(g.host);
        comms.push_back(g.comm);
      }
      GRADSUM_ASSIGN_OR_RETURN(
          BucketedUnitReducers r,
          BucketedUnitReducers::Create(units, options.bucket_cap_bytes,
                                       options.first_bucket_cap_bytes, &comms, &bucket_memory_));
      reducers_ = std::make_unique<BucketedUnitReducers>(std::move(r));
    }
    for (DeviceGroup& g : groups) {
      GRADSUM_ASSIGN_OR_RETURN(g.grad,
                               DeviceBuffer::Create(g.host->padded_numel() * sizeof(float)));
    }
    return ZeroGradBuffers();
  }

  absl::Status StartGather(int u) override {
    DeviceGroup& g = (*groups_)[u];
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
    cudaStream_t cs = g.comm->stream();
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
    DeviceGroup& g = (*groups_)[u];
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
    GRADSUM_RETURN_IF_ERROR(Fence(g.comm->stream(), stream_, fence_));
    if (bf16_compute_) {
      GRADSUM_RETURN_IF_ERROR(Bf16ToF32Cuda(g.gather_bf16.as<uint16_t>(), g.param.as<float>(),
                                            g.host->padded_numel(), stream_));
    }
    g.gathering = false;
    g.gathered = true;
    return absl::OkStatus();
  }

  absl::Status Release(int u) override {
    DeviceGroup& g = (*groups_)[u];
    if (g.gathering) GRADSUM_RETURN_IF_ERROR(WaitGather(u));
    // Kernels enqueued on the compute stream may still read the buffers.
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "release a unit");
    g.param = DeviceBuffer();
    g.gather_bf16 = DeviceBuffer();
    g.gathered = false;
    return absl::OkStatus();
  }

  absl::Status StartReduce(int u, bool last_micro_batch) override {
    DeviceGroup& g = (*groups_)[u];
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
              F32ToBf16Cuda(g.grad_ptr(k), view.data<uint16_t>(), n, stream_));
        } else if (n > 0) {
          GRADSUM_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(view.raw(), g.grad_ptr(k), n * sizeof(float),
                              cudaMemcpyDeviceToDevice, stream_),
              "copy a gradient into its bucket");
        }
      }
      // The buckets' all-reduces on the NCCL stream read what the compute stream wrote.
      GRADSUM_RETURN_IF_ERROR(Fence(stream_, g.comm->stream(), fence_));
      return reducers_->Ready(u);
    }
    const int64_t padded = fp->padded_numel();
    const void* send = g.grad.get();
    DType dtype = DType::kF32;
    if (bf16_reduce_) {
      GRADSUM_RETURN_IF_ERROR(Reserve(&g.reduce_bf16, padded * sizeof(BF16)));
      GRADSUM_RETURN_IF_ERROR(
          F32ToBf16Cuda(g.grad.as<float>(), g.reduce_bf16.as<uint16_t>(), padded, stream_));
      send = g.reduce_bf16.get();
      dtype = DType::kBF16;
    }
    GRADSUM_RETURN_IF_ERROR(Fence(stream_, g.comm->stream(), fence_));
    GRADSUM_RETURN_IF_ERROR(Reserve(&g.shard, fp->shard_numel() * DTypeSize(dtype)));
    absl::StatusOr<std::unique_ptr<Work>> work =
        g.comm->ReduceScatterAsync(send, g.shard.get(), fp->shard_numel(), dtype, ReduceOp::kSum);
    if (!work.ok()) return work.status();
    g.reduce_work = std::move(*work);
    g.reduce_last = last_micro_batch;
    return absl::OkStatus();
  }

  absl::Status WaitReduce(int u) override {
    DeviceGroup& g = (*groups_)[u];
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
    for (size_t u = 0; u < groups_->size(); ++u) {
      GRADSUM_RETURN_IF_ERROR(WaitReduce(static_cast<int>(u)));
    }
    if (reducers_ == nullptr) return absl::OkStatus();
    GRADSUM_RETURN_IF_ERROR(reducers_->Finish());
    return ZeroGradBuffers();
  }

  int64_t UnshardedBytes() const override {
    int64_t n = 0;
    for (const DeviceGroup& g : *groups_) n += g.param.size() + g.gather_bf16.size();
    return n;
  }
  int64_t FullBytes() const override {
    int64_t n = 0;
    for (const DeviceGroup& g : *groups_) n += g.host->padded_numel() * sizeof(float);
    return n;
  }

  // After a failed micro-batch: drop what is in flight without folding it.
  void Abandon() {
    for (DeviceGroup& g : *groups_) {
      if (g.gather_work) g.gather_work->Wait(g.comm->timeout()).IgnoreError();
      if (g.reduce_work) g.reduce_work->Wait(g.comm->timeout()).IgnoreError();
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

 private:
  absl::Status ZeroGradBuffers() {
    for (DeviceGroup& g : *groups_) {
      GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(g.grad.get(), 0, g.grad.size(), stream_),
                                   "zero device gradient");
    }
    return absl::OkStatus();
  }

  std::vector<DeviceGroup>* groups_;
  cudaStream_t stream_;
  cudaEvent_t fence_;
  bool bf16_compute_, bf16_reduce_, every_micro_batch_;
  DeviceBucketMemory bucket_memory_;             // outlives reducers_ (declared first)
  std::unique_ptr<BucketedUnitReducers> reducers_;  // replicated mode
};

}  // namespace

struct MoeLmCuda::Impl {
  MoeLmDeviceGroups dev;
  int device = 0;
  cuda::CudaStream stream;
  CublasHandle blas;
  cudaEvent_t fence = nullptr;
  std::vector<DeviceGroup> groups;  // one per host unit, same order
  DeviceUnitStore* store = nullptr;  // owned by the base MoeLm
  // Micro-batch inputs and shared scratch, sized for `rows` tokens.
  int64_t rows = -1;
  // The host groups' master_version() at the last Unshard(): forward refuses to read device
  // parameters the host has moved past (optimizer step, checkpoint load, SetFullParameters).
  std::vector<uint64_t> uploaded_version;
  // A micro-batch of this step failed: its partial gradients are gone, so the step cannot be
  // reduced; the next Unshard() starts over.
  bool step_failed = false;
  DeviceBuffer tokens, labels, mask, scalars;  // scalars: D, N, ce, z, bal (f64)
  DeviceBuffer weights;                        // [T] CE weights w_t (sample / square mode)
  std::vector<LayerBuffers> layers;
  DeviceBuffer h_last, final_in_rstd, f, head, grad_f, dh, da, du, dw, y;  // h_last: [T, D]
                                                                          // after layer L-1
  DeviceBuffer send, expert_out, d_back, d_recv, dx_recv, d_send;

  ~Impl() {
    if (fence != nullptr) cudaEventDestroy(fence);
  }
};

MoeLmCuda::MoeLmCuda() = default;
MoeLmCuda::~MoeLmCuda() = default;

absl::StatusOr<std::unique_ptr<MoeLm>> MoeLmCuda::Create(const MoeLmOptions& options,
                                                         const MoeLmGroups& host,
                                                         const MoeLmDeviceGroups& device) {
  if (device.world == nullptr || device.ep_group == nullptr || device.edp_group == nullptr) {
    return absl::InvalidArgumentError("MoeLmCuda needs the NCCL world, EP and EDP communicators");
  }
  const std::pair<Communicator*, NcclCommunicator*> pairs[] = {
      {host.world, device.world}, {host.ep_group, device.ep_group},
      {host.edp_group, device.edp_group}};
  const char* names[] = {"world", "ep_group", "edp_group"};
  for (int i = 0; i < 3; ++i) {
    auto [h, d] = pairs[i];
    if (h != nullptr && (h->rank() != d->rank() || h->size() != d->size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MoeLmCuda: NCCL ", names[i], " is rank ", d->rank(), " of ", d->size(),
          " but the host ", names[i], " is rank ", h->rank(), " of ", h->size()));
    }
  }
  if (device.ep_group->device() != device.world->device() ||
      device.edp_group->device() != device.world->device()) {
    return absl::InvalidArgumentError("MoeLmCuda: the NCCL communicators are on different GPUs");
  }
  auto model = std::unique_ptr<MoeLmCuda>(new MoeLmCuda());
  GRADSUM_RETURN_IF_ERROR(MoeLm::Init(options, host, model.get()));
  if (options.compute_dtype != DType::kF32 && options.compute_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute_dtype=", DTypeName(options.compute_dtype), ": must be f32 or bf16"));
  }
  model->impl_ = std::make_unique<Impl>();
  Impl& im = *model->impl_;
  im.dev = device;
  im.device = device.world->device();
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaSetDevice(im.device),
                               absl::StrCat("cudaSetDevice(", im.device, ")"));
  GRADSUM_ASSIGN_OR_RETURN(im.stream, cuda::CudaStream::Create());
  GRADSUM_ASSIGN_OR_RETURN(im.blas, CublasHandle::Create());
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&im.fence, cudaEventDisableTiming),
                               "create fence event");
  const int L = options.model.layers();
  for (int u = 0; u < model->num_units(); ++u) {
    DeviceGroup dg;
    dg.host = model->unit(u);
    dg.comm = model->expert_unit(u) ? device.edp_group : device.world;
    im.groups.push_back(std::move(dg));
  }
  auto store = std::make_unique<DeviceUnitStore>(&im.groups, im.stream.get(), im.fence, options);
  GRADSUM_RETURN_IF_ERROR(store->Init(options));
  im.store = store.get();
  model->set_store(std::move(store));
  im.layers.resize(L);
  GRADSUM_RETURN_IF_ERROR(im.stream.Synchronize());
  return std::unique_ptr<MoeLm>(std::move(model));
}

absl::Status MoeLmCuda::Unshard() {
  Impl& im = *impl_;
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaSetDevice(im.device), "cudaSetDevice");
  // A new step: nothing of a failed one stays in flight; the units are gathered from the
  // current host masters by the schedule as the stages need them.
  im.store->Abandon();
  GRADSUM_RETURN_IF_ERROR(im.stream.Synchronize());
  im.uploaded_version.clear();
  for (const DeviceGroup& g : im.groups) im.uploaded_version.push_back(g.host->master_version());
  im.step_failed = false;
  return absl::OkStatus();
}

absl::StatusOr<MicroBatchLosses> MoeLmCuda::ForwardBackward(const MicroBatch& batch,
                                                            const losses::StepStats& stats,
                                                            int micro_index,
                                                            losses::StepDisplay* display) {
  Impl& im = *impl_;
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaSetDevice(im.device), "cudaSetDevice");
  if (im.uploaded_version.size() != im.groups.size()) {
    return absl::FailedPreconditionError(
        "MoeLmCuda: the step was not prepared: call Unshard() before ForwardBackward");
  }
  for (size_t i = 0; i < im.groups.size(); ++i) {
    if (im.groups[i].host->master_version() != im.uploaded_version[i]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "MoeLmCuda: parameter group \"", im.groups[i].host->name(),
          "\" changed on the host since the last Unshard(): call Unshard() after every "
          "optimizer step or parameter load"));
    }
  }
  if (im.step_failed) {
    return absl::FailedPreconditionError(
        "MoeLmCuda: an earlier micro-batch of this step failed; call Unshard() to start a new "
        "step");
  }
  const int64_t V = options().model.vocab();
  for (size_t t = 0; t < batch.labels.size(); ++t) {
    const int32_t y = batch.labels[t];
    if (y != kIgnoreIndex && (y < 0 || y >= V)) {
      return absl::InvalidArgumentError(absl::StrCat("label ", y, " at position ", t,
                                                     " outside [0, ", V, ") and not ignore_index ",
                                                     kIgnoreIndex));
    }
  }
  GRADSUM_ASSIGN_OR_RETURN(
      absl::Span<const float> token_weights,
      MicroBatchTokenWeights(stats, micro_index, static_cast<int64_t>(batch.tokens.size())));
  absl::StatusOr<MicroBatchLosses> result =
      ForwardBackwardOnDevice(batch, stats, token_weights, micro_index, display);
  if (!result.ok()) {
    // The step's device gradients are incomplete: drop them and refuse to reduce them.
    im.step_failed = true;
    im.store->Abandon();
    im.store->DropGradients().IgnoreError();
    (void)im.stream.Synchronize();
  }
  return result;
}

absl::StatusOr<MicroBatchLosses> MoeLmCuda::ForwardBackwardOnDevice(
    const MicroBatch& batch, const losses::StepStats& stats, absl::Span<const float> token_weights,
    int micro_index, losses::StepDisplay* display) {
  Impl& im = *impl_;
  const ModelConfig& m = options().model;
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  const int64_t D = m.dim(), V = m.vocab(), H = m.expert_dim();
  const int E = m.experts(), K = m.top_k(), L = m.layers();
  const int P = comm().ep_group->size();
  const int El = E / P;
  const int64_t TK = T * K;
  cudaStream_t s = im.stream.get();
  GRADSUM_RETURN_IF_ERROR(CheckMicroBatchTokens(batch, V));

  // ---- Buffers for T tokens (allocated on the first micro-batch or a new T). ----
  if (im.rows != T) {
    auto f32 = [](int64_t n) { return static_cast<size_t>(n) * sizeof(float); };
    GRADSUM_RETURN_IF_ERROR(Reserve(&im.tokens, T * sizeof(int32_t)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&im.labels, T * sizeof(int64_t)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&im.mask, T));
    GRADSUM_RETURN_IF_ERROR(Reserve(&im.weights, T * sizeof(float)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&im.scalars, 5 * sizeof(double)));
    for (DeviceBuffer* b : {&im.h_last, &im.f, &im.grad_f, &im.dh, &im.da, &im.y}) {
      GRADSUM_RETURN_IF_ERROR(Reserve(b, f32(T * D)));
    }
    GRADSUM_RETURN_IF_ERROR(Reserve(&im.final_in_rstd, f32(T)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&im.head, f32(T * V)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&im.du, f32(T * E)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&im.dw, f32(TK)));
    for (DeviceBuffer* b : {&im.send, &im.d_back, &im.d_send}) {
      GRADSUM_RETURN_IF_ERROR(Reserve(b, f32(TK * D)));
    }
    for (int l = 0; l < L; ++l) {
      LayerBuffers& lb = im.layers[l];
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.h_in, f32(T * D)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.a, f32(T * D)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.rstd, f32(T)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.logits, f32(T * E)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.probs, f32(T * E)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.index, TK * sizeof(int32_t)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.weight, f32(TK)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.lse, f32(T)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.local_counts, E * sizeof(int64_t)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.global_counts, E * sizeof(int64_t)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.gating, E * sizeof(double)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.offsets, (E + 1) * sizeof(int64_t)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.permuted_copy, TK * sizeof(int64_t)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.copy_position, TK * sizeof(int64_t)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&lb.back, f32(TK * D)));
    }
    im.rows = T;
  }
  DeviceBuffer& h_last = im.h_last;  // the final norm's input

  // ---- Inputs. ----
  std::vector<int64_t> labels(batch.labels.begin(), batch.labels.end());
  std::vector<uint8_t> mask(batch.mask.begin(), batch.mask.end());
  const double scalars[5] = {stats.global_ce_weight_sum,
                             static_cast<double>(stats.global_routed_tokens), 0, 0, 0};
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(im.tokens.get(), batch.tokens.data(),
                                               T * sizeof(int32_t), cudaMemcpyHostToDevice, s),
                               "upload tokens");
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(im.labels.get(), labels.data(),
                                               T * sizeof(int64_t), cudaMemcpyHostToDevice, s),
                               "upload labels");
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(im.mask.get(), mask.data(), T, cudaMemcpyHostToDevice, s), "upload mask");
  if (!token_weights.empty()) {
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(im.weights.get(), token_weights.data(),
                                                 T * sizeof(float), cudaMemcpyHostToDevice, s),
                                 "upload CE weights");
  }
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(im.scalars.get(), scalars, sizeof(scalars),
                                               cudaMemcpyHostToDevice, s),
                               "upload step statistics");
  double* d_D = im.scalars.as<double>();
  double* d_N = d_D + 1;
  double* d_ce = d_D + 2;
  double* d_z = d_D + 3;
  double* d_bal = d_D + 4;
  const int32_t* tokens = im.tokens.as<int32_t>();
  const uint8_t* d_mask = im.mask.as<uint8_t>();

  auto param = [&](ParamRef r) { return im.groups[r.unit].param_ptr(r.index); };
  auto grad = [&](ParamRef r) { return im.groups[r.unit].grad_ptr(r.index); };
  auto rms = [&](const float* x, const float* gamma, float* y, float* rstd) {
    moe::RmsNormArgs n;
    n.dtype = DType::kF32;
    n.rows = T;
    n.width = D;
    n.eps = kRmsNormEps;
    n.x = x;
    n.gamma = gamma;
    n.y = y;
    n.rstd = rstd;
    return n;
  };
  moe::ExpertsCudaConfig ecfg;
  ecfg.d_model = D;
  ecfg.hidden = H;
  ecfg.num_local_experts = El;
  ecfg.dtype = DType::kF32;
  auto expert_weights = [&](int l) {
    moe::ExpertsCudaWeights w;
    w.gate = param(gate_ref(l));
    w.up = param(up_ref(l));
    w.down = param(down_ref(l));
    return w;
  };
  // The experts' saved activations of the rows that start at received row `first`.
  auto saved_rows = [&](const LayerBuffers& lb, int64_t first) {
    return moe::ExpertsCudaSaved{lb.gate.as<float>() + first * H, lb.up.as<float>() + first * H,
                                 lb.hidden.as<float>() + first * H};
  };
  // All-to-all-v over the NCCL EP group, ordered after the compute stream's work.
  auto all_to_all = [&](const float* send, const std::vector<size_t>& sc,
                        const std::vector<size_t>& so, float* recv, const std::vector<size_t>& rc,
                        const std::vector<size_t>& ro) -> absl::Status {
    GRADSUM_RETURN_IF_ERROR(Fence(s, im.dev.ep_group->stream(), im.fence));
    return im.dev.ep_group->AllToAllV(send, sc, so, recv, rc, ro, DType::kF32);
  };

  // ---- Forward of layer l. ----
  auto layer_forward = [&](int l) -> absl::Status {
    LayerBuffers& lb = im.layers[l];
    float* h_out = l + 1 < L ? im.layers[l + 1].h_in.as<float>() : h_last.as<float>();
    GRADSUM_RETURN_IF_ERROR(moe::RmsNormForwardCuda(
        rms(lb.h_in.as<float>(), param(norm_ref(l)), lb.a.as<float>(),
            lb.rstd.as<float>()),
        s));
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(im.blas, s, false, false, T, E, D, lb.a.get(), D,
                                         param(router_ref(l)), E, DType::kF32,
                                         lb.logits.get(), E, DType::kF32));
    moe::RouterForwardCudaArgs r;
    r.logits = lb.logits.as<float>();
    r.mask = d_mask;
    r.tokens = T;
    r.experts = E;
    r.top_k = K;
    r.norm_topk_prob = m.norm_topk_prob();
    r.router_scale = m.router_scale();
    r.probs = lb.probs.as<float>();
    r.expert_index = lb.index.as<int32_t>();
    r.combine_weight = lb.weight.as<float>();
    r.logsumexp = lb.lse.as<float>();
    r.local_expert_counts = lb.local_counts.as<int64_t>();
    r.local_gating_sums = lb.gating.as<double>();
    GRADSUM_RETURN_IF_ERROR(moe::RouterForwardCuda(r, s));  // checks inputs (a host sync)
    // c[l, m, :] of §5: SUM over the world.
    GRADSUM_RETURN_IF_ERROR(Fence(s, im.dev.world->stream(), im.fence));
    GRADSUM_RETURN_IF_ERROR(im.dev.world->AllReduce(lb.local_counts.get(), lb.global_counts.get(),
                                                    E, DType::kI64, ReduceOp::kSum));
    // Dispatch plan: copies ordered by expert, so EP rank p's rows are contiguous.
    lb.plan = moe::PermutePlanCudaArgs();
    lb.plan.expert_index = lb.index.as<int32_t>();
    lb.plan.tokens = T;
    lb.plan.top_k = K;
    lb.plan.experts = E;
    lb.plan.expert_offsets = lb.offsets.as<int64_t>();
    lb.plan.permuted_copy = lb.permuted_copy.as<int64_t>();
    lb.plan.copy_position = lb.copy_position.as<int64_t>();
    GRADSUM_RETURN_IF_ERROR(moe::PermutePlanCuda(lb.plan, s));
    GRADSUM_RETURN_IF_ERROR(
        moe::PermuteRowsCuda({lb.a.get(), DType::kF32, D, im.send.get()}, lb.plan, s));
    std::vector<int64_t> offsets(E + 1);
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(offsets.data(), lb.offsets.get(),
                                                 (E + 1) * sizeof(int64_t),
                                                 cudaMemcpyDeviceToHost, s),
                                 "download expert offsets");
    GRADSUM_RETURN_IF_ERROR(im.stream.Synchronize());
    // The per-expert row counts travel over the host EP group: they size the NCCL
    // all-to-all-v, which needs them on the host anyway.
    GRADSUM_ASSIGN_OR_RETURN(std::vector<int64_t> their_counts,
                             moe::ExchangeExpertCounts(*comm().ep_group, offsets));
    GRADSUM_ASSIGN_OR_RETURN(lb.exchange, moe::PlanEpExchange(offsets, their_counts, P, D));
    const moe::EpExchangePlan& x = lb.exchange;
    const int64_t R = x.recv_rows;
    GRADSUM_RETURN_IF_ERROR(Reserve(&lb.recv, R * D * sizeof(float)));
    for (DeviceBuffer* b : {&lb.gate, &lb.up, &lb.hidden}) {
      GRADSUM_RETURN_IF_ERROR(Reserve(b, R * H * sizeof(float)));
    }
    for (DeviceBuffer* b : {&im.expert_out, &im.d_recv, &im.dx_recv}) {
      GRADSUM_RETURN_IF_ERROR(Reserve(b, R * D * sizeof(float)));
    }
    GRADSUM_RETURN_IF_ERROR(all_to_all(im.send.as<float>(), x.send_counts, x.send_offsets,
                                       lb.recv.as<float>(), x.recv_counts, x.recv_offsets));
    for (int p = 0; p < P; ++p) {
      const int64_t first = x.source_first_row[p];
      if (x.source_offsets[p][El] == 0) continue;
      GRADSUM_RETURN_IF_ERROR(moe::ExpertsForwardCuda(
          im.blas, s, ecfg, expert_weights(l), lb.recv.as<float>() + first * D,
          x.source_offsets[p], im.expert_out.as<float>() + first * D, saved_rows(lb, first)));
    }
    // The outputs go back to where their rows came from (the reverse exchange).
    GRADSUM_RETURN_IF_ERROR(all_to_all(im.expert_out.as<float>(), x.recv_counts, x.recv_offsets,
                                       lb.back.as<float>(), x.send_counts, x.send_offsets));
    moe::CombineCudaArgs c;
    c.dtype = DType::kF32;
    c.width = D;
    c.rows = lb.back.get();
    c.weights = lb.weight.as<float>();
    c.out = im.y.get();
    GRADSUM_RETURN_IF_ERROR(moe::CombineCuda(c, lb.plan, s));
    GRADSUM_RETURN_IF_ERROR(AddCuda(lb.h_in.as<float>(), im.y.as<float>(), h_out, T * D, s));
    return absl::OkStatus();
  };

  // ---- Loss head: logits = f @ W_out, fused CE in place, and its GEMM backward (§3). ----
  auto head = [&]() -> absl::Status {
    const float* w_out = param(out_ref());
    GRADSUM_RETURN_IF_ERROR(
        moe::RmsNormForwardCuda(rms(h_last.as<float>(), param(final_norm_ref()), im.f.as<float>(),
                                    im.final_in_rstd.as<float>()),
                                s));
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(im.blas, s, false, false, T, V, D, im.f.get(), D, w_out, V,
                                         DType::kF32, im.head.get(), V, DType::kF32));
    losses::CrossEntropyCudaArgs ce;
    ce.logits = im.head.get();
    ce.dtype = DType::kF32;
    ce.rows = T;
    ce.vocab = V;
    ce.labels = im.labels.as<int64_t>();
    ce.token_weights =
        token_weights.empty() ? nullptr : im.weights.as<float>();  // null: token mode
    ce.global_weight_sum = d_D;
    ce.grad_logits = im.head.get();
    ce.loss = d_ce;
    ce.ignore_index = kIgnoreIndex;
    GRADSUM_RETURN_IF_ERROR(losses::CrossEntropyCuda(ce, s));  // checks labels (a host sync)
    // grad_f = dlogits @ W_out^T; dW_out += f^T @ dlogits.
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(im.blas, s, false, true, T, D, V, im.head.get(), V, w_out,
                                         V, DType::kF32, im.grad_f.get(), D, DType::kF32));
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(im.blas, s, true, false, D, V, T, im.f.get(), D,
                                         im.head.get(), V, DType::kF32, grad(out_ref()), V,
                                         DType::kF32, 1.0f));
    {
      moe::RmsNormArgs n =
          rms(h_last.as<float>(), param(final_norm_ref()), nullptr, im.final_in_rstd.as<float>());
      n.dy = im.grad_f.get();
      n.dx = im.dh.get();
      n.accumulate_dx = false;
      n.dgamma = grad(final_norm_ref());
      GRADSUM_RETURN_IF_ERROR(moe::RmsNormBackwardCuda(n, s));
    }
    return absl::OkStatus();
  };

  // ---- Backward of layer l; dh holds dL/dh after layer l. ----
  auto layer_backward = [&](int l) -> absl::Status {
    LayerBuffers& lb = im.layers[l];
    const moe::EpExchangePlan& x = lb.exchange;
    moe::RouterAuxCudaArgs aux;
    aux.probs = lb.probs.as<float>();
    aux.logsumexp = lb.lse.as<float>();
    aux.mask = d_mask;
    aux.tokens = T;
    aux.experts = E;
    aux.top_k = K;
    aux.alpha_z = static_cast<float>(options().alpha_z);
    aux.alpha_b = static_cast<float>(options().alpha_b);
    aux.num_micro_batches = stats.num_micro_batches;
    aux.global_routed_tokens = d_N;
    aux.global_expert_counts = lb.global_counts.as<int64_t>();
    aux.local_gating_sums = lb.gating.as<double>();
    aux.z_loss = d_z;
    aux.balance_loss = d_bal;
    aux.accumulate_loss = true;
    GRADSUM_RETURN_IF_ERROR(moe::RouterAuxLossCuda(aux, s));
    // Combine backward: rows' gradient (w * dh) and the combine weights' gradient.
    moe::CombineCudaArgs c;
    c.dtype = DType::kF32;
    c.width = D;
    c.rows = lb.back.get();
    c.weights = lb.weight.as<float>();
    c.d_out = im.dh.get();
    c.d_rows = im.d_back.get();
    c.d_weights = im.dw.as<float>();
    GRADSUM_RETURN_IF_ERROR(moe::CombineBackwardCuda(c, lb.plan, s));
    aux.expert_index = lb.index.as<int32_t>();
    aux.d_combine_weight = im.dw.as<float>();
    aux.norm_topk_prob = m.norm_topk_prob();
    aux.router_scale = m.router_scale();
    aux.d_logits = im.du.as<float>();
    aux.accumulate_grad = false;
    GRADSUM_RETURN_IF_ERROR(moe::RouterBackwardCuda(aux, s));
    // Expert backward where the rows were computed, then the input gradients come home.
    GRADSUM_RETURN_IF_ERROR(all_to_all(im.d_back.as<float>(), x.send_counts, x.send_offsets,
                                       im.d_recv.as<float>(), x.recv_counts, x.recv_offsets));
    moe::ExpertsCudaWeightGrads eg{grad(gate_ref(l)), grad(up_ref(l)), grad(down_ref(l))};
    for (int p = 0; p < P; ++p) {
      const int64_t first = x.source_first_row[p];
      if (x.source_offsets[p][El] == 0) continue;
      GRADSUM_RETURN_IF_ERROR(moe::ExpertsBackwardCuda(
          im.blas, s, ecfg, expert_weights(l), lb.recv.as<float>() + first * D,
          x.source_offsets[p], saved_rows(lb, first), im.d_recv.as<float>() + first * D,
          im.dx_recv.as<float>() + first * D, eg));
    }
    GRADSUM_RETURN_IF_ERROR(all_to_all(im.dx_recv.as<float>(), x.recv_counts, x.recv_offsets,
                                       im.d_send.as<float>(), x.send_counts, x.send_offsets));
    // The gather's backward: da[t] = sum_k d_send[pos(t, k)].
    moe::CombineCudaArgs g;
    g.dtype = DType::kF32;
    g.width = D;
    g.rows = im.d_send.get();
    g.weights = nullptr;
    g.out = im.da.get();
    g.accumulate = false;
    GRADSUM_RETURN_IF_ERROR(moe::CombineCuda(g, lb.plan, s));
    // Router GEMM backward: dWr += a^T du; da += du Wr^T.
    const float* wr = param(router_ref(l));
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(im.blas, s, true, false, D, E, T, lb.a.get(), D,
                                         im.du.get(), E, DType::kF32,
                                         grad(router_ref(l)), E, DType::kF32, 1.0f));
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(im.blas, s, false, true, T, D, E, im.du.get(), E, wr, E,
                                         DType::kF32, im.da.get(), D, DType::kF32, 1.0f));
    // Norm backward into the residual stream: dh += dL/dh through a = RMSNorm(h).
    moe::RmsNormArgs n = rms(lb.h_in.as<float>(), param(norm_ref(l)), nullptr,
                             lb.rstd.as<float>());
    n.dy = im.da.get();
    n.dx = im.dh.get();
    n.accumulate_dx = true;
    n.dgamma = grad(norm_ref(l));
    GRADSUM_RETURN_IF_ERROR(moe::RmsNormBackwardCuda(n, s));
    return absl::OkStatus();
  };

  // The stages of the shared schedule (train/unit_schedule.h): 0 the embedding, 1 + l
  // layer l, L + 1 the head.
  UnitSchedule::Stages stages;
  stages.forward = [&](int stage) -> absl::Status {
    if (stage == 0) {
      return EmbeddingForwardCuda(param(emb_ref()), tokens, T, D,
                                  im.layers.empty() ? h_last.as<float>()
                                                    : im.layers[0].h_in.as<float>(),
                                  s);
    }
    return stage <= L ? layer_forward(stage - 1) : head();
  };
  stages.backward = [&](int stage) -> absl::Status {
    if (stage > 0) return layer_backward(stage - 1);
    return EmbeddingBackwardCuda(tokens, im.dh.as<float>(), T, D, grad(emb_ref()), s);
  };
  GRADSUM_RETURN_IF_ERROR(
      schedule().RunMicroBatch(store(), stages, micro_index == stats.num_micro_batches - 1));

  // ---- Detached loss values and routing statistics for the display (§8). ----
  double losses_host[3] = {0, 0, 0};
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(losses_host, d_ce, sizeof(losses_host),
                                               cudaMemcpyDeviceToHost, s),
                               "download loss values");
  std::vector<std::vector<int64_t>> counts(L, std::vector<int64_t>(E));
  for (int l = 0; l < L; ++l) {
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(counts[l].data(), im.layers[l].global_counts.get(), E * sizeof(int64_t),
                        cudaMemcpyDeviceToHost, s),
        "download expert counts");
  }
  GRADSUM_RETURN_IF_ERROR(im.stream.Synchronize());
  MicroBatchLosses result;
  result.ce = losses_host[0];
  result.z = losses_host[1];
  result.bal = losses_host[2];
  if (display != nullptr) {
    for (int l = 0; l < L; ++l) {
      GRADSUM_RETURN_IF_ERROR(display->AddGlobalExpertCounts(l, counts[l]));
    }
    GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("ce", result.ce));
    GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("z", result.z));
    GRADSUM_RETURN_IF_ERROR(display->AddBackwardTerm("bal", result.bal));
  }
  return result;
}

absl::Status MoeLmCuda::CheckStepReducible() {
  if (impl_->step_failed) {
    return absl::FailedPreconditionError(
        "MoeLmCuda: a micro-batch of this step failed; its gradients cannot be reduced");
  }
  return absl::OkStatus();
}

}  // namespace gradsum::train
