#include "parallel/unit_schedule.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum::parallel {

absl::StatusOr<UnitSchedule> UnitSchedule::Create(int num_units,
                                                  std::vector<std::vector<int>> stage_units,
                                                  std::vector<bool> backward_reads,
                                                  UnitScheduleOptions options) {
  const int S = static_cast<int>(stage_units.size());
  if (S < 1 || static_cast<int>(backward_reads.size()) != S) {
    return absl::InvalidArgumentError(absl::StrCat("unit schedule: ", S, " stages and ",
                                                   backward_reads.size(), " backward flags"));
  }
  UnitSchedule u;
  u.num_units_ = num_units;
  u.first_stage_.assign(num_units, -1);
  u.last_stage_.assign(num_units, -1);
  for (int s = 0; s < S; ++s) {
    for (int unit : stage_units[s]) {
      if (unit < 0 || unit >= num_units) {
        return absl::InvalidArgumentError(absl::StrCat("unit schedule: stage ", s, " reads unit ",
                                                       unit, " outside [0, ", num_units, ")"));
      }
      if (u.last_stage_[unit] >= 0 && u.last_stage_[unit] != s - 1) {
        return absl::InvalidArgumentError(absl::StrCat("unit schedule: unit ", unit,
                                                       " is read by stages ", u.last_stage_[unit],
                                                       " and ", s, " but not by those between"));
      }
      if (u.first_stage_[unit] < 0) u.first_stage_[unit] = s;
      u.last_stage_[unit] = s;
    }
  }
  for (int unit = 0; unit < num_units; ++unit) {
    if (u.first_stage_[unit] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("unit schedule: no stage reads unit ", unit));
    }
  }
  u.stage_units_ = std::move(stage_units);
  u.backward_reads_ = std::move(backward_reads);
  u.options_ = options;
  return u;
}

absl::Status UnitSchedule::Gather(UnitStore& store, int stage, bool wait) {
  for (int u : stage_units_[stage]) GRADSUM_RETURN_IF_ERROR(store.StartGather(u));
  peak_ = std::max(peak_, store.UnshardedBytes());
  if (wait) {
    for (int u : stage_units_[stage]) GRADSUM_RETURN_IF_ERROR(store.WaitGather(u));
  }
  return absl::OkStatus();
}

// After backward(stage) (or the turn stage): the units whose gradient is now complete
// are freed and their reductions issued, the unit with the last parameters first (the
// order backward produced them).
absl::Status UnitSchedule::Complete(UnitStore& store, int stage, bool last_micro_batch) {
  const std::vector<int>& units = stage_units_[stage];
  for (auto it = units.rbegin(); it != units.rend(); ++it) {
    if (first_stage_[*it] != stage) continue;
    if (options_.sharded) GRADSUM_RETURN_IF_ERROR(store.Release(*it));
    GRADSUM_RETURN_IF_ERROR(store.StartReduce(*it, last_micro_batch));
  }
  // The reductions issued one stage earlier have had that stage's backward to complete:
  // their second stage, if any, starts now (HSDP's cross-replica all-reduce).
  if (last_micro_batch && stage + 1 < num_stages()) {
    for (int u : stage_units_[stage + 1]) {
      if (first_stage_[u] == stage + 1) GRADSUM_RETURN_IF_ERROR(store.AdvanceReduce(u));
    }
  }
  return absl::OkStatus();
}

absl::Status UnitSchedule::RunMicroBatch(UnitStore& store, const Stages& stages,
                                         bool last_micro_batch) {
  const int S = num_stages();
  // Forward.
  for (int s = 0; s + 1 < S; ++s) {
    GRADSUM_RETURN_IF_ERROR(Gather(store, s, /*wait=*/true));
    GRADSUM_RETURN_IF_ERROR(Gather(store, s + 1, /*wait=*/false));  // prefetch
    GRADSUM_RETURN_IF_ERROR(stages.forward(s));
    if (options_.sharded && options_.reshard_after_forward) {
      for (int u : stage_units_[s]) {
        if (last_stage_[u] == s) GRADSUM_RETURN_IF_ERROR(store.Release(u));
      }
    }
  }
  // The turn stage: its forward and backward in one call.
  const int turn = S - 1;
  for (int u : stage_units_[turn]) {
    if (last_stage_[u] == turn) GRADSUM_RETURN_IF_ERROR(store.WaitReduce(u));
  }
  GRADSUM_RETURN_IF_ERROR(Gather(store, turn, /*wait=*/true));
  if (turn > 0 && backward_reads_[turn - 1]) {
    GRADSUM_RETURN_IF_ERROR(Gather(store, turn - 1, /*wait=*/false));
  }
  GRADSUM_RETURN_IF_ERROR(stages.forward(turn));
  GRADSUM_RETURN_IF_ERROR(Complete(store, turn, last_micro_batch));
  // Backward.
  for (int s = turn - 1; s >= 0; --s) {
    for (int u : stage_units_[s]) {
      if (last_stage_[u] == s) GRADSUM_RETURN_IF_ERROR(store.WaitReduce(u));
    }
    if (backward_reads_[s]) GRADSUM_RETURN_IF_ERROR(Gather(store, s, /*wait=*/true));
    if (s > 0 && backward_reads_[s - 1]) {
      GRADSUM_RETURN_IF_ERROR(Gather(store, s - 1, /*wait=*/false));
    }
    GRADSUM_RETURN_IF_ERROR(stages.backward(s));
    GRADSUM_RETURN_IF_ERROR(Complete(store, s, last_micro_batch));
  }
  return absl::OkStatus();
}

absl::Status UnitSchedule::RunForward(UnitStore& store,
                                      const std::function<absl::Status(int stage)>& forward) {
  const int S = num_stages();
  for (int s = 0; s < S; ++s) {
    GRADSUM_RETURN_IF_ERROR(Gather(store, s, /*wait=*/true));
    if (s + 1 < S) GRADSUM_RETURN_IF_ERROR(Gather(store, s + 1, /*wait=*/false));  // prefetch
    GRADSUM_RETURN_IF_ERROR(forward(s));
    if (options_.sharded) {
      for (int u : stage_units_[s]) {
        if (last_stage_[u] == s) GRADSUM_RETURN_IF_ERROR(store.Release(u));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status UnitSchedule::FinishStep(UnitStore& store) { return store.FinishReductions(); }

int64_t UnitSchedule::TakePeakUnshardedBytes() {
  const int64_t p = peak_;
  peak_ = 0;
  return p;
}

}  // namespace gradsum::parallel
