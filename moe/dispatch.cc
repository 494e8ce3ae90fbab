#include "moe/dispatch.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "moe/dispatch_rows.h"
#include "moe/placement.h"
#include "moe/shapes.h"

namespace gradsum::moe {
namespace {

// The per-slot exchanges of one direction between the home layout (send order) and the
// owner layout (expert-major) of `state`: slot j's all-to-all-v carries expert p * El + j's
// rows between each home rank and owner p. `to_owners` picks the direction. Rows for this
// rank's own experts are not exchanged (the callers read them in place). Slots are issued
// one by one (Start), so that the experts of slot j can run while later slots are still in
// flight, and waited one by one; every issued exchange is waited for before this object
// goes away (its buffers must outlive it), also on an error path.
class SlotExchanges {
 public:
  SlotExchanges(Communicator& comm, const DispatchState& state, int num_experts, bool to_owners,
                const float* src, float* dst, int64_t d_model, const char* what)
      : comm_(comm),
        state_(state),
        to_owners_(to_owners),
        src_(src),
        dst_(dst),
        d_model_(static_cast<size_t>(d_model)),
        what_(what),
        num_slots_(comm.size() > 1 ? num_experts / comm.size() : 0),
        plans_(static_cast<size_t>(num_slots_)),
        works_(static_cast<size_t>(num_slots_)) {}
  SlotExchanges(const SlotExchanges&) = delete;
  SlotExchanges& operator=(const SlotExchanges&) = delete;
  ~SlotExchanges() { WaitAll().IgnoreError(); }

  // Issues slot j's exchange (nothing to do at P == 1: every row stays here).
  absl::Status Start(int j) {
    if (j >= num_slots_) return absl::OkStatus();
    const int P = comm_.size();
    const int me = comm_.rank();
    const int El = num_slots_;
    Plan& plan = plans_[j];
    for (std::vector<size_t>* v :
         {&plan.home_counts, &plan.home_offsets, &plan.owner_counts, &plan.owner_offsets}) {
      v->assign(P, 0);
    }
    for (int p = 0; p < P; ++p) {
      const int e = p * El + j;
      // The home buffers skip this rank's own rows (DispatchState::HomeRow).
      plan.home_offsets[p] = static_cast<size_t>(state_.HomeRow(state_.expert_first[e])) * d_model_;
      plan.owner_offsets[p] = static_cast<size_t>(state_.owner_first[p * El + j]) * d_model_;
      if (p == me) continue;
      plan.home_counts[p] =
          static_cast<size_t>(state_.expert_first[e + 1] - state_.expert_first[e]) * d_model_;
      plan.owner_counts[p] = static_cast<size_t>(state_.owner_count[p * El + j]) * d_model_;
    }
    absl::StatusOr<std::unique_ptr<Work>> work =
        to_owners_ ? comm_.AllToAllVAsync(src_, plan.home_counts, plan.home_offsets, dst_,
                                          plan.owner_counts, plan.owner_offsets, DType::kF32)
                   : comm_.AllToAllVAsync(src_, plan.owner_counts, plan.owner_offsets, dst_,
                                          plan.home_counts, plan.home_offsets, DType::kF32);
    if (!work.ok()) return Annotate(work.status(), what_);
    works_[j] = *std::move(work);
    return absl::OkStatus();
  }

  // Waits for slot j's exchange if it was issued and not yet waited for.
  absl::Status Wait(int j) {
    if (j >= num_slots_ || works_[j] == nullptr) return absl::OkStatus();
    absl::Status s = works_[j]->Wait(comm_.OperationWaitLimit());
    works_[j].reset();
    return Annotate(s, what_);
  }

  // Waits for every slot still in flight; the first error.
  absl::Status WaitAll() {
    absl::Status status;
    for (int j = 0; j < num_slots_; ++j) {
      absl::Status s = Wait(j);
      if (status.ok()) status = s;
    }
    return status;
  }

