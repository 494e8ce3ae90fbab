#ifndef GRADSUM_LOSSES_DISPLAY_H_
#define GRADSUM_LOSSES_DISPLAY_H_

// The detached display pipeline (SEMANTICS.md §8): what a step logs.
//
// Each loss term's local components are accumulated in f64, detached, over the
// micro-batches; at step end ONE coalesced SUM all-reduce (a single call on a packed f64
// vector) gives the global value of every term, identical on every rank and equal to the
// single-process value. Terms are registered up front; a term that drives backward must be
// registered, so a new term can never vanish from the logs: adding a backward term that
// has no display entry is FailedPrecondition naming it, and so is a registered loss term
// that received no value in a step.
//
// Per MoE layer it also keeps the tokens-per-expert histogram (the GLOBAL counts c[l, m, :]
// summed over micro-batches; they are already global, so they are not all-reduced again)
// and maxvio = (max_e c_e - mean_e c_e) / mean_e c_e.
//
//   StepDisplay display(/*num_moe_layers=*/L, /*num_experts=*/E);
//   GRADSUM_RETURN_IF_ERROR(display.RegisterTerm("ce"));
//   GRADSUM_RETURN_IF_ERROR(display.RegisterTerm("z_loss"));
//   GRADSUM_RETURN_IF_ERROR(display.RegisterTerm("tokens", DisplayTermKind::kMetric));
//   for each micro-batch m:
//     GRADSUM_RETURN_IF_ERROR(display.AddBackwardTerm("ce", ce.local_loss));
//     GRADSUM_RETURN_IF_ERROR(display.AddBackwardTerm("z_loss", z_local));
//     GRADSUM_RETURN_IF_ERROR(display.AddGlobalExpertCounts(l, c));   // per layer
//   GRADSUM_ASSIGN_OR_RETURN(StepDisplayValues v, display.Reduce(world));  // collective
//   // v.total_loss, v.Value("ce"), v.tokens_per_expert[l], v.maxvio[l]
//
// Exact mode (GradPrecision::kExact, reproducible training, SEMANTICS.md §11; the display
// follows the run's gradient precision so that the logs agree bit for bit whenever the
// gradients do): every added value is converted to
// exact fixed point (core/exact_sum.h, ExactScalar: LSB 2^-100, |value| < 2^59) and the
// step-end reduction is one int64 SUM all-reduce of the words, so a term's global value
// (and total_loss, summed exactly too) is the same bits whatever the mesh, as long as the
// model adds the same per-sequence (or per-token) values. Out-of-range values are
// InvalidArgument there, as non-finite ones are in both modes.
//
// Not thread-safe: one StepDisplay per rank, used by that rank's thread.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/exact_sum.h"
#include "core/grad_precision.h"

namespace gradsum::losses {

enum class DisplayTermKind {
  kLoss = 0,    // drives backward; part of total_loss; must get a value every step
  kMetric = 1,  // displayed only (token counts, accuracies...); summed over ranks the same way
  // Displayed only, reduced with MAX / MIN over the micro-batches and the ranks instead of
  // SUM (the policy loss's ratio max and min, SEMANTICS.md §13). A rank (or micro-batch)
  // with nothing to report simply adds no value; if no rank adds one, the value is 0.
  // These take one extra MAX all-reduce at step end (MIN values travel negated), run only
  // when such a metric is registered; it is exact in every mode (a max is order-free).
  kMetricMax = 2,
  kMetricMin = 3,
};

struct DisplayTerm {
  std::string name;
  DisplayTermKind kind = DisplayTermKind::kLoss;
  // Global value: sum over ranks and micro-batches of the local components.
  double value = 0.0;
};

struct StepDisplayValues {
  std::vector<DisplayTerm> terms;  // registration order
  // Sum of the kLoss terms: the global loss L of §6.
  double total_loss = 0.0;
  // tokens_per_expert[l][e]: global (token, slot) assignments summed over micro-batches.
  std::vector<std::vector<int64_t>> tokens_per_expert;
  // maxvio[l] of §8 over tokens_per_expert[l]; 0 for a layer that routed nothing.
  std::vector<double> maxvio;

