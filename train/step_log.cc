#include "train/step_log.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "io/proto_json.h"

namespace gradsum::train {
namespace {

// "65.2 GFLOP/s", "1.23 TFLOP/s".
std::string HumanFlops(double per_second) {
  if (per_second >= 1e12) return absl::StrFormat("%.2f TFLOP/s", per_second / 1e12);
  if (per_second >= 1e9) return absl::StrFormat("%.1f GFLOP/s", per_second / 1e9);
  return absl::StrFormat("%.1f MFLOP/s", per_second / 1e6);
}

std::string HumanRate(double per_second) {
  if (per_second >= 1e6) return absl::StrFormat("%.2fM", per_second / 1e6);
  if (per_second >= 1e3) return absl::StrFormat("%.1fk", per_second / 1e3);
  return absl::StrFormat("%.0f", per_second);
}

// The median of `v` (the mean of the middle two for an even count); -1 when empty.
double Median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

void SetCommExposed(const CommTimer::Exposed& exposed, StepMetrics* record) {
  auto seconds = [&](CommKind kind) {
    return absl::ToDoubleSeconds(exposed.by_kind[static_cast<int>(kind)]);
  };
  record->set_comm_exposed_s(absl::ToDoubleSeconds(exposed.total));
  record->set_exposed_all_gather_s(seconds(CommKind::kAllGather));
  record->set_exposed_reduce_scatter_s(seconds(CommKind::kReduceScatter));
  record->set_exposed_all_reduce_s(seconds(CommKind::kAllReduce));
  record->set_exposed_all_to_all_s(seconds(CommKind::kAllToAll));
  record->set_exposed_sp_all_to_all_s(seconds(CommKind::kSpAllToAll));
  record->set_exposed_cp_ring_s(seconds(CommKind::kCpRing));
  record->set_exposed_other_s(seconds(CommKind::kOther));
  auto calls = [&](CommKind kind) { return exposed.calls[static_cast<int>(kind)]; };
  record->set_all_gather_calls(calls(CommKind::kAllGather));
  record->set_reduce_scatter_calls(calls(CommKind::kReduceScatter));
  record->set_all_reduce_calls(calls(CommKind::kAllReduce));
  record->set_all_to_all_calls(calls(CommKind::kAllToAll));
  record->set_sp_all_to_all_calls(calls(CommKind::kSpAllToAll));
  record->set_cp_ring_calls(calls(CommKind::kCpRing));
  record->set_other_calls(calls(CommKind::kOther));
}

double CommExposedSeconds(const StepMetrics& record, CommKind kind) {
  switch (kind) {
    case CommKind::kAllGather:
      return record.exposed_all_gather_s();
    case CommKind::kReduceScatter:
      return record.exposed_reduce_scatter_s();
    case CommKind::kAllReduce:
      return record.exposed_all_reduce_s();
    case CommKind::kAllToAll:
      return record.exposed_all_to_all_s();
    case CommKind::kSpAllToAll:
      return record.exposed_sp_all_to_all_s();
    case CommKind::kCpRing:
      return record.exposed_cp_ring_s();
    case CommKind::kOther:
      break;
  }
  return record.exposed_other_s();
}

std::string HumanDuration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  if (s < 60) return absl::StrFormat("%ds", s);
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
}

std::string StepLogLine(const StepMetrics& r, int64_t total_steps, double eta_s) {
  const double exposed_pct = r.step_s() > 0 ? 100.0 * r.comm_exposed_s() / r.step_s() : 0.0;
  // The output z-loss (§3.2) only in runs that have it, after the router's z; then the
  // further label streams' head terms (StepMetrics.mtp), nothing for the main stream only.
  std::string extra = r.has_z_out() ? absl::StrFormat(" | z_out %.6f", r.z_out()) : "";
  if (r.has_eval_ce()) absl::StrAppendFormat(&extra, " | eval ce %.4f", r.eval_ce());
  for (int j = 0; j < r.mtp_size(); ++j) {
    absl::StrAppendFormat(&extra, "%s%.4f", j == 0 ? " | mtp " : " ", r.mtp(j));
  }
  // The FLOP rate and MFU where the record has them (the trainer's always do).
  std::string rate = absl::StrCat(HumanRate(r.tokens_per_s()), " tok/s");
  if (r.has_flops_per_s()) {
    absl::StrAppend(&rate, ", ", HumanFlops(r.flops_per_s()));
    if (r.mfu() > 0) absl::StrAppendFormat(&rate, ", mfu %.1f%%", 100 * r.mfu());
  }
  return absl::StrFormat(
      "step %*d/%d | ce %.4f | bal %.6f | z %.6f%s | valid %d | gnorm %.4f | lr %.2e | "
      "%s | comm %.1f ms, exposed %.1f ms (%.0f%%) | wait %.1f ms | params %.0f%%%s",
      static_cast<int>(absl::StrCat(total_steps).size()), r.step(), total_steps, r.ce(), r.bal(),
      r.z(), extra, r.valid_tokens(), r.grad_norm(), r.lr(), rate, r.comm_s() * 1e3,
      r.comm_exposed_s() * 1e3, exposed_pct, r.wait_s() * 1e3,
      r.full_param_bytes() > 0 ? 100.0 * r.peak_unsharded_param_bytes() / r.full_param_bytes()
                               : 0.0,
      eta_s >= 0 ? absl::StrCat(" | eta ", HumanDuration(eta_s)) : "");
}

absl::StatusOr<std::string> StepJsonLine(const StepMetrics& record) {
  // z_out and eval_ce are the fields set only when their option is on (--alpha_lse,
  // --eval_every on an evaluated step), the floors only where the corpus states them
  // (metrics.proto).
  StepMetrics complete;
  const StepMetrics* checked = &record;
  if (!record.has_z_out() || !record.has_eval_ce() || !record.has_entropy_floor() ||
      !record.has_context_floor()) {
    complete = record;
    if (!record.has_z_out()) complete.set_z_out(0);
    if (!record.has_eval_ce()) complete.set_eval_ce(0);
    if (!record.has_entropy_floor()) complete.set_entropy_floor(0);
    if (!record.has_context_floor()) complete.set_context_floor(0);
    checked = &complete;
  }
  if (const std::string missing = FirstMissingField(*checked); !missing.empty()) {
    return absl::InternalError(absl::StrCat("step ", record.step(), "'s metrics record has no ",
                                            missing, " (every field is written)"));
  }
  return ProtoToJson(record, {.int64_as_numbers = true});
}

TrainSummary Summarize(const std::vector<StepMetrics>& history, int64_t first_step,
                       double entropy_floor, double context_floor) {
  TrainSummary s;
  s.first_step = first_step;
  s.entropy_floor = entropy_floor;
  s.context_floor = context_floor;
  std::vector<double> ces, z_outs, exposed, peak, activation;
  std::vector<std::vector<double>> maxvio;  // per step, per layer
  int64_t tokens = 0;
  for (const StepMetrics& r : history) {
    if (r.step() < first_step) continue;
    if (r.step() == first_step) s.first_ce = r.ce();
    s.last_step = r.step();
    s.last_ce = r.ce();
    if (r.has_eval_ce()) {
      if (s.first_eval_step < 0) {
        s.first_eval_step = r.step();
        s.first_eval_ce = r.eval_ce();
      }
      s.last_eval_step = r.step();
      s.last_eval_ce = r.eval_ce();
    }
    if (r.has_z_out()) {
      if (r.step() == first_step) s.first_z_out = r.z_out();
      s.last_z_out = r.z_out();
      z_outs.push_back(r.z_out());
    }
    s.seconds += r.step_s();  // steps only: no parity, dump or checkpoint time
    s.comm_seconds += r.comm_s();
    s.comm_exposed_seconds += r.comm_exposed_s();
    for (int k = 0; k < kNumCommKinds; ++k) {
      s.comm_exposed_by_kind_seconds[k] += CommExposedSeconds(r, static_cast<CommKind>(k));
    }
    s.wait_seconds += r.wait_s();
    ces.push_back(r.ce());
    maxvio.emplace_back(r.maxvio().begin(), r.maxvio().end());
    tokens += r.routed_tokens();
    if (r.comm_s() > 0) exposed.push_back(r.comm_exposed_s() / r.comm_s());
    activation.push_back(static_cast<double>(r.peak_activation_bytes()));
    s.model_flops += r.model_flops();
    s.hardware_flops += r.hardware_flops();
    s.data_seconds += r.data_s();
    if (r.mfu() > 0) s.peak_flops_per_s = r.flops_per_s() / r.mfu();
    s.peak_rss_bytes = std::max(s.peak_rss_bytes, r.peak_rss_bytes());
    s.consumed_tokens = r.consumed_tokens();
    s.consumed_sequences = r.consumed_sequences();
    if (r.full_param_bytes() > 0) {
      peak.push_back(static_cast<double>(r.peak_unsharded_param_bytes()) / r.full_param_bytes());
    }
  }
  const size_t tail = std::min<size_t>(10, ces.size());
  double ce_tail_sum = 0;
  for (size_t i = ces.size() - tail; i < ces.size(); ++i) ce_tail_sum += ces[i];
  s.tail_mean_ce = tail > 0 ? ce_tail_sum / tail : 0;
  if (!z_outs.empty()) {
    const size_t z_tail = std::min<size_t>(10, z_outs.size());
    double z_tail_sum = 0;
    for (size_t i = z_outs.size() - z_tail; i < z_outs.size(); ++i) z_tail_sum += z_outs[i];
    s.tail_mean_z_out = z_tail_sum / z_tail;
  }
  const size_t layers = maxvio.empty() ? 0 : maxvio.back().size();
  s.mean_maxvio.assign(layers, 0.0);
  s.tail_mean_maxvio.assign(layers, 0.0);
  for (size_t i = 0; i < maxvio.size(); ++i) {
    for (size_t l = 0; l < layers && l < maxvio[i].size(); ++l) {
      s.mean_maxvio[l] += maxvio[i][l] / maxvio.size();
      if (i >= maxvio.size() - tail) s.tail_mean_maxvio[l] += maxvio[i][l] / tail;
    }
  }
  s.tokens_per_second = s.seconds > 0 ? tokens / s.seconds : 0;
  s.median_exposed_fraction = Median(exposed);
  s.median_peak_param_fraction = Median(peak);
  s.median_peak_activation_bytes = Median(activation);
  return s;
}

std::string TrainSummary::ToString() const {
  if (first_step > last_step) return "summary: no steps run\n";
  std::string out = absl::StrFormat(
      "summary: steps %d-%d in %.1f s, %s tok/s, comm %.0f%% (exposed %.0f%%), wait %.0f%% of "
      "step time\n",
      first_step, last_step, seconds, HumanRate(tokens_per_second),
      seconds > 0 ? 100 * comm_seconds / seconds : 0.0,
      seconds > 0 ? 100 * comm_exposed_seconds / seconds : 0.0,
      seconds > 0 ? 100 * wait_seconds / seconds : 0.0);
  if (seconds > 0) {
    absl::StrAppend(&out, "summary: exposed by collective (% of step time):");
    for (int k = 0; k < kNumCommKinds; ++k) {
      absl::StrAppendFormat(&out, "%s %s %.1f%%", k == 0 ? "" : ",",
                            CommKindName(static_cast<CommKind>(k)),
                            100 * comm_exposed_by_kind_seconds[k] / seconds);
    }
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppendFormat(&out,
                        "summary: median exposed / comm %.3f; median peak unsharded / full "
                        "parameter bytes %.3f; median peak activation bytes %.1f MiB\n",
                        median_exposed_fraction, median_peak_param_fraction,
                        median_peak_activation_bytes / (1 << 20));
  if (model_flops > 0 && seconds > 0) {
    absl::StrAppendFormat(&out, "summary: %s model FLOPs (%.3g per step; hardware %.3g)",
                          HumanFlops(model_flops / seconds),
                          model_flops / (last_step - first_step + 1),
                          hardware_flops / (last_step - first_step + 1));
    if (peak_flops_per_s > 0) {
      absl::StrAppendFormat(&out, ", mfu %.1f%% of %s",
                            100 * model_flops / seconds / peak_flops_per_s,
                            HumanFlops(peak_flops_per_s));
    }
    absl::StrAppendFormat(&out,
                          "; data loading %.2f%% of step time; peak RSS %.1f MiB; consumed %d "
                          "tokens, %d sequences\n",
                          100 * data_seconds / seconds, peak_rss_bytes / double{1 << 20},
                          consumed_tokens, consumed_sequences);
  }
  absl::StrAppendFormat(&out, "summary: ce %.4f -> %.4f (mean of the last steps %.4f)\n", first_ce,
                        last_ce, tail_mean_ce);
  if (first_eval_step >= 0) {
    absl::StrAppendFormat(&out, "summary: held-out ce %.4f (step %d) -> %.4f (step %d)\n",
                          first_eval_ce, first_eval_step, last_eval_ce, last_eval_step);
  }
  if (tail_mean_z_out >= 0) {
    absl::StrAppendFormat(&out,
                          "summary: output z-loss z_out %.6f -> %.6f (mean of the last steps "
                          "%.6f), not in ce\n",
                          first_z_out, last_z_out, tail_mean_z_out);
  }
  if (!mean_maxvio.empty()) {
    auto join = [](const std::vector<double>& v) {
      return absl::StrJoin(v, " ",
                           [](std::string* o, double x) { absl::StrAppendFormat(o, "%.4f", x); });
    };
    absl::StrAppendFormat(&out, "summary: maxvio per layer: mean %s; mean of the last steps %s\n",
                          join(mean_maxvio), join(tail_mean_maxvio));
  }
  if (entropy_floor > 0 && !(context_floor > 0 && context_floor < entropy_floor)) {
    // One floor (a first-order source: context cannot help).
    absl::StrAppendFormat(&out,
                          "summary: entropy floor %.4f nats/token; ce / floor = %.3f (%s 1.10)\n",
                          entropy_floor, tail_mean_ce / entropy_floor,
                          tail_mean_ce <= 1.1 * entropy_floor ? "within" : "NOT within");
  } else if (entropy_floor > 0) {
    absl::StrAppendFormat(
        &out,
        "summary: per-token floor %.4f, context floor %.4f nats/token; ce %s the per-token "
        "floor; ce / context floor = %.3f (%s 1.10)\n",
        entropy_floor, context_floor, tail_mean_ce < entropy_floor ? "below" : "NOT below",
        tail_mean_ce / context_floor,
        tail_mean_ce <= 1.1 * context_floor ? "within" : "NOT within");
  }
  if (parity) absl::StrAppend(&out, "summary: parity ", parity->ok ? "passed" : "FAILED", "\n");
  return out;
}

}  // namespace gradsum::train