 private:
  struct Plan {  // per peer, kept alive until the exchange is waited for
    std::vector<size_t> home_counts, home_offsets, owner_counts, owner_offsets;
  };
  Communicator& comm_;
  const DispatchState& state_;
  const bool to_owners_;
  const float* const src_;
  float* const dst_;
  const size_t d_model_;
  const char* const what_;
  const int num_slots_;
  std::vector<Plan> plans_;
  std::vector<std::unique_ptr<Work>> works_;
};

// How forward splits the local experts into pipeline chunks (consecutive experts): one
// chunk at P == 1 (nothing to overlap); otherwise chunks as wide as the thread budget
// (the experts of a chunk run in parallel), but at least two chunks when there are two
// experts, so that an exchange is always in flight while experts compute.
std::vector<int> ChunkFirsts(int ep_size, int num_local_experts) {
  int width = num_local_experts;
  if (ep_size > 1) {
    width = std::max(1, std::min(ComputeThreads(), num_local_experts / 2));
  }
  std::vector<int> firsts;
  for (int j = 0; j < num_local_experts; j += width) firsts.push_back(j);
  firsts.push_back(num_local_experts);
  return firsts;
}

// The owner-layout rows and group sizes of chunk c: every local expert outside the chunk
// gets zero rows, so moe/experts.h runs exactly the chunk's experts on exactly the rows it
// would run them on in one call (the same GEMMs, the same bits).
struct ChunkRows {
  int64_t first_row = 0, num_rows = 0;
  std::vector<int64_t> group_sizes;
};
// Whether the state's chunks cover the E_local experts in order, one saved set each.
bool ValidChunks(const DispatchState& s, int num_local_experts) {
  const std::vector<int>& f = s.chunk_first;
  if (f.size() < 2 || f.front() != 0 || f.back() != num_local_experts ||
      s.experts_saved.size() != f.size() - 1 ||
      s.local_group_sizes.size() != static_cast<size_t>(num_local_experts)) {
    return false;
  }
  for (size_t c = 0; c + 1 < f.size(); ++c) {
    if (f[c] >= f[c + 1]) return false;
  }
  return true;
}

ChunkRows RowsOfChunk(const DispatchState& s, int c) {
  const int j0 = s.chunk_first[c], j1 = s.chunk_first[c + 1];
  ChunkRows r;
  r.group_sizes.assign(s.local_group_sizes.size(), 0);
  for (int j = 0; j < j0; ++j) r.first_row += s.local_group_sizes[j];
  for (int j = j0; j < j1; ++j) {
    r.group_sizes[j] = s.local_group_sizes[j];
    r.num_rows += s.local_group_sizes[j];
  }
  return r;
}

// The pipeline of one pass (forward or backward) over the chunks of `s`: every slot's rows
// leave home (`home_out`, send order) for the owners' `owner_in` (expert-major) at once; a
// chunk runs `compute(c, rows)` as soon as its slots have arrived, and its results
// (`owner_out`) start back into `home_in` while the next chunk computes. Returns after every
// exchange has completed (on an error path too: the exchanges' destructors wait).
absl::Status RunPipeline(Communicator& comm, const DispatchState& s, int num_experts,
                         int64_t d_model, const float* home_out, float* owner_in,
                         const float* owner_out, float* home_in, const char* what_out,
                         const char* what_back,
                         const std::function<absl::Status(int, const ChunkRows&)>& compute) {
  SlotExchanges out(comm, s, num_experts, /*to_owners=*/true, home_out, owner_in, d_model,
                    what_out);
  SlotExchanges back(comm, s, num_experts, /*to_owners=*/false, owner_out, home_in, d_model,
                     what_back);
  const int num_local_experts = num_experts / comm.size();
  for (int j = 0; j < num_local_experts; ++j) GRADSUM_RETURN_IF_ERROR(out.Start(j));
  const int num_chunks = static_cast<int>(s.chunk_first.size()) - 1;
  for (int c = 0; c < num_chunks; ++c) {
    const int j0 = s.chunk_first[c], j1 = s.chunk_first[c + 1];
    for (int j = j0; j < j1; ++j) GRADSUM_RETURN_IF_ERROR(out.Wait(j));
    GRADSUM_RETURN_IF_ERROR(compute(c, RowsOfChunk(s, c)));
    for (int j = j0; j < j1; ++j) GRADSUM_RETURN_IF_ERROR(back.Start(j));
  }
  return back.WaitAll();
}

// At least n floats of `buffer`, keeping earlier contents and capacity (no re-zeroing).
float* Scratch(std::vector<float>& buffer, int64_t n) {
  if (buffer.size() < static_cast<size_t>(n)) buffer.resize(n);
  return buffer.data();
}

// Sent row `pos`'s row of d_model floats in a pair of buffers laid out as
// DispatchState::output_row says: `home` (the exchanged rows, send order without the own
// range) or, for this rank's own experts, `own` (expert-major).
template <typename T>
inline T* SentRow(const DispatchState& s, int64_t pos, T* home, T* own, int64_t d_model) {
  const int64_t r = s.output_row[pos];
  return r >= 0 ? home + r * d_model : own + (-1 - r) * d_model;
}

// Sent row `pos`'s expert output.
inline const float* OutputRow(const DispatchState& s, int64_t pos, int64_t d_model) {
  return SentRow(s, pos, s.copy_output.data(), s.expert_output.data(), d_model);
}

ExpertsConfig LocalExpertsConfig(const DispatchConfig& config, int ep_size) {
  return ExpertsConfig{.d_model = config.d_model,
                       .hidden = config.hidden,
                       .num_local_experts = config.num_experts / ep_size,
                       .row_blocks = config.expert_row_blocks};
}

// Forward step 1: order the copies by destination expert (a stable counting sort) into the
// home side of `s` (send_copy, copy_pos, expert_first; the state is reset field by field,
// keeping the vectors' capacity for reuse). Fills `counts` = rows per expert; fails
// before touching `s` on an expert index outside [-1, E).
absl::Status SortCopiesByExpert(int E, int K, int64_t T, absl::Span<const int32_t> expert_index,
                                absl::Span<const float> combine_weight,
                                std::vector<int64_t>& counts, DispatchState& s) {
  counts.assign(E, 0);
  for (int64_t c = 0; c < T * K; ++c) {
    const int32_t e = expert_index[c];
    if (e < -1 || e >= E) {
      return absl::InvalidArgumentError(absl::StrCat("expert_index[token ", c / K, ", slot ", c % K,
                                                     "] is ", e, ", outside [-1, E=", E, ")"));
    }
    if (e >= 0) ++counts[e];
  }
  s.num_tokens = T;
  s.combine_weight.assign(combine_weight.begin(), combine_weight.end());
  s.expert_first.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) s.expert_first[e + 1] = s.expert_first[e] + counts[e];
  std::vector<int64_t> next(s.expert_first.begin(), s.expert_first.end() - 1);
  const int64_t num_sent = s.expert_first[E];
  s.send_copy.resize(num_sent);
  s.copy_pos.assign(T * K, -1);
  for (int64_t c = 0; c < T * K; ++c) {
    if (expert_index[c] < 0) continue;
    s.copy_pos[c] = next[expert_index[c]]++;
    s.send_copy[s.copy_pos[c]] = c;
  }
  return absl::OkStatus();
}

// Forward step 2: s.all_counts[q * E + e] = rows rank q sends to expert e, by an all-gather
// of `counts`; a re-run of the same routing (config.all_counts) knows them already.
absl::Status ExchangeExpertCounts(Communicator& ep_group, const DispatchConfig& config,
                                  const std::vector<int64_t>& counts, DispatchState& s) {
  const int P = ep_group.size();
  const int me = ep_group.rank();
  const int E = config.num_experts;
  std::vector<int64_t>& all_counts = s.all_counts;
  if (config.all_counts != nullptr) {
    const std::vector<int64_t>& known = *config.all_counts;
    if (known.size() != static_cast<size_t>(P) * E ||
        !std::equal(counts.begin(), counts.end(), known.begin() + static_cast<size_t>(me) * E)) {
      return absl::FailedPreconditionError(absl::StrCat("dispatch: the kept expert counts (",
                                                        known.size(),
                                                        " entries) are not those of this "
                                                        "routing on EP rank ",
                                                        me, " of ", P, " with ", E,
                                                        " experts; re-run a dispatch only "
                                                        "with the routing that produced them"));
    }
    all_counts.assign(known.begin(), known.end());
    return absl::OkStatus();
  }
  all_counts.resize(static_cast<size_t>(P) * E);
  return Annotate(ep_group.AllGather(counts.data(), all_counts.data(), E, DType::kI64),
                  "exchanging expert counts");
}

// Forward step 3, from s.all_counts: the owner layout (the experts want their rows grouped
// by local expert j, and within j by source rank q), and where each sent row's output will
// be: its row of copy_output (which skips the own range), or for this rank's own experts
// (never exchanged) its row of expert_output.
void PlanRowLayout(int P, int me, int E, DispatchState& s) {
  const int E_local = E / P;
  s.local_group_sizes.assign(E_local, 0);
  s.owner_count.assign(static_cast<size_t>(P) * E_local, 0);
  s.owner_first.assign(static_cast<size_t>(P) * E_local, 0);
  for (int q = 0; q < P; ++q) {
    for (int j = 0; j < E_local; ++j) {
      const int64_t n = s.all_counts[q * E + me * E_local + j];
      s.owner_count[q * E_local + j] = n;
      s.local_group_sizes[j] += n;
    }
  }
  int64_t row = 0;
  for (int j = 0; j < E_local; ++j) {
    for (int q = 0; q < P; ++q) {
      s.owner_first[q * E_local + j] = row;
      row += s.owner_count[q * E_local + j];
    }
  }
  s.num_received = row;
  s.own_first = s.expert_first[me * E_local];
  s.own_rows = s.expert_first[(me + 1) * E_local] - s.own_first;
  const int64_t num_sent = s.expert_first[E];
  s.output_row.resize(num_sent);
  for (int64_t pos = 0; pos < num_sent; ++pos) s.output_row[pos] = s.HomeRow(pos);
  for (int j = 0; j < E_local; ++j) {
    const int e = me * E_local + j;
    const int64_t first = s.owner_first[me * E_local + j];
    for (int64_t pos = s.expert_first[e]; pos < s.expert_first[e + 1]; ++pos) {
      s.output_row[pos] = -1 - (first + pos - s.expert_first[e]);
    }
  }
}

// Forward step 4: sizes the exchange buffers of `s` and packs the rows of `a` straight
// into the send buffer (own experts' rows straight into the experts' input); returns the
// send buffer. Token by token, so that each row of `a` is read from memory once for its K
// copies.
float* PackSendRows(const DispatchConfig& config, absl::Span<const float> a, DispatchState& s) {
  const int64_t D = config.d_model;
  const int K = config.top_k;
  const int64_t num_exchanged = s.exchanged_rows();
  float* send =
      Scratch(config.scratch != nullptr ? config.scratch->send : s.scratch_send, num_exchanged * D);
  s.expert_input.resize(s.num_received * D);
  s.expert_output.resize(s.num_received * D);
  s.copy_output.resize(num_exchanged * D);
  for (int64_t c = 0; c < s.num_tokens * K; ++c) {
    const int64_t pos = s.copy_pos[c];
    if (pos < 0) continue;
    std::memcpy(SentRow(s, pos, send, s.expert_input.data(), D), &a[(c / K) * D],
                sizeof(float) * D);
  }
  return send;
}

// Forward step 6: combine straight from where the outputs are: y_t = 0 + sum_k w_tk out_tk,
// slots in order, so the sum does not depend on P.
void CombineOutputs(const DispatchState& s, int K, int64_t D,
                    absl::Span<const float> combine_weight, absl::Span<float> y) {
  const internal::RowKernels& rk = internal::SelectedRowKernels();
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    float* yt = &y[t * D];
    bool first = true;
    for (int k = 0; k < K; ++k) {
      const int64_t pos = s.copy_pos[t * K + k];
      if (pos < 0) continue;
      const float w = combine_weight[t * K + k];
      const float* out = OutputRow(s, pos, D);
      if (first) {
        rk.set_scaled(yt, w, out, D);
      } else {
        rk.add_scaled(yt, w, out, D);
      }
      first = false;
    }
    if (first) std::fill(yt, yt + D, 0.0f);
  }
}

