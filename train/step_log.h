#ifndef GRADSUM_TRAIN_STEP_LOG_H_
#define GRADSUM_TRAIN_STEP_LOG_H_

// What a run reports about its steps. The record of one step is StepMetrics
// (train/metrics.proto): global values, identical on every rank, and this rank's timings.
// This file turns records into the log line, the --metrics JSONL line and the end-of-run
// summary.
//
//   *log << StepLogLine(record, config.optim().steps()) << "\n";
//   GRADSUM_ASSIGN_OR_RETURN(std::string json, StepJsonLine(record));
//   TrainSummary summary = Summarize(history, first_step, entropy_floor, context_floor);

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/timed_communicator.h"
#include "train/metrics.pb.h"
#include "train/parity_report.h"

namespace gradsum::train {

// The step's exposed communication time (comm_exposed_s and its parts by CommKind,
// exposed_all_gather_s ... exposed_other_s) and the collectives issued by kind
// (all_gather_calls ... other_calls) from what the CommTimer took.
void SetCommExposed(const CommTimer::Exposed& exposed, StepMetrics* record);

// The part of comm_exposed_s that collectives of `kind` blocked.
double CommExposedSeconds(const StepMetrics& record, CommKind kind);

// "step  12/500 | ce 1.3123 | bal ... | params 86%": the line moe_lm prints per step
// (with "| z_out ..." after z when the record has the output z-loss of §3.2), and with
// eta_s >= 0 "| eta 3m05s" at the end: the estimated time to the last step.
std::string StepLogLine(const StepMetrics& record, int64_t total_steps, double eta_s = -1);

// "42s", "3m05s", "2h07m": a duration for a log line (seconds >= 0, rounded).
std::string HumanDuration(double seconds);

// The --metrics JSONL line: the proto3 JSON of `record` (io/proto_json.h), every field
// written, with 64-bit integers as JSON numbers (a line is data for tools: pandas, jq,
// plots) and doubles as JSON floats. Internal if a field of the record was never set (a
// zero must be written, not omitted) or protobuf cannot print it.
absl::StatusOr<std::string> StepJsonLine(const StepMetrics& record);

// The end-of-run summary over the steps a Run did.
struct TrainSummary {
  int64_t first_step = 0, last_step = 0;  // 1-based, inclusive; first > last if none ran
  double first_ce = 0, last_ce = 0;
  double tail_mean_ce = 0;  // mean CE of the last min(10, steps) steps
  // The output z-loss of SEMANTICS.md §3.2 (StepMetrics.z_out), as ce; all three < 0 when
  // the records have none (--alpha_lse = 0: the summary then prints no line for it).
  double first_z_out = -1, last_z_out = -1, tail_mean_z_out = -1;
  // The held-out CE (StepMetrics.eval_ce) at the first and last evaluated steps; steps < 0
  // when none was.
  int64_t first_eval_step = -1, last_eval_step = -1;
  double first_eval_ce = 0, last_eval_ce = 0;
  // nats/token, < 0 when unknown (a --data file): the best expected CE of a model that sees
  // only the current token, and of one that sees the whole document so far (data/markov.h).
  double entropy_floor = -1;
  double context_floor = -1;
  double seconds = 0, comm_seconds = 0, comm_exposed_seconds = 0, wait_seconds = 0;
  double comm_exposed_by_kind_seconds[kNumCommKinds] = {};  // indexed by CommKind, summed
  // Medians over the steps of comm_exposed_s / comm_s and peak_unsharded_param_bytes /
  // full_param_bytes (-1 when no step ran).
  double median_exposed_fraction = -1, median_peak_param_fraction = -1;
  // The median over the steps of peak_activation_bytes (-1 when no step ran).
  double median_peak_activation_bytes = -1;
  // Per MoE layer, maxvio of SEMANTICS.md §8 (from each step's global counts): the mean
  // over all the steps, and over the last min(10, steps) steps (the expert bias of §5.1
  // should bring the latter down).
  std::vector<double> mean_maxvio, tail_mean_maxvio;
  double tokens_per_second = 0;
  // Summed over the steps: StepMetrics.model_flops, hardware_flops, data_s; the peak MFU
  // divided by (flops_per_s / mfu of the records; 0 when none had one); the largest
  // peak_rss_bytes; the last step's consumed_tokens and consumed_sequences. The summary
  // prints them when model_flops > 0.
  double model_flops = 0, hardware_flops = 0, data_seconds = 0, peak_flops_per_s = 0;
  int64_t peak_rss_bytes = 0, consumed_tokens = 0, consumed_sequences = 0;
  std::optional<ParityReport> parity;
  // The summary lines moe_lm prints at the end.
  std::string ToString() const;
};

// The summary of the records of `history` from step `first_step` on (the steps one Run
// did; the parity report is the caller's to add).
TrainSummary Summarize(const std::vector<StepMetrics>& history, int64_t first_step,
                       double entropy_floor, double context_floor = -1);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_STEP_LOG_H_
