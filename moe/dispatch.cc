#include "moe/dispatch.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/status.h"
#include "moe/placement.h"
#include "moe/shapes.h"

namespace gradsum::moe {
namespace {

// Element counts and offsets of an all-to-all-v of rows of width D.
struct RowLayout {
  std::vector<size_t> counts;
  std::vector<size_t> offsets;
};

RowLayout ElementLayout(const std::vector<size_t>& rows, int64_t d_model) {
  RowLayout layout;
  size_t offset = 0;
  for (size_t r : rows) {
    layout.counts.push_back(r * static_cast<size_t>(d_model));
    layout.offsets.push_back(offset);
    offset += r * static_cast<size_t>(d_model);
  }
  return layout;
}

// Sends send_rows[p] rows to each peer p and receives recv_rows[q] rows from each peer q.
absl::Status ExchangeRows(Communicator& comm, const float* send,
                          const std::vector<size_t>& send_rows, float* recv,
                          const std::vector<size_t>& recv_rows, int64_t d_model) {
  const RowLayout s = ElementLayout(send_rows, d_model);
  const RowLayout r = ElementLayout(recv_rows, d_model);
  return comm.AllToAllV(send, s.counts, s.offsets, recv, r.counts, r.offsets, DType::kF32);
}

// At least n floats of `buffer`, keeping earlier contents and capacity (no re-zeroing).
float* Scratch(std::vector<float>& buffer, int64_t n) {
  if (buffer.size() < static_cast<size_t>(n)) buffer.resize(n);
  return buffer.data();
}

// dst[index[i]] = src[i] (rows of width D).
void ScatterRows(const float* src, const std::vector<int64_t>& index, int64_t d_model, float* dst) {
  for (size_t i = 0; i < index.size(); ++i) {
    std::memcpy(dst + index[i] * d_model, src + i * d_model, sizeof(float) * d_model);
  }
}

// dst[i] = src[index[i]] (rows of width D).
void GatherRows(const float* src, const std::vector<int64_t>& index, int64_t d_model, float* dst) {
  for (size_t i = 0; i < index.size(); ++i) {
    std::memcpy(dst + i * d_model, src + index[i] * d_model, sizeof(float) * d_model);
  }
}

ExpertsConfig LocalExpertsConfig(const DispatchConfig& config, int ep_size) {
  return ExpertsConfig{.d_model = config.d_model,
                       .hidden = config.hidden,
                       .num_local_experts = config.num_experts / ep_size};
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

absl::Status DispatchCombineForward(Communicator& ep_group, const DispatchConfig& config,
                                    const ExpertWeights& local_weights, absl::Span<const float> a,
                                    absl::Span<const int32_t> expert_index,
                                    absl::Span<const float> combine_weight, absl::Span<float> y,
                                    DispatchState* state) {
  const int P = ep_group.size();
  const int me = ep_group.rank();
  GRADSUM_RETURN_IF_ERROR(ValidateDispatchConfig(config, P));
  if (state == nullptr) return absl::InvalidArgumentError("dispatch state must not be null");
  const int64_t D = config.d_model;
  const int E = config.num_experts;
  const int K = config.top_k;
  const int E_local = E / P;
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
  // Every local check before the first collective, so a bad argument fails fast here.
  const ExpertsConfig experts_config = LocalExpertsConfig(config, P);
  GRADSUM_RETURN_IF_ERROR(CheckExpertWeights(experts_config, local_weights));

  // 1. Order the copies by destination expert (a stable counting sort).
  std::vector<int64_t> counts(E, 0);
  for (int64_t c = 0; c < T * K; ++c) {
    const int32_t e = expert_index[c];
    if (e < -1 || e >= E) {
      return absl::InvalidArgumentError(absl::StrCat("expert_index[token ", c / K, ", slot ", c % K,
                                                     "] is ", e, ", outside [-1, E=", E, ")"));
    }
    if (e >= 0) ++counts[e];
  }
  // Reset the state field by field, keeping the vectors' capacity for reuse.
  DispatchState& s = *state;
  s.num_tokens = T;
  s.expert_row.clear();
  s.combine_weight.assign(combine_weight.begin(), combine_weight.end());
  std::vector<int64_t> next(E, 0);
  for (int e = 1; e < E; ++e) next[e] = next[e - 1] + counts[e - 1];
  const int64_t num_sent = next[E - 1] + counts[E - 1];
  s.send_copy.resize(num_sent);
  std::vector<int64_t> copy_pos(T * K, -1);
  for (int64_t c = 0; c < T * K; ++c) {
    if (expert_index[c] < 0) continue;
    copy_pos[c] = next[expert_index[c]]++;
    s.send_copy[copy_pos[c]] = c;
  }
  s.send_rows.assign(P, 0);
  for (int e = 0; e < E; ++e) s.send_rows[e / E_local] += counts[e];

  // 2. Exchange the per-expert counts: all_counts[q * E + e] = rows rank q sends to expert e.
  std::vector<int64_t> all_counts(static_cast<size_t>(P) * E);
  GRADSUM_RETURN_IF_ERROR(
      Annotate(ep_group.AllGather(counts.data(), all_counts.data(), E, DType::kI64),
               "exchanging expert counts"));

  // Received rows come source-major (q, then local expert j); experts want j-major.
  s.recv_rows.assign(P, 0);
  s.local_group_sizes.assign(E_local, 0);
  for (int q = 0; q < P; ++q) {
    for (int j = 0; j < E_local; ++j) {
      const int64_t n = all_counts[q * E + me * E_local + j];
      s.recv_rows[q] += n;
      s.local_group_sizes[j] += n;
    }
  }
  std::vector<int64_t> group_next(E_local, 0);
  for (int j = 1; j < E_local; ++j) {
    group_next[j] = group_next[j - 1] + s.local_group_sizes[j - 1];
  }
  for (int q = 0; q < P; ++q) {
    for (int j = 0; j < E_local; ++j) {
      const int64_t n = all_counts[q * E + me * E_local + j];
      for (int64_t i = 0; i < n; ++i) s.expert_row.push_back(group_next[j]++);
    }
  }
  const int64_t num_received = static_cast<int64_t>(s.expert_row.size());

  // 3. Send the rows to the experts' owners and run the local experts.
  float* send = Scratch(s.scratch_send, num_sent * D);
  for (int64_t pos = 0; pos < num_sent; ++pos) {
    std::memcpy(send + pos * D, &a[(s.send_copy[pos] / K) * D], sizeof(float) * D);
  }
  // With one source rank or one local expert the received order is already expert-major,
  // so the regrouping copies are skipped.
  const bool regroup = P > 1 && E_local > 1;
  s.expert_input.resize(num_received * D);
  float* recv = regroup ? Scratch(s.scratch_recv, num_received * D) : s.expert_input.data();
  GRADSUM_RETURN_IF_ERROR(Annotate(ExchangeRows(ep_group, send, s.send_rows, recv, s.recv_rows, D),
                                   "dispatching token rows"));
  if (regroup) ScatterRows(recv, s.expert_row, D, s.expert_input.data());
  float* expert_output = Scratch(s.scratch_expert_a, num_received * D);
  GRADSUM_RETURN_IF_ERROR(
      ExpertsForward(experts_config, local_weights, s.expert_input, s.local_group_sizes,
                     absl::MakeSpan(expert_output, num_received * D), &s.experts_saved));

  // 4. Send the outputs home (the reverse exchange) and combine there.
  if (regroup) GatherRows(expert_output, s.expert_row, D, recv);
  s.copy_output.resize(num_sent * D);
  GRADSUM_RETURN_IF_ERROR(Annotate(ExchangeRows(ep_group, regroup ? recv : expert_output,
                                                s.recv_rows, s.copy_output.data(), s.send_rows, D),
                                   "returning expert outputs"));
  std::fill(y.begin(), y.end(), 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    float* yt = &y[t * D];
    for (int k = 0; k < K; ++k) {  // slots in order, so the sum does not depend on P
      const int64_t pos = copy_pos[t * K + k];
      if (pos < 0) continue;
      const float w = combine_weight[t * K + k];
      const float* out = &s.copy_output[pos * D];
      for (int64_t d = 0; d < D; ++d) yt[d] += w * out[d];
    }
  }
  return absl::OkStatus();
}

absl::Status DispatchCombineBackward(Communicator& ep_group, const DispatchConfig& config,
                                     const ExpertWeights& local_weights, const DispatchState& state,
                                     absl::Span<const float> dy, absl::Span<float> d_a,
                                     absl::Span<float> d_combine_weight,
                                     const ExpertWeightGrads& local_grads) {
  const int P = ep_group.size();
  GRADSUM_RETURN_IF_ERROR(ValidateDispatchConfig(config, P));
  const int64_t D = config.d_model;
  const int K = config.top_k;
  const int64_t T = state.num_tokens;
  const int64_t num_sent = state.sent_rows();
  const int64_t num_received = state.received_rows();
  if (state.send_rows.size() != static_cast<size_t>(P) ||
      state.recv_rows.size() != static_cast<size_t>(P) ||
      state.combine_weight.size() != static_cast<size_t>(T * K) ||
      state.copy_output.size() != static_cast<size_t>(num_sent * D) ||
      state.expert_input.size() != static_cast<size_t>(num_received * D)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dispatch state (T=", T, ", ", state.send_rows.size(),
                     " EP ranks) does not come from a forward with D=", D, ", K=", K, ", P=", P));
  }
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("dispatch dy", dy.size(), T * D, "[T, D]"));
  GRADSUM_RETURN_IF_ERROR(internal::CheckSize("dispatch d_a", d_a.size(), T * D, "[T, D]"));
  GRADSUM_RETURN_IF_ERROR(
      internal::CheckSize("dispatch d_combine_weight", d_combine_weight.size(), T * K, "[T, K]"));
  GRADSUM_RETURN_IF_ERROR(CheckExpertWeights(LocalExpertsConfig(config, P), local_weights));
  GRADSUM_RETURN_IF_ERROR(CheckExpertWeightGrads(LocalExpertsConfig(config, P), local_grads));