  // The global value of term `name`; NotFound if it is not registered.
  absl::StatusOr<double> Value(absl::string_view name) const;
};

class StepDisplay {
 public:
  // num_moe_layers >= 0 and num_experts >= 0 size the histograms (0 and 0: no MoE).
  // `precision`: the run's gradient precision; kExact sums exactly (above), the others in
  // f64. Every rank must choose the same (checked at Reduce).
  explicit StepDisplay(int num_moe_layers = 0, int num_experts = 0,
                       GradPrecision precision = GradPrecision::kF32);
  bool exact() const { return exact_; }

  // Registers a term. Every rank must register the same terms in the same order (checked
  // at Reduce). InvalidArgument for an empty name; AlreadyExists for a repeated name.
  absl::Status RegisterTerm(absl::string_view name, DisplayTermKind kind = DisplayTermKind::kLoss);

  // Adds one micro-batch's detached local component of a term that drove backward.
  // FailedPrecondition naming the term if it has no display entry, or is registered as a
  // metric; InvalidArgument for a non-finite value.
  absl::Status AddBackwardTerm(absl::string_view name, double local_component);

  // Adds a local value of a display-only metric: summed for kMetric, kept as the running
  // max (min) for kMetricMax (kMetricMin). FailedPrecondition if `name` is not registered as
  // one of the metric kinds; InvalidArgument for a non-finite value.
  absl::Status AddMetric(absl::string_view name, double local_value);

  // Adds the global expert counts c[l, m, :] (from ExpertCountReduction) of one layer and
  // micro-batch. InvalidArgument for a layer outside [0, L), E mismatch, negative counts.
  absl::Status AddGlobalExpertCounts(int layer, absl::Span<const int64_t> global_counts);

  // Step end: one SUM all-reduce of the packed f64 accumulators over `world` (plus one MAX
  // all-reduce when kMetricMax / kMetricMin terms are registered); returns the
  // global values and clears the accumulators for the next step (registrations stay).
  // Collective. Errors, on every rank together: FailedPrecondition naming a registered
  // kLoss term that received no value this step (on any rank), or if the ranks' registries
  // differ; InvalidArgument if the histograms of the ranks differ; the communicator's error
  // otherwise (different numbers of terms make the all-reduce itself fail).
  absl::StatusOr<StepDisplayValues> Reduce(Communicator& world);
  // This rank's own sum so far of a kLoss or kMetric term (its local components over the
  // step's micro-batches, before Reduce; the exact sum's value in exact mode), e.g. for a
  // per-rank view of the loss. NotFound if `name` is not registered.
  absl::StatusOr<double> LocalValue(absl::string_view name) const;

 private:
  struct Entry {
    std::string name;
    DisplayTermKind kind;
    double local_sum = 0.0;
    exact::ExactScalar exact_sum;  // exact mode
    double extreme = 0.0;          // kMetricMax: running max; kMetricMin: running min (both modes)
    int64_t additions = 0;
  };
  // The step's global sums, whichever mode produced them.
  struct GlobalSums {
    std::vector<double> value;   // per term
    std::vector<double> adders;  // ranks that added each term
    double registry = 0, registry_sq = 0, hist = 0, hist_sq = 0;
    double total_loss = 0;
  };
  absl::Status Add(absl::string_view name, double value, DisplayTermKind kind);
  absl::StatusOr<GlobalSums> AllReduceF64(Communicator& world, double registry, double hist);
  absl::StatusOr<GlobalSums> AllReduceExact(Communicator& world, double registry, double hist);
  // The MAX all-reduce of the kMetricMax / kMetricMin entries; writes their global values.
  absl::Status AllReduceExtremes(Communicator& world, absl::Span<const double> extremes,
                                 std::vector<double>* value);

  bool exact_ = false;
  std::vector<Entry> entries_;
  absl::flat_hash_map<std::string, size_t> index_;
  int num_experts_;
  std::vector<std::vector<int64_t>> histogram_;  // [L][E], global counts summed over m
};

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_DISPLAY_H_
