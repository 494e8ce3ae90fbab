#include "train/cuda/nccl_rank.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "collectives/nccl_backend.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"
#include "train/cuda/cuda_compute.h"
#include "train/rank_main.h"
#include "train/trainer.h"

namespace gradsum::train {

absl::StatusOr<int> LocalDeviceForRank(int world_rank) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "backend=nccl needs a CUDA device per rank; none is usable: ",
        err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount returned 0"));
  }
  int local = world_rank;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const char* v = std::getenv(var);
    int parsed = 0;
    if (v != nullptr && absl::SimpleAtoi(v, &parsed) && parsed >= 0) {
      local = parsed;
      break;
    }
  }
  return local % count;
}

absl::Status CheckOneRankPerGpu(Communicator& host_world, int device) {
  char bus[64] = {};
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(bus, sizeof(bus) - 1, device),
                               absl::StrCat("cudaDeviceGetPCIBusId(", device, ")"));
  char host[64] = {};
  gethostname(host, sizeof(host) - 1);
  const std::string id = absl::StrCat(host, " GPU ", bus);
  constexpr int kWords = 16;  // 128 bytes per rank, sent as int64 words
  std::vector<int64_t> mine(kWords, 0), all(static_cast<size_t>(kWords) * host_world.size());
  std::memcpy(mine.data(), id.data(), std::min<size_t>(id.size(), kWords * 8 - 1));
  GRADSUM_RETURN_IF_ERROR(host_world.AllGather(mine.data(), all.data(), kWords, DType::kI64));
  const int me = host_world.rank();
  for (int r = 0; r < host_world.size(); ++r) {
    if (r == me) continue;
    if (std::memcmp(all.data() + static_cast<size_t>(r) * kWords, mine.data(), kWords * 8) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("backend=nccl runs one rank per GPU, but ranks ", std::min(r, me), " and ",
                       std::max(r, me), " both use ", id, " (CUDA device ", device,
                       "): start at most one rank per visible GPU on each node"));
    }
  }
  return absl::OkStatus();
}

absl::Status AttachNcclView(Communicator& host_world, const NcclBackendOptions& options,
                            RankMesh& mesh) {
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> nccl,
                           CreateNcclCommunicator(host_world, options));
  auto timed = std::make_unique<TimedCommunicator>(std::move(nccl), mesh.timer);
  const MeshSplitFn split = TimedMeshSplit(timed.get());
  return mesh.mesh->AttachDeviceView(std::move(timed), split);
}

absl::Status RunNcclRank(const TrainConfig& config, Communicator* host_world, std::ostream* log,
                         const ParityCheckFn& parity_check) {
  if (host_world == nullptr) return absl::InvalidArgumentError("null host world communicator");
  GRADSUM_ASSIGN_OR_RETURN(const int device, LocalDeviceForRank(host_world->rank()));
  GRADSUM_RETURN_IF_ERROR(CheckOneRankPerGpu(*host_world, device));
  NcclBackendOptions options;
  options.device = device;
  options.timeout = absl::Seconds(config.comm().timeout_s());
  options.check_agreement = !config.comm().nccl_skip_agreement();
  GRADSUM_ASSIGN_OR_RETURN(RankMesh mesh, MakeRankMesh(host_world, config.parallelism()));
  GRADSUM_RETURN_IF_ERROR(AttachNcclView(*host_world, options, mesh));
  RankComms comms = mesh.comms();
  comms.make_model = CreateCudaMoeLm;
  comms.parity_check = parity_check;
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(config, comms));
  return trainer->Run(log).status();
}

}  // namespace gradsum::train
