#include "train/fault_injection.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace gradsum::train {

absl::Status MaybeInjectFault(int rank, int64_t step) {
  const char* env = std::getenv("GRADSUM_TEST_FAULT");
  if (env == nullptr || *env == '\0') return absl::OkStatus();
  const std::string spec = env;
  const std::vector<std::string> parts = absl::StrSplit(spec, ':');
  int fault_rank = -1;
  int64_t fault_step = -1;
  const bool known = parts.size() == 3 &&
                     (parts[0] == "fail" || parts[0] == "throw" || parts[0] == "stall" ||
                      parts[0] == "stop" || parts[0] == "kill" || parts[0] == "term" ||
                      parts[0] == "nan");
  if (!known || !absl::SimpleAtoi(parts[1], &fault_rank) ||
      !absl::SimpleAtoi(parts[2], &fault_step)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GRADSUM_TEST_FAULT=", spec, ": expected MODE:RANK:STEP, MODE fail|throw|stall|stop|kill|term|nan"));
  }
  if (rank != fault_rank || step != fault_step) return absl::OkStatus();
  const std::string where = absl::StrCat("injected fault on rank ", rank, " at step ", step);
  if (parts[0] == "fail") return absl::InternalError(where);
  if (parts[0] == "throw") throw std::runtime_error(where);
  if (parts[0] == "stop") ::raise(SIGSTOP);
  if (parts[0] == "kill") ::raise(SIGKILL);
  if (parts[0] == "term") {
    ::raise(SIGTERM);
    return absl::OkStatus();
  }
  if (parts[0] == "nan") return absl::OkStatus();  // MaybeInjectNanGradient acts later
  while (true) ::pause();  // stall (or continued after stop): never returns
}

bool MaybeInjectNanGradient(int rank, int64_t step) {
  const char* env = std::getenv("GRADSUM_TEST_FAULT");
  if (env == nullptr) return false;
  const std::vector<std::string> parts = absl::StrSplit(std::string(env), ':');
  int fault_rank = -1;
  int64_t fault_step = -1;
  return parts.size() == 3 && parts[0] == "nan" && absl::SimpleAtoi(parts[1], &fault_rank) &&
         absl::SimpleAtoi(parts[2], &fault_step) && fault_rank == rank && fault_step == step;
}

}  // namespace gradsum::train
