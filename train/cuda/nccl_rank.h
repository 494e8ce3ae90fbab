#ifndef GRADSUM_TRAIN_CUDA_NCCL_RANK_H_
#define GRADSUM_TRAIN_CUDA_NCCL_RANK_H_

// One rank of `moe_lm --backend=nccl`: the rank's GPU, NCCL communicators for the
// world and its (F, P) mesh (bootstrapped over the host world), and the Trainer with the
// GPU model (train/cuda/cuda_compute.h). The host world (MPI) keeps the step statistics,
// the display, the grad norm, checkpoints and the parity check.
//
//   mpirun -np 8 bazel-bin/train/moe_lm --backend=nccl --world=8 --ep=4   # 8 GPUs, 1 node
//
// GPU choice: the node-local rank (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or
// SLURM_LOCALID; else the world rank) modulo the visible device count, so launchers that
// give each rank its own CUDA_VISIBLE_DEVICES work too. Two ranks on one GPU are refused.

#include <memory>
#include <ostream>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "collectives/nccl_backend.h"
#include "collectives/timed_communicator.h"
#include "train/config.pb.h"
#include "train/cuda/cuda_compute.h"
#include "train/rank_main.h"

namespace gradsum::train {

// The CUDA ordinal for this process (see above). FailedPrecondition naming the CUDA
// runtime's reason when no device is visible.
absl::StatusOr<int> LocalDeviceForRank(int world_rank);

// InvalidArgument naming both ranks when two ranks of `host_world` would drive the same GPU
// (same host name and PCI bus id), which NCCL refuses with an opaque error. Collective.
absl::Status CheckOneRankPerGpu(Communicator& host_world, int device);

// The rank's NCCL world, bootstrapped over `host_world` (the backend's, under the host
// mesh's timed world; its agreement check runs over a split of it unless
// options.check_agreement is false), timed into the
// host mesh's CommTimer (TimedCommunicator over NCCL's device stream, so NCCL time counts
// in comm_s and comm_exposed_s), attached to the host mesh as its device view
// (Mesh::AttachDeviceView: the same axes, SP's all-to-alls timed as kSpAllToAll): the GPU
// model's groups. Collective over the host world. Errors of CreateNcclCommunicator and
// AttachDeviceView.
absl::Status AttachNcclView(Communicator& host_world, const NcclBackendOptions& options,
                            RankMesh& mesh);

// Runs optim.steps steps on this rank. Collective over `host_world`, whose size must be
// parallelism.world. Errors: those of the NCCL bootstrap, Trainer::Create and Trainer::Run.
// `parity_check` as RunRank's.
absl::Status RunNcclRank(const TrainConfig& config, Communicator* host_world, std::ostream* log,
                         const ParityCheckFn& parity_check = {});

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_CUDA_NCCL_RANK_H_