// Backward's check that `state` comes from a forward with this config on P ranks: every
// array of the sizes that forward gives it.
absl::Status CheckStateFromForward(const DispatchConfig& config, int P,
                                   const DispatchState& state) {
  const int64_t D = config.d_model;
  const int K = config.top_k;
  const int64_t T = state.num_tokens;
  const int64_t num_sent = state.sent_rows();
  const int64_t num_received = state.received_rows();
  const int E_local = config.num_experts / P;
  if (state.expert_first.size() != static_cast<size_t>(config.num_experts) + 1 ||
      state.owner_first.size() != static_cast<size_t>(P) * E_local ||
      state.owner_count.size() != static_cast<size_t>(P) * E_local ||
      state.combine_weight.size() != static_cast<size_t>(T * K) ||
      state.copy_pos.size() != static_cast<size_t>(T * K) ||
      state.output_row.size() != static_cast<size_t>(num_sent) || state.own_first < 0 ||
      state.own_rows < 0 || state.own_first + state.own_rows > num_sent ||
      state.copy_output.size() != static_cast<size_t>(state.exchanged_rows() * D) ||
      state.expert_input.size() != static_cast<size_t>(num_received * D) ||
      state.expert_output.size() != static_cast<size_t>(num_received * D) ||
      !ValidChunks(state, E_local)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dispatch state (T=", T, ", ", state.expert_first.size(),
                     " expert offsets) does not come from a forward with D=", D, ", K=", K,
                     ", E=", config.num_experts, ", P=", P));
  }
  return absl::OkStatus();
}

