#ifndef GRADSUM_TRAIN_STOP_SIGNAL_H_
#define GRADSUM_TRAIN_STOP_SIGNAL_H_

// A graceful stop on SIGTERM or SIGUSR1 (checkpoint.save_on_signal, --save_on_signal): the
// scheduler's preemption notice (Slurm sends SIGTERM, or --signal=USR1@T ahead of the kill)
// becomes "finish the step, save a checkpoint, exit", instead of losing every step since
// the last checkpoint. The handler only records the signal; the trainer polls it at each
// step boundary and the ranks agree (any rank's signal stops every rank, train/trainer.h).
//
//   GRADSUM_RETURN_IF_ERROR(InstallStopSignalHandlers());
//   ... at a step boundary: if (StopSignal() != 0) ...

#include "absl/status/status.h"

namespace gradsum::train {

// Installs the recording handler for SIGTERM and SIGUSR1 (idempotent; the process's other
// signals are untouched). Internal naming the signal if sigaction fails.
absl::Status InstallStopSignalHandlers();

// The first stop signal received since installation (or the last reset), else 0.
int StopSignal();

// Forgets a received signal (tests run several trainers in one process).
void ResetStopSignal();

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_STOP_SIGNAL_H_
