#ifndef GRADSUM_TRAIN_CUDA_MOE_LM_CUDA_H_
#define GRADSUM_TRAIN_CUDA_MOE_LM_CUDA_H_

// moe_lm (SEMANTICS.md §10) with its forward and backward on this rank's GPU and its
// gradients SUM-reduced by NCCL: the `--backend=nccl` model of //train:moe_lm.
//
// Division of labour (the ZeRO-Offload split):
// - Host (the base MoeLm): the fp32 master parameters in FlatParam groups, AdamW, the
//   global grad norm and clipping, checkpoints, dumps and the parity check, over the host
//   communicators (MPI) of MoeLmGroups, exactly as on the CPU path.
// - Device: the compute parameters, every activation and the fp32 gradient buffers.
//   The parameter units, their order, prefetch, resharding and the issue of each unit's
//   reduction are the shared UnitSchedule's (train/unit_schedule.h), as on the host; this
//   model supplies the stages' device compute and a device UnitStore: a gather uploads
//   the unit's master (its shard in fsdp mode) on the unit's NCCL stream and all-gathers
//   it there (bf16 when compute_dtype is bf16, then widened exactly to fp32, as the CPU
//   path does); freeing a unit frees its device buffer. ForwardBackward() runs embedding,
//   RMSNorm (moe/cuda/layers_cuda.h), router and aux losses (moe/cuda/router_cuda.h),
//   permutation and the EP all-to-all-v over NCCL (moe/cuda/permute_cuda.h), grouped
//   SwiGLU experts through cuBLAS (moe/cuda/experts_cuda.h), the LM head GEMMs and fused
//   CE (losses/cuda), and their backward, in fp32 with TF32 off. As each unit's gradient
//   completes, its NCCL reduction is issued on the NCCL stream, in reduce_dtype. fsdp: a
//   reduce-scatter (per micro-batch or only on the last), waited for, downloaded and folded
//   into the host unit (FlatParam::FoldReducedGrad) before the unit's gradient is written
//   again or in FinishGradReduce(). Replicated (last micro-batch): the CPU store's
//   BucketedUnitReducers (sharding/bucketed_reduce.h) with its GradBucketer buckets in
//   device memory (each unit's gradient copied or rounded into its bucket views when
//   complete), all-reduced as each bucket completes and folded into the host masters in
//   FinishGradReduce(). Nothing divides by world, EP size or G. The NCCL communicators should be timed
//   (TimeNcclCommunicator, as train/cuda/nccl_rank.h's MakeNcclMesh does) so that their
//   collectives count in the step's comm metrics.
//
//   MoeLmDeviceGroups dev{nccl_world, nccl_ep, nccl_edp};     // same mesh as the host groups
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<MoeLm> model, MoeLmCuda::Create(options, host, dev));
//   ... then exactly the MoeLm protocol (train/moe_lm.h), or through Trainer with
//   RankComms::make_model (train/cuda/nccl_rank.h does this) ...
//
// Protocol checks beyond MoeLm's: ForwardBackward is FailedPrecondition unless Unshard() ran
// after the last change to any host group's master (FlatParam::master_version: optimizer
// steps, checkpoint loads, SetFullParameters), and InvalidArgument for a label outside
// [0, V) that is not kIgnoreIndex (checked on the host before any device work). A failed
// ForwardBackward drops the step's device gradients; ForwardBackward and FinishGradReduce
// are then FailedPrecondition until the next Unshard() (what earlier micro-batches already
// folded into the host groups is cleared by their ZeroGrad, as after any failed step).
//
// Numerics: fp32 everywhere except what compute_dtype / reduce_dtype round to bf16. A bf16
// reduction is NCCL's native bf16 sum (its order, rounding per step of the ring/tree), not
// the CPU backends' fp32 accumulation with one rounding (collectives/nccl_backend.h). The
// embedding's backward adds repeated tokens with fp32 atomics (rounding-level run-to-run
// differences); the experts run once per EP source block, so their weight gradients add
// rows in a different order than the CPU path.
//
// Host syncs per micro-batch: one per layer for the routed counts that size the EP
// exchange (NCCL needs them on the host), the collectives' own waits, and one at the end
// for the loss values. Activations are fp32 whatever compute_dtype is.
//
// Thread safety: one MoeLmCuda per rank, used by that rank's thread.

#include <memory>

#include "absl/status/statusor.h"
#include "collectives/nccl_backend.h"
#include "train/moe_lm.h"

namespace gradsum::train {

// The rank's NCCL communicators, one GPU per rank, forming the same (F, P) mesh as the host
// groups (collectives/mesh.h over the NCCL world). Not owned.
struct MoeLmDeviceGroups {
  NcclCommunicator* world = nullptr;
  NcclCommunicator* ep_group = nullptr;
  NcclCommunicator* edp_group = nullptr;
};

class MoeLmCuda : public MoeLm {
 public:
  ~MoeLmCuda() override;

  // The model on device->world's GPU. Errors: those of MoeLm::Create; InvalidArgument for
  // missing device groups or ones whose rank/size differ from the host groups';
  // FailedPrecondition without a usable GPU (the CUDA runtime's reason).
  static absl::StatusOr<std::unique_ptr<MoeLm>> Create(const MoeLmOptions& options,
                                                       const MoeLmGroups& host,
                                                       const MoeLmDeviceGroups& device);

  absl::Status Unshard() override;
  absl::StatusOr<MicroBatchLosses> ForwardBackward(const MicroBatch& batch,
                                                   const losses::StepStats& stats,
                                                   int micro_index,
                                                   losses::StepDisplay* display) override;

 private:
  struct Impl;
  MoeLmCuda();
  absl::StatusOr<MicroBatchLosses> ForwardBackwardOnDevice(
      const MicroBatch& batch, const losses::StepStats& stats,
      absl::Span<const float> token_weights, int micro_index, losses::StepDisplay* display);
  absl::Status CheckStepReducible() override;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_CUDA_MOE_LM_CUDA_H_