// Backward step 1: d w_tk = <dy_t, out_tk> into d_combine_weight (0 for unrouted copies);
// the copy's output gradient w_tk dy_t goes straight into the send buffer (own experts'
// rows straight into the experts' output gradient, expert_dy).
void ScatterOutputGradients(const DispatchState& state, int K, int64_t D,
                            absl::Span<const float> dy, float* send, float* expert_dy,
                            absl::Span<float> d_combine_weight) {
  const int64_t T = state.num_tokens;
  std::fill(d_combine_weight.begin(), d_combine_weight.end(), 0.0f);  // unrouted copies
  // Token by token (each dy row is read from memory once for its K copies), the dot
  // products kDotRowsMax copies at a time (each one sequential fp64 sum; the rows run side
  // by side, moe/dispatch_rows.h).
  const std::vector<int64_t>& copy_pos = state.copy_pos;  // forward's inverse of send_copy
  const internal::RowKernels& rk = internal::SelectedRowKernels();
  constexpr int kRows = internal::kDotRowsMax;
  for (int64_t c0 = 0; c0 < T * K;) {
    int64_t copy[kRows];
    int n = 0;
    for (; c0 < T * K && n < kRows; ++c0) {
      if (copy_pos[c0] >= 0) copy[n++] = c0;
    }
    const float* dyt[kRows];
    const float* out[kRows];
    for (int i = 0; i < n; ++i) {
      dyt[i] = &dy[(copy[i] / K) * D];
      out[i] = OutputRow(state, copy_pos[copy[i]], D);
    }
    double dot[kRows];
    if (n > 0) rk.dot_rows(dyt, out, D, n, dot);
    for (int i = 0; i < n; ++i) {
      const int64_t c = copy[i], pos = copy_pos[c];
      d_combine_weight[c] = static_cast<float>(dot[i]);
      rk.scale(SentRow(state, pos, send, expert_dy, D), state.combine_weight[c], dyt[i], D);
    }
  }
}

