// The job that mpi_watchdog_test.sh launches under mpirun: with the default blocking sync
// calls (agreement check on unless "nocheck"), the last rank never makes the sync call that
// the others make. The watchdog must report DeadlineExceeded for the waiting ranks and end
// the whole job within about the 1 s timeout. Exit 0 (the test's failure) means the call
// returned instead; exit 3 means something else went wrong.
//
//   mpi_watchdog_test_main all_reduce|broadcast|barrier [nocheck]

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/mpi_backend.h"

int main(int argc, char** argv) {
  const char* what = argc > 1 ? argv[1] : "all_reduce";
  gradsum::MpiBackendOptions options;
  options.timeout = absl::Seconds(1);
  options.check_agreement = !(argc > 2 && std::strcmp(argv[2], "nocheck") == 0);
  absl::StatusOr<std::unique_ptr<gradsum::Communicator>> world =
      gradsum::CreateMpiWorldCommunicator(options);
  if (!world.ok()) {
    std::fprintf(stderr, "setup failed: %s\n", world.status().ToString().c_str());
    gradsum::AbortMpiJob(3);
    return 3;
  }
  gradsum::Communicator& comm = **world;
  // Everyone arrives once: the watchdog must not fire on calls that complete.
  float x = 1;
  for (int i = 0; i < 100; ++i) {
    const absl::Status s = comm.AllReduce(&x, &x, 1, gradsum::DType::kF32);
    if (!s.ok()) {
      std::fprintf(stderr, "warm-up failed: %s\n", s.ToString().c_str());
      gradsum::AbortMpiJob(3);
      return 3;
    }
  }
  if (comm.rank() == comm.size() - 1) {
    // Never calls; the job must end long before this sleep does.
    std::this_thread::sleep_for(std::chrono::seconds(60));
    world->reset();
    return 0;
  }
  absl::Status s;
  if (std::strcmp(what, "broadcast") == 0) {
    s = comm.Broadcast(&x, 1, gradsum::DType::kF32, comm.size() - 1);  // the absent root
  } else if (std::strcmp(what, "barrier") == 0) {
    s = comm.Barrier();
  } else {
    s = comm.AllReduce(&x, &x, 1, gradsum::DType::kF32);
  }
  std::fprintf(stderr, "rank %d: the call returned: %s\n", comm.rank(), s.ToString().c_str());
  world->reset();
  return 0;
}
