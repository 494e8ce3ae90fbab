#include "losses/display.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/status.h"

namespace gradsum::losses {
namespace {

// 16-bit fingerprint: small enough that sum(h) and sum(h^2) over <= 1024 ranks stay exact
// in f64, so "all ranks agree" is W * sum(h^2) == sum(h)^2 (zero variance), an exact test.
class Fingerprint {
 public:
  void Mix(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h_ ^= (v >> (8 * i)) & 0xffu;
      h_ *= 1099511628211ull;  // FNV-1a
    }
  }
  void Mix(absl::string_view s) {
    Mix(static_cast<uint64_t>(s.size()));
    for (char c : s) Mix(static_cast<uint64_t>(static_cast<unsigned char>(c)));
  }
  double Value16() const {
    return static_cast<double>((h_ ^ (h_ >> 16) ^ (h_ >> 32) ^ (h_ >> 48)) & 0xffffu);
  }

 private:
  uint64_t h_ = 14695981039346656037ull;
};

bool AllRanksAgree(double sum, double sum_sq, int world) {
  return static_cast<double>(world) * sum_sq == sum * sum;
}

bool IsMetric(DisplayTermKind kind) { return kind != DisplayTermKind::kLoss; }
bool IsExtreme(DisplayTermKind kind) {
  return kind == DisplayTermKind::kMetricMax || kind == DisplayTermKind::kMetricMin;
}
// The identity of a MAX (MIN) accumulator: a rank with no value never wins.
double ExtremeIdentity(DisplayTermKind kind) {
  return kind == DisplayTermKind::kMetricMax ? -INFINITY : INFINITY;
}

}  // namespace

absl::StatusOr<double> StepDisplayValues::Value(absl::string_view name) const {
  for (const DisplayTerm& t : terms) {
    if (t.name == name) return t.value;
  }
  return absl::NotFoundError(absl::StrCat("display: no term named '", name, "'"));
}

StepDisplay::StepDisplay(int num_moe_layers, int num_experts, GradPrecision precision)
    : exact_(IsExact(precision)),
      num_experts_(std::max(num_experts, 0)),
      histogram_(static_cast<size_t>(std::max(num_moe_layers, 0)),
                 std::vector<int64_t>(static_cast<size_t>(std::max(num_experts, 0)), 0)) {}

absl::Status StepDisplay::RegisterTerm(absl::string_view name, DisplayTermKind kind) {
  if (name.empty()) return absl::InvalidArgumentError("display: a term needs a name");
  if (index_.contains(name)) {
    return absl::AlreadyExistsError(
        absl::StrCat("display: term '", name, "' is already registered"));
  }
  index_.emplace(std::string(name), entries_.size());
  entries_.push_back(Entry{std::string(name), kind, 0.0, {}, ExtremeIdentity(kind), 0});
  return absl::OkStatus();
}

absl::Status StepDisplay::Add(absl::string_view name, double value, DisplayTermKind kind) {
  const char* what = kind == DisplayTermKind::kLoss ? "loss term" : "metric";
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "display: ", what, " '", name,
        "' has no display entry; register it (StepDisplay::RegisterTerm) so that every term "
        "that drives backward is logged (SEMANTICS.md §8)"));
  }
  Entry& e = entries_[it->second];
  // AddMetric passes kMetric for every metric kind; the entry's own kind says how it reduces.
  if (IsMetric(e.kind) != IsMetric(kind)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "display: '", name, "' is registered as a ",
        e.kind == DisplayTermKind::kLoss ? "loss term" : "metric", ", not as a ", what));
  }
  if (!std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("display: non-finite value ", value, " for '", name, "'"));
  }
  if (IsExtreme(e.kind)) {
    e.extreme = e.kind == DisplayTermKind::kMetricMax ? std::max(e.extreme, value)
                                                      : std::min(e.extreme, value);
  } else if (exact_) {
    if (!(std::fabs(value) < exact::ExactScalar::kMaxAbs)) {
      return absl::InvalidArgumentError(absl::StrCat("display: value ", value, " for '", name,
                                                     "' is outside the exact range (2^59)"));
    }
    e.exact_sum.Add(value);
  } else {
    e.local_sum += value;
  }
  ++e.additions;
  return absl::OkStatus();
}

absl::StatusOr<double> StepDisplay::LocalValue(absl::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat("display: no term '", name, "'"));
  }
  const Entry& e = entries_[it->second];
  if (IsExtreme(e.kind)) return e.extreme;
  return exact_ ? e.exact_sum.ToDouble() : e.local_sum;
}

absl::Status StepDisplay::AddBackwardTerm(absl::string_view name, double local_component) {
  return Add(name, local_component, DisplayTermKind::kLoss);
}

