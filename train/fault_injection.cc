#include "train/fault_injection.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "collectives/forwarding_communicator.h"
#include "core/status.h"

namespace gradsum::train {

namespace {

// GRADSUM_TEST_FAULT parsed: unset or empty gives no value; a malformed one InvalidArgument.
struct Fault {
  std::string mode;
  int rank = -1;
  int64_t step = -1;
};

absl::StatusOr<std::optional<Fault>> ParseFault() {
  const char* env = std::getenv("GRADSUM_TEST_FAULT");
  if (env == nullptr || *env == '\0') return std::nullopt;
  const std::string spec = env;
  const std::vector<std::string> parts = absl::StrSplit(spec, ':');
  Fault f;
  const bool known =
      parts.size() == 3 && (parts[0] == "fail" || parts[0] == "throw" || parts[0] == "stall" ||
                            parts[0] == "stop" || parts[0] == "kill" || parts[0] == "term" ||
                            parts[0] == "nan" || parts[0] == "oom" || parts[0] == "ringstop");
  if (!known || !absl::SimpleAtoi(parts[1], &f.rank) || !absl::SimpleAtoi(parts[2], &f.step)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GRADSUM_TEST_FAULT=", spec,
                     ": expected MODE:RANK:STEP, MODE "
                     "fail|throw|stall|stop|kill|term|nan|oom|ringstop"));
  }
  f.mode = parts[0];
  return std::optional<Fault>(std::move(f));
}

// Set by MaybeInjectFault for mode ringstop at its rank and step; read by the CP group's
// wrapper when the ring posts its receive.
std::atomic<bool> g_ring_stop_armed{false};

class RingFaultCommunicator final : public ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  absl::StatusOr<std::unique_ptr<Work>> RecvAsync(void* buf, size_t count, DType dtype, int peer,
                                                  int tag) override {
    absl::StatusOr<std::unique_ptr<Work>> work = inner().RecvAsync(buf, count, dtype, peer, tag);
    if (g_ring_stop_armed.exchange(false)) ::raise(SIGSTOP);
    return work;
  }
};

}  // namespace

std::unique_ptr<Communicator> WithRingFault(std::unique_ptr<Communicator> group) {
  const absl::StatusOr<std::optional<Fault>> fault = ParseFault();
  if (group == nullptr || !fault.ok() || !fault->has_value() || (*fault)->mode != "ringstop") {
    return group;
  }
  return std::make_unique<RingFaultCommunicator>(std::move(group));
}

absl::Status MaybeInjectFault(int rank, int64_t step) {
  GRADSUM_ASSIGN_OR_RETURN(const std::optional<Fault> fault, ParseFault());
  if (!fault.has_value() || rank != fault->rank || step != fault->step) {
    return absl::OkStatus();
  }
  const std::string& mode = fault->mode;
  const std::string where = absl::StrCat("injected fault on rank ", rank, " at step ", step);
  if (mode == "fail") return absl::InternalError(where);
  if (mode == "throw") throw std::runtime_error(where);
  if (mode == "stop") ::raise(SIGSTOP);
  if (mode == "kill") ::raise(SIGKILL);
  if (mode == "term") {
    ::raise(SIGTERM);
    return absl::OkStatus();
  }
  if (mode == "ringstop") {
    g_ring_stop_armed.store(true);
    return absl::OkStatus();
  }
  if (mode == "nan" || mode == "oom") return absl::OkStatus();  // they act elsewhere
  while (true) ::pause();  // stall (or continued after stop): never returns
}

bool MaybeInjectNanGradient(int rank, int64_t step) {
  const absl::StatusOr<std::optional<Fault>> fault = ParseFault();
  return fault.ok() && fault->has_value() && (*fault)->mode == "nan" && (*fault)->rank == rank &&
         (*fault)->step == step;
}

void MaybeInjectStartupAllocFailure(int rank) {
  const absl::StatusOr<std::optional<Fault>> fault = ParseFault();
  if (fault.ok() && fault->has_value() && (*fault)->mode == "oom" && (*fault)->rank == rank &&
      (*fault)->step == 0) {
    throw std::bad_alloc();
  }
}

}  // namespace gradsum::train