// Backward step 3: d_a from the input gradients of the K copies of each token, where they
// are (`send` for the exchanged rows, expert_dx for the own experts').
void SumCopyGradients(const DispatchState& state, int K, int64_t D, const float* send,
                      const float* expert_dx, absl::Span<float> d_a) {
  const int64_t T = state.num_tokens;
  const std::vector<int64_t>& copy_pos = state.copy_pos;
  const internal::RowKernels& rk = internal::SelectedRowKernels();
  // Sum the K copies of each token into d_a straight from where they are, token by token
  // (one pass over d_a), each token's copies in send order as before.
  std::vector<int64_t> token_pos(K);
  for (int64_t t = 0; t < T; ++t) {
    int n = 0;
    for (int k = 0; k < K; ++k) {
      if (copy_pos[t * K + k] >= 0) token_pos[n++] = copy_pos[t * K + k];
    }
    std::sort(token_pos.begin(), token_pos.begin() + n);
    for (int i = 0; i < n; ++i) {
      rk.add(&d_a[t * D], SentRow(state, token_pos[i], send, expert_dx, D), D);
    }
  }
}

}  // namespace

absl::Status ValidateDispatchConfig(const DispatchConfig& config, int ep_size) {
  if (config.d_model < 1 || config.hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dispatch needs D >= 1 and H >= 1; got D=", config.d_model, ", H=", config.hidden));
  }
  GRADSUM_RETURN_IF_ERROR(ExpertPlacement::Create(config.num_experts, ep_size).status());
  if (config.top_k < 1 || config.top_k > config.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k must be in [1, E=", config.num_experts, "], got K=", config.top_k));
  }
  return absl::OkStatus();
}

