#include "moe/ep_exchange.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace gradsum::moe {

namespace {

// E + 1 non-decreasing offsets from 0 with E % P == 0; returns E / P.
absl::StatusOr<int> CheckOffsets(absl::Span<const int64_t> expert_offsets, int P) {
  if (P < 1) return absl::InvalidArgumentError(absl::StrCat("ep_size = ", P, " < 1"));
  if (expert_offsets.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert_offsets has ", expert_offsets.size(), " entries; need E + 1 >= 2"));
  }
  const int E = static_cast<int>(expert_offsets.size()) - 1;
  if (E % P != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "E = ", E, " experts (expert_offsets.size() - 1) not divisible by ep_size ", P));
  }
  const int El = E / P;
  if (expert_offsets[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert_offsets[0] = ", expert_offsets[0], ", must be 0"));
  }
  for (int e = 0; e < E; ++e) {
    if (expert_offsets[e + 1] < expert_offsets[e]) {
      return absl::InvalidArgumentError(absl::StrCat("expert_offsets decrease at ", e + 1, ": ",
                                                     expert_offsets[e], " -> ",
                                                     expert_offsets[e + 1]));
    }
  }
  return El;
}

}  // namespace

absl::StatusOr<EpExchangePlan> PlanEpExchange(absl::Span<const int64_t> expert_offsets,
                                              absl::Span<const int64_t> peer_counts, int ep_size,
                                              int64_t width) {
  const int P = ep_size;
  if (width < 0) return absl::InvalidArgumentError(absl::StrCat("width = ", width, " < 0"));
  absl::StatusOr<int> El_or = CheckOffsets(expert_offsets, P);
  if (!El_or.ok()) return El_or.status();
  const int El = *El_or;
  if (static_cast<int64_t>(peer_counts.size()) != int64_t{P} * El) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer_counts has ", peer_counts.size(),
                     " entries, expected ep_size * E / ep_size = ", int64_t{P} * El));
  }
  for (size_t i = 0; i < peer_counts.size(); ++i) {
    if (peer_counts[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer_counts[", i, "] = ", peer_counts[i], " < 0"));
    }
  }
  EpExchangePlan x;
  x.source_offsets.assign(P, std::vector<int64_t>(El + 1, 0));
  const size_t w = static_cast<size_t>(width);
  for (int p = 0; p < P; ++p) {
    const int64_t first = expert_offsets[p * El];
    x.send_counts.push_back(static_cast<size_t>(expert_offsets[(p + 1) * El] - first) * w);
    x.send_offsets.push_back(static_cast<size_t>(first) * w);
    x.source_first_row.push_back(x.recv_rows);
    for (int j = 0; j < El; ++j) {
      x.source_offsets[p][j + 1] = x.source_offsets[p][j] + peer_counts[p * El + j];
    }
    x.recv_counts.push_back(static_cast<size_t>(x.source_offsets[p][El]) * w);
    x.recv_offsets.push_back(static_cast<size_t>(x.recv_rows) * w);
    x.recv_rows += x.source_offsets[p][El];
  }
  return x;
}

absl::StatusOr<std::vector<int64_t>> ExchangeExpertCounts(
    Communicator& ep_group, absl::Span<const int64_t> expert_offsets) {
  const int P = ep_group.size();
  absl::StatusOr<int> El_or = CheckOffsets(expert_offsets, P);
  if (!El_or.ok()) return El_or.status();
  const int El = *El_or;
  const int E = P * El;
  std::vector<int64_t> mine(E), theirs(E);
  for (int e = 0; e < E; ++e) mine[e] = expert_offsets[e + 1] - expert_offsets[e];
  // Block p of `mine` (p's experts) goes to p; block p of `theirs` comes from p.
  std::vector<size_t> counts(P, static_cast<size_t>(El)), offsets(P);
  for (int p = 0; p < P; ++p) offsets[p] = static_cast<size_t>(p) * El;
  absl::Status s =
      ep_group.AllToAllV(mine.data(), counts, offsets, theirs.data(), counts, offsets, DType::kI64);
  if (!s.ok()) return s;
  return theirs;
}

}  // namespace gradsum::moe
