// moe_lm: trains SEMANTICS.md §10's model with SUM-reduced gradients.
//
//   ./bazelw run -c opt //train:moe_lm                       # defaults: 2 thread ranks
//   ./bazelw run -c opt //train:moe_lm -- --world=4 --ep=2 --grad_acc=3 --parity_check
//   mpirun -np 4 bazel-bin/train/moe_lm --backend=mpi --world=4 --ep=2
//   mpirun -np 8 bazel-bin/train/moe_lm --backend=nccl --world=8 --ep=4   # --config=cuda build
//
// Exit status: 0 on success; 1 when the config is bad, training fails, or the parity check
// finds a difference beyond the tolerance.

#include <functional>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "collectives/mpi_backend.h"
#include "collectives/thread_backend.h"
#include "core/status.h"
#include "train/config_flags.h"
#include "train/rank_main.h"
#ifdef GRADSUM_HAVE_CUDA
#include "train/cuda/nccl_rank.h"
#endif

namespace gradsum::train {
namespace {

// One process per rank under an MPI launcher: the MPI world, rank 0 prints the banner and
// the log, `run` does the rank's work with it.
absl::Status RunOnMpiWorld(const TrainConfig& config, absl::Duration timeout,
                           const std::function<absl::Status(Communicator*, std::ostream*)>& run) {
  MpiBackendOptions options;
  options.timeout = timeout;
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> world,
                           CreateMpiWorldCommunicator(options));
  const int rank = world->rank();
  if (rank == 0) PrintBanner(config, std::cout);
  absl::Status s = run(world.get(), rank == 0 ? &std::cout : nullptr);
  world.reset();  // before MPI finalises at exit
  return Annotate(s, absl::StrCat("rank ", rank));
}

absl::Status Main() {
  GRADSUM_ASSIGN_OR_RETURN(TrainConfig config, ConfigFromFlags());
  const absl::Duration timeout = absl::Seconds(config.timeout_s());
  if (config.backend() == "thread") {
    PrintBanner(config, std::cout);
    ThreadBackendOptions options;
    options.timeout = timeout;
    GRADSUM_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> comms,
                             CreateThreadCommunicators(config.world(), options));
    std::vector<absl::Status> status(config.world());
    std::vector<std::thread> threads;
    for (int r = 0; r < config.world(); ++r) {
      threads.emplace_back(
          [&, r] { status[r] = RunRank(config, comms[r].get(), r == 0 ? &std::cout : nullptr); });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < config.world(); ++r) {
      if (!status[r].ok()) return Annotate(status[r], absl::StrCat("rank ", r));
    }
    return absl::OkStatus();
  }
  if (config.backend() == "mpi") {
    return RunOnMpiWorld(config, timeout, [&](Communicator* world, std::ostream* log) {
      return RunRank(config, world, log);
    });
  }
  if (config.backend() == "nccl") {
#ifdef GRADSUM_HAVE_CUDA
    // MPI launches the ranks and carries the host side (statistics, norms, checkpoints);
    // NCCL carries the gradients and the MoE exchange on the GPUs. One GPU needs no
    // launcher: a one-rank thread communicator is the host world.
    if (config.world() == 1) {
      PrintBanner(config, std::cout);
      ThreadBackendOptions options;
      options.timeout = timeout;
      GRADSUM_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> one,
                               CreateThreadCommunicators(1, options));
      return RunNcclRank(config, one[0].get(), &std::cout);
    }
    return RunOnMpiWorld(config, timeout, [&](Communicator* world, std::ostream* log) {
      return RunNcclRank(config, world, log);
    });
#else
    return absl::FailedPreconditionError(
        "backend=nccl: this moe_lm was built without CUDA; rebuild it with "
        "`./bazelw build --config=cuda //train:moe_lm` and run one MPI rank per GPU");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("backend=", config.backend(), ": must be thread, mpi or nccl"));
}

}  // namespace
}  // namespace gradsum::train

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::Status s = gradsum::train::Main();
  if (!s.ok()) {
    std::cerr << "moe_lm: " << s << std::endl;
    return 1;
  }
  return 0;
}
