#include "train/stop_signal.h"

#include <signal.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace gradsum::train {
namespace {

// Lock-free, so touching it from the handler is async-signal-safe.
std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void RecordStopSignal(int signal) {
  int none = 0;
  g_signal.compare_exchange_strong(none, signal);  // keep the first
}

}  // namespace

absl::Status InstallStopSignalHandlers() {
  for (int signal : {SIGTERM, SIGUSR1}) {
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_handler = RecordStopSignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;  // blocking calls resume; the trainer polls the flag
    if (::sigaction(signal, &action, nullptr) != 0) {
      const int err = errno;
      return absl::InternalError(absl::StrCat("sigaction(", ::strsignal(signal),
                                              ") for --save_on_signal: ", std::strerror(err)));
    }
  }
  return absl::OkStatus();
}

int StopSignal() { return g_signal.load(); }

void ResetStopSignal() { g_signal.store(0); }

}  // namespace gradsum::train
