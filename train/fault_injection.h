#ifndef GRADSUM_TRAIN_FAULT_INJECTION_H_
#define GRADSUM_TRAIN_FAULT_INJECTION_H_

// A test-only fault injection hook for the reliability tests (train/mpi_fault_test.sh): the
// environment variable GRADSUM_TEST_FAULT=MODE:RANK:STEP makes world rank RANK misbehave
// at the start of step STEP (1-based). Unset (the normal case) it does nothing.
//
//   fail   return Internal "injected fault" (a rank-local error outside any collective)
//   throw  throw std::runtime_error (an escaped exception)
//   stall  sleep until killed (a rank that stops making progress)
//   stop   raise(SIGSTOP) (a stopped process: it holds its MPI connections, sends nothing)
//   kill   raise(SIGKILL) (a rank that dies)
//   term   raise(SIGTERM) and go on (a scheduler's stop notice to one rank; with
//          --save_on_signal the run saves and stops, else the process ends)
//   nan    go on, but MaybeInjectNanGradient makes the first element this rank owns of its
//          first parameter unit's reduced gradient NaN (a diverging step, from one rank)
//   oom    STEP 0 only: MaybeInjectStartupAllocFailure throws std::bad_alloc while the rank
//          loads its data at start-up (a --data file too large for the machine's memory)
//   ringstop  raise(SIGSTOP) inside the step's first context-parallel ring exchange, once
//          its receive is posted (WithRingFault wraps the CP group; a rank stopped where its
//          ring neighbour waits for it, not in any collective)
//
// A malformed value is InvalidArgument naming it, on every rank at the first step.

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "collectives/communicator.h"

namespace gradsum::train {

absl::Status MaybeInjectFault(int rank, int64_t step);

// Whether the hook asks for a NaN gradient on `rank` at `step` (mode nan; never otherwise).
bool MaybeInjectNanGradient(int rank, int64_t step);

// Throws std::bad_alloc when the hook says oom:RANK:0 for this `rank` (Trainer::Create calls it
// where the data is loaded); does nothing otherwise, a malformed value included (the first
// step reports that).
void MaybeInjectStartupAllocFailure(int rank);

// Wraps a context-parallel group's communicator for mode ringstop: once MaybeInjectFault has
// armed it (the fault's rank and step), the group's next point-to-point receive is posted
// and then this process stops itself. Returns `group` itself when the hook asks for
// anything else (the normal case).
std::unique_ptr<Communicator> WithRingFault(std::unique_ptr<Communicator> group);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_FAULT_INJECTION_H_
