// moe_lm: trains SEMANTICS.md §10's model with SUM-reduced gradients.
//
//   ./bazelw run -c opt //train:moe_lm                       # defaults: 2 thread ranks
//   ./bazelw run -c opt //train:moe_lm -- --world=4 --ep=2 --grad_acc=3 --parity_check
//     (the parity check runs in moe_lm_parity, this file built with GRADSUM_PARITY_BINARY
//     and the fp64 reference; moe_lm hands such a run to it, see ExecParityBinary)
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

#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
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
#ifdef GRADSUM_PARITY_BINARY
#include "train/parity.h"
#endif

namespace gradsum::train {
namespace {

// The code and the message (not the status's internal payloads).
void Report(const absl::Status& s) {
  std::cerr << "moe_lm: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << std::endl;
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

// The rank threads of one process. They start behind a gate, so that if the system refuses
// one, none has begun (a started rank would wait for the missing one until the timeout),
// and they are waited for with a bound once one has failed on its own: its peers learn of
// it within the collective timeout, so a rank still running `grace` later is stuck outside
// any collective (a blocked file operation) and would keep the process alive forever.
class RankThreads {
 public:
  explicit RankThreads(std::function<absl::Status(int)> run) : run_(std::move(run)) {}

  // Starts `world` threads, thread r running run(r). ResourceExhausted naming the limits if
  // the system refuses one; none has run then, and none is left.
  absl::Status Start(int world) {
    status_.assign(world, absl::OkStatus());
    finished_.assign(world, false);
    for (int r = 0; r < world; ++r) {
      try {
        threads_.emplace_back([this, r] { RunRank(r); });
      } catch (const std::system_error& e) {
        Release(/*go=*/false);
        for (std::thread& t : threads_) t.join();
        threads_.clear();
        return absl::ResourceExhaustedError(absl::StrCat(
            "could not start ", world, " rank threads: the system refused rank thread ", r + 1,
            " (", e.what(), "); ", ThreadLimits(world - r)));
      }
    }
    Release(/*go=*/true);
    return absl::OkStatus();
  }

  // Waits for every rank (true), or, once a rank has failed with an error its peers need not
  // know (not agreed), for at most `grace` more (false: the ranks still running are stuck;
  // the caller ends the process without destroying this).
  bool Wait(absl::Duration grace) {
    std::unique_lock<std::mutex> lock(mu_);
    while (done_ < static_cast<int>(threads_.size())) {
      if (!first_local_failure_.has_value()) {
        cv_.wait(lock);
        continue;
      }
      const absl::Time deadline = *first_local_failure_ + grace;
      if (absl::Now() >= deadline) return false;
      cv_.wait_for(lock, absl::ToChronoNanoseconds(deadline - absl::Now()));
    }
    lock.unlock();
    for (std::thread& t : threads_) t.join();
    return true;
  }

  // After Wait: each rank's outcome, and whether it ended.
  absl::Status status(int r) {
    std::lock_guard<std::mutex> lock(mu_);
    return status_[r];
  }
  bool finished(int r) {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_[r];
  }

 private:
  void Release(bool go) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      (go ? go_ : abandon_) = true;
    }
    cv_.notify_all();
  }

  void RunRank(int r) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return go_ || abandon_; });
      if (abandon_) return;
    }
    const absl::Status s = CatchExceptions([&] { return run_(r); });
    std::lock_guard<std::mutex> lock(mu_);
    status_[r] = s;
    finished_[r] = true;
    ++done_;
    if (!s.ok() && !IsAgreedFailure(s) && !first_local_failure_.has_value()) {
      first_local_failure_ = absl::Now();
    }
    cv_.notify_all();
  }

  const std::function<absl::Status(int)> run_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool go_ = false, abandon_ = false;
  int done_ = 0;
  std::optional<absl::Time> first_local_failure_;
  std::vector<absl::Status> status_;
  std::vector<bool> finished_;
  std::vector<std::thread> threads_;
};

