// moe_lm: trains SEMANTICS.md §10's model with SUM-reduced gradients.
//
//   ./bazelw run -c opt //train:moe_lm                       # defaults: 2 thread ranks
//   ./bazelw run -c opt //train:moe_lm -- --world=4 --ep=2 --grad_acc=3 --parity_check
//   mpirun -np 4 bazel-bin/train/moe_lm --backend=mpi --world=4 --ep=2
//   mpirun -np 8 bazel-bin/train/moe_lm --backend=nccl --world=8 --ep=4   # --config=cuda build
//
// Exit status: 0 on success; 1 when the config is bad, training fails, or the parity check
// finds a difference beyond the tolerance.
//
// Failures (docs/ARCHITECTURE.md, "Failures"): an error one rank finds outside a collective
// reaches every rank at the next agreement point (start-up, checkpoint load/save, step
// boundaries; collectives/status_agreement.h), and rank 0 reports every failing rank's message;
// the ranks then end normally with status 1. An error only one rank knows about (a collective
// that timed out because a peer is stopped or dead) is reported by that rank, which then
// aborts the whole MPI job (AbortMpiJob): nothing waits in MPI_Finalize for a peer that
// cannot come. An escaped exception becomes an error status the same way (CatchExceptions).

#include <functional>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "collectives/mpi_backend.h"
#include "collectives/status_agreement.h"
#include "collectives/thread_backend.h"
#include "core/status.h"
#include "train/config.h"
#include "train/config_flags.h"
#include "train/rank_main.h"
#ifdef GRADSUM_HAVE_CUDA
#include "train/cuda/nccl_rank.h"
#endif

namespace gradsum::train {
namespace {

// The code and the message (not the status's internal payloads).
void Report(const absl::Status& s) {
  std::cerr << "moe_lm: " << absl::StatusCodeToString(s.code()) << ": " << s.message()
            << std::endl;
}

// One process per rank under an MPI launcher: the MPI world, rank 0 prints the banner and
// the log, `run` does the rank's work with it. Returns the exit status.
int RunOnMpiWorld(const TrainConfig& config, absl::Duration timeout,
                  const std::function<absl::Status(Communicator*, std::ostream*)>& run) {
  MpiBackendOptions options;
  options.timeout = timeout;
  absl::StatusOr<std::unique_ptr<Communicator>> world = CreateMpiWorldCommunicator(options);
  if (!world.ok()) {
    Report(world.status());
    AbortMpiJob(1);
    return 1;
  }
  const int rank = (*world)->rank();
  if (rank == 0) PrintBanner(config, std::cout);
  const absl::Status s =
      CatchExceptions([&] { return run(world->get(), rank == 0 ? &std::cout : nullptr); });
  if (s.ok() || IsAgreedFailure(s)) {
    // Every rank knows the outcome and ends here: rank 0 reports, MPI finalises normally.
    if (!s.ok() && rank == 0) Report(s);
    world->reset();  // before MPI finalises at exit
    return s.ok() ? 0 : 1;
  }
  // Only this rank may know: report, then end the whole job (a peer may be stopped or dead,
  // and MPI_Finalize would wait for it).
  Report(Annotate(s, absl::StrCat("rank ", rank)));
  AbortMpiJob(1);
  return 1;
}

// Thread ranks, parallelism.world of them in this process, each running `run` with its
// communicator (rank 0 gets the log): every failing rank's message, once for an error they
// all agreed on. Returns the exit status.
int RunOnThreads(const TrainConfig& config, absl::Duration timeout,
                 const std::function<absl::Status(Communicator*, std::ostream*)>& run) {
  PrintBanner(config, std::cout);
  ThreadBackendOptions options;
  options.timeout = timeout;
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms =
      CreateThreadCommunicators(config.parallelism().world(), options);
  if (!comms.ok()) {
    Report(comms.status());
    return 1;
  }
  std::vector<absl::Status> status(config.parallelism().world());
  std::vector<std::thread> threads;
  for (int r = 0; r < config.parallelism().world(); ++r) {
    threads.emplace_back([&, r] {
      status[r] =
          CatchExceptions([&] { return run((*comms)[r].get(), r == 0 ? &std::cout : nullptr); });
    });
  }
  for (std::thread& t : threads) t.join();
  int rc = 0;
  for (int r = 0; r < config.parallelism().world(); ++r) {
    if (status[r].ok()) continue;
    if (IsAgreedFailure(status[r])) {
      Report(status[r]);  // identical on every rank, and it names every failing rank
      return 1;
    }
    Report(Annotate(status[r], absl::StrCat("rank ", r)));
    rc = 1;
  }
  return rc;
}

int Main() {
  absl::StatusOr<TrainConfig> config = ConfigFromFlags();
  absl::Status s = config.status();
  if (s.ok()) s = CheckResourceBounds(*config, MachineMemoryBytes());
  if (!s.ok()) {
    Report(s);
    return 1;
  }
  const absl::Duration timeout = absl::Seconds(config->comm().timeout_s());
  switch (config->comm().backend()) {
    case TrainConfig::thread:
      return RunOnThreads(*config, timeout, [&](Communicator* world, std::ostream* log) {
        return RunRank(*config, world, log);
      });
    case TrainConfig::mpi:
      return RunOnMpiWorld(*config, timeout, [&](Communicator* world, std::ostream* log) {
        return RunRank(*config, world, log);
      });
    case TrainConfig::nccl:
#ifdef GRADSUM_HAVE_CUDA
      // MPI launches the ranks and carries the host side (statistics, norms, checkpoints);
      // NCCL carries the gradients and the MoE exchange on the GPUs. One GPU needs no
      // launcher: a one-rank thread communicator is the host world.
      if (config->parallelism().world() == 1) {
        return RunOnThreads(*config, timeout, [&](Communicator* world, std::ostream* log) {
          return RunNcclRank(*config, world, log);
        });
      }
      return RunOnMpiWorld(*config, timeout, [&](Communicator* world, std::ostream* log) {
        return RunNcclRank(*config, world, log);
      });
#else
      Report(absl::FailedPreconditionError(
          "backend=nccl: this moe_lm was built without CUDA; rebuild it with "
          "`./bazelw build --config=cuda //train:moe_lm` and run one MPI rank per GPU"));
      return 1;
#endif
  }
  Report(absl::InternalError(
      absl::StrCat("comm.backend=", config->comm().backend(), ": unhandled")));
  return 1;
}

}  // namespace
}  // namespace gradsum::train

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // The last line: an exception that escaped everything else still ends in a message and
  // status 1 (and, under MPI, ends the job), never in std::terminate's abort.
  int rc = 1;
  const absl::Status s = gradsum::train::CatchExceptions([&] {
    rc = gradsum::train::Main();
    return absl::OkStatus();
  });
  if (!s.ok()) {
    gradsum::train::Report(s);
    gradsum::AbortMpiJob(1);
    return 1;
  }
  return rc;
}