namespace internal {

absl::Status DispatchCombineForwardWith(Communicator& ep_group, const DispatchConfig& config,
                                        const ExpertsForwardFn& experts, absl::Span<const float> a,
                                        absl::Span<const int32_t> expert_index,
                                        absl::Span<const float> combine_weight, absl::Span<float> y,
                                        DispatchState* state) {
  const int P = ep_group.size();
  GRADSUM_RETURN_IF_ERROR(ValidateDispatchConfig(config, P));
  if (state == nullptr) return absl::InvalidArgumentError("dispatch state must not be null");
  if (!experts) return absl::InvalidArgumentError("dispatch forward: no experts function");
  const int64_t D = config.d_model;
  const int E = config.num_experts;
  const int K = config.top_k;
  if (a.size() % static_cast<size_t>(D) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dispatch input a has ", a.size(), " elements, not a multiple of D=", D));
  }
  const int64_t T = static_cast<int64_t>(a.size()) / D;
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("dispatch expert_index", expert_index.size(), T * K, "[T, K]"));
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("dispatch combine_weight", combine_weight.size(), T * K, "[T, K]"));
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("dispatch output y", y.size(), T * D, "[T, D]"));
  // Every local check before the first collective, so a bad argument fails fast here (the
  // experts' own checks ran in the caller).
  DispatchState& s = *state;
  std::vector<int64_t> counts;
  GRADSUM_RETURN_IF_ERROR(SortCopiesByExpert(E, K, T, expert_index, combine_weight, counts, s));
  GRADSUM_RETURN_IF_ERROR(ExchangeExpertCounts(ep_group, config, counts, s));
  PlanRowLayout(P, ep_group.rank(), E, s);
  float* send = PackSendRows(config, a, s);
  // 5. A pipeline over chunks of local experts: every slot's rows leave at once; a chunk's
  // experts run as soon as its slots have arrived, and its outputs travel home while the
  // next chunk computes. Each expert sees the same rows as in one call (same bits).
  s.chunk_first = ChunkFirsts(P, E / P);
  s.experts_saved.resize(s.chunk_first.size() - 1);
  GRADSUM_RETURN_IF_ERROR(RunPipeline(
      ep_group, s, E, D, send, s.expert_input.data(), s.expert_output.data(), s.copy_output.data(),
      "dispatching token rows", "returning expert outputs", [&](int c, const ChunkRows& rows) {
        return experts(
            absl::MakeConstSpan(s.expert_input).subspan(rows.first_row * D, rows.num_rows * D),
            rows.group_sizes,
            absl::MakeSpan(s.expert_output).subspan(rows.first_row * D, rows.num_rows * D),
            &s.experts_saved[c]);
      }));
  CombineOutputs(s, K, D, combine_weight, y);
  return absl::OkStatus();
}