absl::Status StepDisplay::AddMetric(absl::string_view name, double local_value) {
  return Add(name, local_value, DisplayTermKind::kMetric);
}

absl::Status StepDisplay::AddGlobalExpertCounts(int layer,
                                                absl::Span<const int64_t> global_counts) {
  if (layer < 0 || layer >= static_cast<int>(histogram_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("display: MoE layer ", layer, " outside [0, ", histogram_.size(), ")"));
  }
  if (static_cast<int>(global_counts.size()) != num_experts_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "display: ", global_counts.size(), " expert counts for ", num_experts_, " experts"));
  }
  for (size_t e = 0; e < global_counts.size(); ++e) {
    if (global_counts[e] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("display: expert count c[", e, "] = ", global_counts[e], " is negative"));
    }
  }
  for (size_t e = 0; e < global_counts.size(); ++e) histogram_[layer][e] += global_counts[e];
  return absl::OkStatus();
}

absl::StatusOr<StepDisplay::GlobalSums> StepDisplay::AllReduceF64(Communicator& world,
                                                                  double registry, double hist) {
  // Packed layout: [term sums (T)] [ranks that added each term (T)]
  //                [registry fingerprint, its square] [histogram fingerprint, its square].
  const size_t t = entries_.size();
  std::vector<double> packed(2 * t + 4, 0.0);
  for (size_t i = 0; i < t; ++i) {
    packed[i] = entries_[i].local_sum;
    packed[t + i] = entries_[i].additions > 0 ? 1.0 : 0.0;
  }
  packed[2 * t] = registry;
  packed[2 * t + 1] = registry * registry;
  packed[2 * t + 2] = hist;
  packed[2 * t + 3] = hist * hist;
  // SEMANTICS §8: one coalesced SUM all-reduce of every term's detached local sum.
  absl::Status s =
      world.AllReduce(packed.data(), packed.data(), packed.size(), DType::kF64, ReduceOp::kSum);
  if (!s.ok()) return Annotate(s, "display all-reduce");
  GlobalSums g;
  g.value.assign(packed.begin(), packed.begin() + t);
  g.adders.assign(packed.begin() + t, packed.begin() + 2 * t);
  g.registry = packed[2 * t];
  g.registry_sq = packed[2 * t + 1];
  g.hist = packed[2 * t + 2];
  g.hist_sq = packed[2 * t + 3];
  for (size_t i = 0; i < t; ++i) {
    if (entries_[i].kind == DisplayTermKind::kLoss) g.total_loss += g.value[i];
  }
  return g;
}

absl::StatusOr<StepDisplay::GlobalSums> StepDisplay::AllReduceExact(Communicator& world,
                                                                    double registry, double hist) {
  // The same layout in int64 words (SEMANTICS.md §11): [T * kWords exact sums] [adders (T)]
  // [registry fingerprint, its square, histogram fingerprint, its square, exact-mode ranks].
  // Everything is an integer, so the one SUM all-reduce is exact and order-free.
  constexpr int kW = exact::ExactScalar::kWords;
  const size_t t = entries_.size();
  std::vector<int64_t> packed(t * kW + t + 5, 0);
  for (size_t i = 0; i < t; ++i) {
    exact::ExactScalar sum = entries_[i].exact_sum;
    sum.Normalize();
    std::copy(sum.words().begin(), sum.words().end(), packed.begin() + i * kW);
    packed[t * kW + i] = entries_[i].additions > 0 ? 1 : 0;
  }
  int64_t* tail = packed.data() + t * kW + t;
  tail[0] = static_cast<int64_t>(registry);
  tail[1] = tail[0] * tail[0];
  tail[2] = static_cast<int64_t>(hist);
  tail[3] = tail[2] * tail[2];
  tail[4] = 1;
  absl::Status s =
      world.AllReduce(packed.data(), packed.data(), packed.size(), DType::kI64, ReduceOp::kSum);
  if (!s.ok()) return Annotate(s, "display all-reduce (exact)");
  if (tail[4] != world.size()) {
    // Ranks that are not in exact mode sent a shorter f64 vector: the all-reduce itself
    // fails there, or this count tells.
    return absl::FailedPreconditionError(absl::StrCat("display: only ", tail[4], " of ",
                                                      world.size(), " ranks reduce in exact mode"));
  }
  GlobalSums g;
  exact::ExactScalar total;
  for (size_t i = 0; i < t; ++i) {
    exact::ExactScalar sum;
    std::copy(packed.begin() + i * kW, packed.begin() + (i + 1) * kW, sum.words().begin());
    g.value.push_back(sum.ToDouble());
    g.adders.push_back(static_cast<double>(packed[t * kW + i]));
    if (entries_[i].kind == DisplayTermKind::kLoss) total.Add(sum);
  }
  g.total_loss = total.ToDouble();
  g.registry = static_cast<double>(tail[0]);
  g.registry_sq = static_cast<double>(tail[1]);
  g.hist = static_cast<double>(tail[2]);
  g.hist_sq = static_cast<double>(tail[3]);
  return g;
}