  // d w_tk = <dy_t, out_tk>; the copy's output gradient is w_tk dy_t (sent in send order).
  std::fill(d_combine_weight.begin(), d_combine_weight.end(), 0.0f);
  float* send = Scratch(state.scratch_send, num_sent * D);
  for (int64_t pos = 0; pos < num_sent; ++pos) {
    const int64_t c = state.send_copy[pos];
    const float* dyt = &dy[(c / K) * D];
    const float* out = &state.copy_output[pos * D];
    const float w = state.combine_weight[c];
    double dot = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      dot += static_cast<double>(dyt[d]) * out[d];
      send[pos * D + d] = w * dyt[d];
    }
    d_combine_weight[c] = static_cast<float>(dot);
  }
  const bool regroup = P > 1 && config.num_experts / P > 1;  // as in forward
  float* expert_dy = Scratch(state.scratch_expert_a, num_received * D);
  float* expert_dx = Scratch(state.scratch_expert_b, num_received * D);
  float* recv = regroup ? Scratch(state.scratch_recv, num_received * D) : expert_dy;
  GRADSUM_RETURN_IF_ERROR(
      Annotate(ExchangeRows(ep_group, send, state.send_rows, recv, state.recv_rows, D),
               "dispatching output gradients"));
  if (regroup) ScatterRows(recv, state.expert_row, D, expert_dy);
  GRADSUM_RETURN_IF_ERROR(ExpertsBackward(
      LocalExpertsConfig(config, P), local_weights, state.expert_input, state.local_group_sizes,
      state.experts_saved, absl::MakeSpan(expert_dy, num_received * D),
      absl::MakeSpan(expert_dx, num_received * D), local_grads));
  if (regroup) GatherRows(expert_dx, state.expert_row, D, recv);
  GRADSUM_RETURN_IF_ERROR(Annotate(
      ExchangeRows(ep_group, regroup ? recv : expert_dx, state.recv_rows, send, state.send_rows, D),
      "returning input gradients"));
  // Sum the K copies of each token into d_a.
  for (int64_t pos = 0; pos < num_sent; ++pos) {
    float* dat = &d_a[(state.send_copy[pos] / K) * D];
    const float* g = send + pos * D;
    for (int64_t d = 0; d < D; ++d) dat[d] += g[d];
  }
  return absl::OkStatus();
}

}  // namespace gradsum::moe
