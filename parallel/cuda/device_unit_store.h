#ifndef GRADSUM_PARALLEL_CUDA_DEVICE_UNIT_STORE_H_
#define GRADSUM_PARALLEL_CUDA_DEVICE_UNIT_STORE_H_

// A GPU's UnitStore (parallel/unit_schedule.h), the ZeRO-Offload split: the fp32 master
// parameters, AdamW, the grad norm and checkpoints stay in the host units (FlatParams);
// the device holds each unit's compute values while gathered and its fp32 gradient.
// - A gather uploads the host master (this rank's shard in fsdp mode) on the unit's NCCL
//   stream and all-gathers it there (bf16 when compute_dtype is bf16, then widened exactly
//   to fp32 on the compute stream, as the CPU path does); freeing a unit frees its buffer.
// - A unit's reduction is issued on the NCCL stream after a fence on the compute stream, in
//   reduce_dtype. fsdp: a reduce-scatter (every micro-batch or only the last), waited for,
//   downloaded and folded into the host unit (FlatParam::FoldReducedGrad) before the unit's
//   gradient is written again or in FinishReductions. Replicated (last micro-batch): the
//   host store's BucketedUnitReducers (parallel/bucketed_reduce.h) with its GradBucketer
//   buckets in device memory (each unit's gradient copied or rounded into its bucket views
//   when complete), all-reduced as each bucket completes and folded into the host masters.
// Nothing divides by world, EP size or G.
//
// The step's protocol (UnitStore::CheckMicroBatch): a micro-batch is FailedPrecondition
// unless PrepareStep ran after the last change to any host unit's master
// (FlatParam::master_version: optimizer steps, checkpoint loads, SetFullParameters). A
// failed micro-batch drops the step's device gradients; micro-batches and
// FinishReductions are then FailedPrecondition until the next PrepareStep (what earlier
// micro-batches folded into the host units is cleared by their ZeroGrad, as after any
// failed step). Exact gradients are Unimplemented here.
//
// Numerics: a bf16 reduction is NCCL's native bf16 sum (its order, rounding per step of
// the ring/tree), not the CPU backends' fp32 accumulation with one rounding.

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "collectives/mesh.h"
#include "core/cuda/compute_context.h"
#include "parallel/parallelize.h"

namespace gradsum::parallel {

// The rank's GPU and NCCL communicators (not owned; they must outlive the stores; their
// streams are reached through device_stream()), the same mesh as the host groups.
class CudaUnitDevice : public UnitDevice {
 public:
  // `mesh` (not owned; it must outlive the device) with its NCCL device view
  // (Mesh::AttachDeviceView).
  CudaUnitDevice(std::shared_ptr<cuda::ComputeContext> context, const Mesh& mesh)
      : context_(std::move(context)), mesh_(&mesh) {}

  // Dense units are reduced over the device view's dp_shard group (the NCCL world, or with
  // HSDP the dense shard group), expert units over edp_shard (the NCCL EDP group, or the
  // expert shard group); with HSDP each unit's host FlatParam sums its step's shard across
  // the replicas when the last micro-batch is folded. InvalidArgument without an NCCL
  // device view, or when a unit's shard group is not the size of its NCCL group.
  // Unimplemented for exact gradients; InvalidArgument for a compute dtype other than
  // f32 or bf16.
  absl::StatusOr<std::unique_ptr<UnitStore>> MakeStore(std::vector<FlatParam*> units,
                                                       std::vector<bool> expert_unit,
                                                       const ParallelOptions& options) override;

 private:
  std::shared_ptr<cuda::ComputeContext> context_;
  const Mesh* mesh_;
};

}  // namespace gradsum::parallel

#endif  // GRADSUM_PARALLEL_CUDA_DEVICE_UNIT_STORE_H_