absl::Status DispatchCombineBackwardWith(Communicator& ep_group, const DispatchConfig& config,
                                         const ExpertsBackwardFn& experts,
                                         const DispatchState& state, absl::Span<const float> dy,
                                         absl::Span<float> d_a,
                                         absl::Span<float> d_combine_weight) {
  const int P = ep_group.size();
  GRADSUM_RETURN_IF_ERROR(ValidateDispatchConfig(config, P));
  if (!experts) return absl::InvalidArgumentError("dispatch backward: no experts function");
  const int64_t D = config.d_model;
  const int K = config.top_k;
  const int64_t T = state.num_tokens;
  const int64_t num_received = state.received_rows();
  GRADSUM_RETURN_IF_ERROR(CheckStateFromForward(config, P, state));
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("dispatch dy", dy.size(), T * D, "[T, D]"));
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("dispatch d_a", d_a.size(), T * D, "[T, D]"));
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("dispatch d_combine_weight", d_combine_weight.size(), T * K, "[T, K]"));

  DispatchScratch* shared = config.scratch;
  float* send =
      Scratch(shared != nullptr ? shared->send : state.scratch_send, state.exchanged_rows() * D);
  float* expert_dy =
      Scratch(shared != nullptr ? shared->expert_a : state.scratch_expert_a, num_received * D);
  float* expert_dx =
      Scratch(shared != nullptr ? shared->expert_b : state.scratch_expert_b, num_received * D);
  ScatterOutputGradients(state, K, D, dy, send, expert_dy, d_combine_weight);
  // 2. The same pipeline as forward, over forward's chunks. The input gradients come home
  // into the send buffer: slot j's rows there were read by slot j's dispatch, which is
  // complete before slot j's return is issued.
  GRADSUM_RETURN_IF_ERROR(RunPipeline(
      ep_group, state, config.num_experts, D, send, expert_dy, expert_dx, send,
      "dispatching output gradients", "returning input gradients",
      [&](int c, const ChunkRows& rows) {
        const int64_t first = rows.first_row * D, n = rows.num_rows * D;
        return experts(absl::MakeConstSpan(state.expert_input).subspan(first, n), rows.group_sizes,
                       state.experts_saved[c], absl::MakeConstSpan(expert_dy + first, n),
                       absl::MakeSpan(expert_dx + first, n));
      }));
  SumCopyGradients(state, K, D, send, expert_dx, d_a);
  return absl::OkStatus();
}

}  // namespace internal

absl::Status DispatchCombineForward(Communicator& ep_group, const DispatchConfig& config,
                                    const ExpertWeights& local_weights, absl::Span<const float> a,
                                    absl::Span<const int32_t> expert_index,
                                    absl::Span<const float> combine_weight, absl::Span<float> y,
                                    DispatchState* state) {
  GRADSUM_RETURN_IF_ERROR(ValidateDispatchConfig(config, ep_group.size()));
  const ExpertsConfig experts_config = LocalExpertsConfig(config, ep_group.size());
  GRADSUM_RETURN_IF_ERROR(CheckExpertWeights(experts_config, local_weights));
  return internal::DispatchCombineForwardWith(
      ep_group, config,
      [&](absl::Span<const float> x, absl::Span<const int64_t> group_sizes, absl::Span<float> out,
          ExpertsSaved* saved) {
        return ExpertsForward(experts_config, local_weights, x, group_sizes, out, saved);
      },
      a, expert_index, combine_weight, y, state);
}

absl::Status DispatchCombineBackward(Communicator& ep_group, const DispatchConfig& config,
                                     const ExpertWeights& local_weights, const DispatchState& state,
                                     absl::Span<const float> dy, absl::Span<float> d_a,
                                     absl::Span<float> d_combine_weight,
                                     const ExpertWeightGrads& local_grads) {
  GRADSUM_RETURN_IF_ERROR(ValidateDispatchConfig(config, ep_group.size()));
  const ExpertsConfig experts_config = LocalExpertsConfig(config, ep_group.size());
  GRADSUM_RETURN_IF_ERROR(CheckExpertWeights(experts_config, local_weights));
  GRADSUM_RETURN_IF_ERROR(CheckExpertWeightGrads(experts_config, local_grads));
  return internal::DispatchCombineBackwardWith(
      ep_group, config,
      [&](absl::Span<const float> x, absl::Span<const int64_t> group_sizes,
          const ExpertsSaved& saved, absl::Span<const float> d_out, absl::Span<float> d_in) {
        return ExpertsBackward(experts_config, local_weights, x, group_sizes, saved, d_out, d_in,
                               local_grads);
      },
      state, dy, d_a, d_combine_weight);
}

}  // namespace gradsum::moe
