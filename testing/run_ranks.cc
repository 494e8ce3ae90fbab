#include "testing/run_ranks.h"

#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum::testing {

absl::StatusOr<std::vector<absl::Status>> RunRanksPerRank(
    int world, const std::function<absl::Status(Communicator&)>& fn, ThreadBackendOptions options) {
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms =
      CreateThreadCommunicators(world, options);
  if (!comms.ok()) return comms.status();
  std::vector<absl::Status> statuses(world);
  std::vector<std::thread> threads;
  threads.reserve(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { statuses[r] = fn(*(*comms)[r]); });
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

absl::Status RunRanks(int world, const std::function<absl::Status(Communicator&)>& fn,
                      ThreadBackendOptions options) {
  absl::StatusOr<std::vector<absl::Status>> statuses = RunRanksPerRank(world, fn, options);
  if (!statuses.ok()) return statuses.status();
  for (int r = 0; r < world; ++r) {
    if (!(*statuses)[r].ok()) return Annotate((*statuses)[r], absl::StrCat("rank ", r));
  }
  return absl::OkStatus();
}

}  // namespace gradsum::testing