// Thread ranks, parallelism.world of them in this process, each running `run` with its
// communicator (rank 0 gets the log): every failing rank's message, once for an error they
// all agreed on. Before anything starts, the process checks that the system lets it have
// every thread the run needs (CheckThreadsCanStart). Returns the exit status.
int RunOnThreads(const TrainConfig& config, absl::Duration timeout,
                 const std::function<absl::Status(Communicator*, std::ostream*)>& run) {
  PrintBanner(config, std::cout);
  const int world = config.parallelism().world();
  const int64_t threads = ThreadBackendThreads(config);
  auto report_threads = [&](const absl::Status& s) {
    Report(absl::Status(s.code(), absl::StrCat(s.message(),
                                               ". Run fewer ranks (--world), raise the limit, or "
                                               "run one process per rank (--backend=mpi)")));
    return 1;
  };
  absl::Status s = CheckThreadsCanStart(
      threads, absl::StrCat(world, " rank threads (", threads,
                            " threads with the worker threads of their communicators)"));
  if (!s.ok()) return report_threads(s);
  ThreadBackendOptions options;
  options.timeout = timeout;
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms =
      absl::UnknownError("not created");
  s = CatchExceptions([&] {
    comms = CreateThreadCommunicators(world, options);
    return comms.status();
  });
  if (!s.ok()) {
    if (s.code() == absl::StatusCode::kResourceExhausted) return report_threads(s);
    Report(s);
    return 1;
  }
  RankThreads ranks([&](int r) { return run((*comms)[r].get(), r == 0 ? &std::cout : nullptr); });
  s = ranks.Start(world);
  if (!s.ok()) return report_threads(s);
  // A rank's peers learn of its failure within the collective timeout; 5 s more for them to
  // end.
  const bool all_ended = ranks.Wait(timeout + absl::Seconds(5));
  int rc = 0;
  for (int r = 0; r < world; ++r) {
    if (!ranks.finished(r)) continue;
    const absl::Status status = ranks.status(r);
    if (status.ok()) continue;
    if (IsAgreedFailure(status)) {
      Report(status);  // identical on every rank, and it names every failing rank
      rc = 1;
      break;
    }
    Report(Annotate(status, absl::StrCat("rank ", r)));
    rc = 1;
  }
  if (!all_ended) {
    std::vector<int> stuck;
    for (int r = 0; r < world; ++r) {
      if (!ranks.finished(r)) stuck.push_back(r);
    }
    Report(absl::DeadlineExceededError(
        absl::StrCat("rank(s) ", absl::StrJoin(stuck, ", "),
                     " did not end within --timeout_s=", absl::ToDoubleSeconds(timeout),
                     " s + 5 s after a rank failed: stuck outside any "
                     "collective (a blocked file operation?); ending the process")));
    std::cout.flush();
    std::_Exit(1);  // a stuck thread cannot be joined
  }
  return rc;
}

// Step 1's parity check, linked into moe_lm_parity (this file built with
// GRADSUM_PARITY_BINARY) and not into moe_lm, which does not link the fp64 reference
// (testing/); train/parity_report.h.
ParityCheckFn LinkedParityCheck() {
#ifdef GRADSUM_PARITY_BINARY
  return RunParityCheck;
#else
  return {};
#endif
}