absl::Status StepDisplay::AllReduceExtremes(Communicator& world, absl::Span<const double> extremes,
                                            std::vector<double>* value) {
  std::vector<double> packed;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const DisplayTermKind kind = entries_[i].kind;
    if (IsExtreme(kind)) {
      packed.push_back(kind == DisplayTermKind::kMetricMax ? extremes[i] : -extremes[i]);
    }
  }
  if (packed.empty()) return absl::OkStatus();
  // MIN(x) = -MAX(-x): one MAX all-reduce serves both kinds.
  absl::Status s =
      world.AllReduce(packed.data(), packed.data(), packed.size(), DType::kF64, ReduceOp::kMax);
  if (!s.ok()) return Annotate(s, "display all-reduce (max/min)");
  size_t k = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!IsExtreme(entries_[i].kind)) continue;
    const double m = packed[k++];
    // -inf: no rank added a value; shown as 0 (documented at DisplayTermKind).
    if (m == -INFINITY) {
      (*value)[i] = 0.0;
    } else {
      (*value)[i] = entries_[i].kind == DisplayTermKind::kMetricMax ? m : -m;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StepDisplayValues> StepDisplay::Reduce(Communicator& world) {
  const size_t t = entries_.size();
  Fingerprint registry;
  for (size_t i = 0; i < t; ++i) {
    registry.Mix(entries_[i].name);
    registry.Mix(static_cast<uint64_t>(entries_[i].kind));
  }
  Fingerprint hist;
  for (const std::vector<int64_t>& layer : histogram_) {
    for (int64_t c : layer) hist.Mix(static_cast<uint64_t>(c));
  }
  absl::StatusOr<GlobalSums> sums = exact_
                                        ? AllReduceExact(world, registry.Value16(), hist.Value16())
                                        : AllReduceF64(world, registry.Value16(), hist.Value16());

  StepDisplayValues out;
  out.tokens_per_expert = histogram_;
  // The accumulators start afresh whatever the outcome below (the extremes are copied
  // first: the MAX all-reduce below reads them).
  std::vector<double> extremes;
  for (Entry& e : entries_) {
    extremes.push_back(e.extreme);
    e.local_sum = 0.0;
    e.exact_sum = exact::ExactScalar();
    e.extreme = ExtremeIdentity(e.kind);
    e.additions = 0;
  }
  for (std::vector<int64_t>& layer : histogram_) std::fill(layer.begin(), layer.end(), 0);
  if (!sums.ok()) return sums.status();
  const GlobalSums& g = *sums;

  if (!AllRanksAgree(g.registry, g.registry_sq, world.size())) {
    return absl::FailedPreconditionError(
        "display: ranks registered different terms (names, kinds or order differ)");
  }
  for (size_t i = 0; i < t; ++i) {
    const double adders = g.adders[i];
    if (entries_[i].kind == DisplayTermKind::kLoss && adders < world.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat("display: loss term '", entries_[i].name,
                       "' received no value this step on ", world.size() - adders, " of ",
                       world.size(), " rank(s); a registered loss term must be logged every step"));
    }
  }
  if (!AllRanksAgree(g.hist, g.hist_sq, world.size())) {
    return absl::InvalidArgumentError(
        "display: ranks hold different tokens-per-expert histograms; pass the GLOBAL counts "
        "c[l, m, :] (after ExpertCountReduction), not local ones");
  }
  // The registries agree (checked above, the same outcome on every rank), so every rank
  // has the same MAX / MIN entries and joins the same second all-reduce.
  std::vector<double> value = g.value;
  absl::Status s = AllReduceExtremes(world, extremes, &value);
  if (!s.ok()) return s;
  for (size_t i = 0; i < t; ++i) {
    out.terms.push_back(DisplayTerm{entries_[i].name, entries_[i].kind, value[i]});
  }
  out.total_loss = g.total_loss;
  for (const std::vector<int64_t>& layer : out.tokens_per_expert) {
    // §8: maxvio = (max_e c_e - mean_e c_e) / mean_e c_e.
    double total = 0.0, mx = 0.0;
    for (int64_t c : layer) {
      total += static_cast<double>(c);
      mx = std::max(mx, static_cast<double>(c));
    }
    const double mean = layer.empty() ? 0.0 : total / static_cast<double>(layer.size());
    out.maxvio.push_back(mean > 0.0 ? (mx - mean) / mean : 0.0);
  }
  return out;
}

}  // namespace gradsum::losses