// moe_lm with --parity_check: runs moe_lm_parity, built beside it (//train:moe_lm carries it
// as data), with the same arguments, in this process (before any rank or MPI starts, so an
// MPI launcher's process becomes the parity binary's). Returns only when it cannot.
int ExecParityBinary(char** argv) {
  std::vector<std::filesystem::path> tried;
  std::error_code no_proc;  // without /proc only argv[0]'s directory is tried
  for (const std::filesystem::path& dir :
       {std::filesystem::path(argv[0]).parent_path(),
        std::filesystem::read_symlink("/proc/self/exe", no_proc).parent_path()}) {
    const std::filesystem::path candidate = (dir.empty() ? "." : dir) / "moe_lm_parity";
    tried.push_back(candidate);
    if (access(candidate.c_str(), X_OK) == 0) {
      std::cout.flush();
      execv(candidate.c_str(), argv);
    }
  }
  Report(absl::FailedPreconditionError(absl::StrCat(
      "--parity_check runs in moe_lm_parity (the fp64 reference is not linked into moe_lm), "
      "which is not beside this binary (tried ",
      absl::StrJoin(
          tried, ", ",
          [](std::string* out, const std::filesystem::path& p) { out->append(p.string()); }),
      "): build it with `./bazelw build //train:moe_lm_parity` and run it with the same flags")));
  return 1;
}

int Main(char** argv) {
  absl::StatusOr<TrainConfig> config = ConfigFromFlags();
  absl::Status s = config.status();
  const ParityCheckFn parity = LinkedParityCheck();
  if (s.ok() && config->debug().parity_check() && !parity) return ExecParityBinary(argv);
  if (s.ok()) s = CheckResourceBounds(*config, MachineMemoryBytes());
  if (!s.ok()) {
    Report(s);
    return 1;
  }
  const absl::Duration timeout = absl::Seconds(config->comm().timeout_s());
  switch (config->comm().backend()) {
    case TrainConfig::thread:
      return RunOnThreads(*config, timeout, [&](Communicator* world, std::ostream* log) {
        return RunRank(*config, world, log, parity);
      });
    case TrainConfig::mpi:
      return RunOnMpiWorld(*config, timeout, [&](Communicator* world, std::ostream* log) {
        return RunRank(*config, world, log, parity);
      });
    case TrainConfig::nccl:
#ifdef GRADSUM_HAVE_CUDA
      // MPI launches the ranks and carries the host side (statistics, norms, checkpoints);
      // NCCL carries the gradients and the MoE exchange on the GPUs. One GPU needs no
      // launcher: a one-rank thread communicator is the host world.
      if (config->parallelism().world() == 1) {
        return RunOnThreads(*config, timeout, [&](Communicator* world, std::ostream* log) {
          return RunNcclRank(*config, world, log, parity);
        });
      }
      return RunOnMpiWorld(*config, timeout, [&](Communicator* world, std::ostream* log) {
        return RunNcclRank(*config, world, log, parity);
      });
#else
      Report(absl::FailedPreconditionError(
          "backend=nccl: this moe_lm was built without CUDA; rebuild it with "
          "`./bazelw build --config=cuda //train:moe_lm` and run one MPI rank per GPU"));
      return 1;
#endif
  }
  Report(
      absl::InternalError(absl::StrCat("comm.backend=", config->comm().backend(), ": unhandled")));
  return 1;
}

}  // namespace
}  // namespace gradsum::train

int main(int argc, char** argv) {
  // --help lists the training flags (train/config_flags.cc), not absl's own.
  absl::SetProgramUsageMessage(
      "trains SEMANTICS.md §10's MoE language model with SUM-reduced gradients.\n"
      "  moe_lm [--config=FILE] [--flag=value ...]   (flags override single config fields)\n"
      "  mpirun -np N moe_lm --backend=mpi --world=N ...\n"
      "A flag left out keeps the config's value (\"default: ;\" below): the defaults are "
      "train/config.proto's.\n"
      "Exit status 0 on success, 1 on a bad config or a failed run (the message names the "
      "field, the value or the failing rank).");
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "train/config_flags");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  // The last line: an exception that escaped everything else still ends in a message and
  // status 1 (and, under MPI, ends the job), never in std::terminate's abort.
  int rc = 1;
  const absl::Status s = gradsum::train::CatchExceptions([&] {
    rc = gradsum::train::Main(argv);
    return absl::OkStatus();
  });
  if (!s.ok()) {
    gradsum::train::Report(s);
    gradsum::AbortMpiJob(1);
    return 1;
  }
  return rc;
}
