#ifndef GRADSUM_MOE_DISPATCH_H_
#define GRADSUM_MOE_DISPATCH_H_

// Dropless token dispatch and combine over the EP group (SEMANTICS.md §1, §10).
//
// The EP group has P ranks; expert e lives on EP rank e / (E / P) (moe/placement.h). Each
// rank holds its own tokens ("home" rank) and the E / P experts of its slot.
//
// Forward, on every EP rank:
//   1. the K copies of every routed token are ordered by destination expert (so also by
//      destination rank),
//   2. per-expert counts are exchanged (one all-gather of E int64 per rank),
//   3. the rows are packed into the send buffer and go to the experts' owners (all-to-all-v),
//      landing grouped by local expert, where the grouped SwiGLU experts run (moe/experts.h),
//   4. the outputs go back (all-to-all-v) and the home rank combines them straight from the
//      receive buffer: y_t = sum_k w_tk * Expert_{i_tk}(a_t).
// Each row is copied at most twice each way (pack + exchange, exchange + combine); rows for
// this rank's own experts skip the exchange.
// Backward sends w_tk * dy_t to the owners, runs the experts' backward (weight gradients
// accumulate there), sends the input gradients back and sums the K copies into d_a. It also
// returns d w_tk = <dy_t, Expert_{i_tk}(a_t)>, the gradient for the router (moe/router.h).
//
// Overlap: the exchanges are asynchronous and pipelined with the experts (as Tutel's and
// Megatron's MoE overlap do). There is one all-to-all-v per local expert slot j (it carries
// expert p * E/P + j's rows for every owner p), all issued at once; the local experts run
// in chunks of consecutive slots, each chunk as soon as its slots have arrived, and each
// chunk's results start back while the next chunk computes. So apart from waiting for an
// EP peer whose experts got more rows (load imbalance, which no overlap hides), only the
// first chunk's arrival and the last chunk's return leave the rank idle. Chunks are as
// wide as the thread budget (ComputeThreads(), core/thread_pool.h) allows the experts of
// one call to run in parallel, with at least two chunks when E/P >= 2; one chunk at P = 1.
// Every expert still sees all its rows in one call of moe/experts.h, so the results are
// bit-identical to the unchunked computation.
//
// Dropless: every copy reaches its expert whatever the imbalance; an expert or a rank may
// receive zero rows, and a rank may have zero tokens. Counts are data-dependent, so every
// EP rank must call forward and backward, even with no tokens.
//
// All argument checks run before the first collective. A rank that fails one returns its
// InvalidArgument at once; the other ranks then fail in the first exchange with the
// communicator's DeadlineExceeded (after its timeout), as for any rank that does not arrive.
//
//   DispatchConfig config{.d_model = D, .hidden = H, .num_experts = E, .top_k = K};
//   DispatchState state;
//   GRADSUM_RETURN_IF_ERROR(DispatchCombineForward(ep_group, config, local_weights, a,
//                                                  route.expert_index, route.combine_weight,
//                                                  y, &state));
//   ...
//   GRADSUM_RETURN_IF_ERROR(DispatchCombineBackward(ep_group, config, local_weights, state, dy,
//                                                   d_a, d_combine_weight, local_grads));

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "moe/experts.h"

namespace gradsum::moe {

// Scratch buffers that several dispatch states may share (one per rank, reused by every
// layer): they hold no meaning between calls, so calls that never overlap can share them.
struct DispatchScratch {
  std::vector<float> send, expert_a, expert_b;
};

struct DispatchConfig {
  int64_t d_model = 0;  // D
  int64_t hidden = 0;   // H, expert width
  int num_experts = 0;  // E, over the whole EP group; E % P == 0
  int top_k = 0;        // K, 1 <= K <= E
  // Reproducible mode: the local experts' row blocks in the owner layout, passed on as
  // ExpertsConfig::row_blocks (moe/experts.h; moe/moe_layer.h computes them). Not owned.
  const std::vector<std::vector<int64_t>>* expert_row_blocks = nullptr;
  // Activation recomputation: the per-expert row counts of every EP rank ([P, E]) that an
  // earlier dispatch of the same routing exchanged (DispatchState::all_counts), used instead
  // of all-gathering them again. Not owned.
  const std::vector<int64_t>* all_counts = nullptr;
  // Shared scratch (not owned) used instead of the state's own, for callers whose calls
  // never overlap (one rank's layers run one at a time); null: the state's own.
  DispatchScratch* scratch = nullptr;
};

// What forward keeps for backward (one per layer and micro-batch). Opaque to callers except
// for the read-only statistics at the end.
//
// Row layouts (moe/dispatch.cc): home side, the routed copies in send order (sorted by
// destination expert, so by destination EP rank); owner side, the rows grouped by local
// expert (the experts' input layout), and within an expert by source rank. Each exchange is
// one all-to-all-v per local expert slot, straight between the two layouts; rows for this
// rank's own experts never enter an exchange.
struct DispatchState {
  int64_t num_tokens = 0;
  // Home side: the copies in send order (sorted by destination expert).
  std::vector<int64_t> send_copy;     // [S] copy index t * K + k of each sent row
  std::vector<int64_t> copy_pos;      // [T * K] its inverse: copy c's send position, or -1
  std::vector<int64_t> expert_first;  // [E + 1] first send position of each expert's rows
  std::vector<float> combine_weight;  // [T, K] the weights used by the combine
  // The sent rows for this rank's own experts: send positions [own_first, own_first +
  // own_rows). They never leave, so the home side's exchange buffers (copy_output, and the
  // send scratch) hold only the other X = S - own_rows rows: row pos, or pos - own_rows
  // after the own range.
  int64_t own_first = 0, own_rows = 0;
  // Where sent row `pos`'s expert output is: copy_output row output_row[pos] when >= 0,
  // else (own experts) expert_output row -1 - output_row[pos].
  std::vector<int64_t> output_row;  // [S]
  std::vector<float> copy_output;   // [X, D] expert outputs back home, in send order
  // Owner side: rows from source q for local expert j are the expert-major rows
  // [owner_first[q * El + j], + owner_count[q * El + j]).
  std::vector<int64_t> owner_first, owner_count;  // [P * El]
  std::vector<int64_t> all_counts;                // [P, E] rows EP rank q sends to expert e
  std::vector<int64_t> local_group_sizes;         // [E / P] rows per local expert
  int64_t num_received = 0;                       // R
  std::vector<float> expert_input;                // [R, D] rows grouped by local expert
  std::vector<float> expert_output;               // [R, D] their outputs, same layout
  // The pipeline's chunks of local experts: chunk c is experts [chunk_first[c],
  // chunk_first[c + 1]); what the experts keep for backward, per chunk.
  std::vector<int> chunk_first;
  std::vector<ExpertsSaved> experts_saved;

  // Scratch reused by later calls with the same state (so a layer's state kept across steps
  // allocates only once); holds no meaning between calls.
  mutable std::vector<float> scratch_send, scratch_expert_a, scratch_expert_b;

  // Rows this rank received for its experts, and rows it sent (= routed copies), for stats
  // and benchmarks.
  int64_t received_rows() const { return num_received; }
  int64_t sent_rows() const { return static_cast<int64_t>(send_copy.size()); }
  // Sent rows that cross to another rank (X above).
  int64_t exchanged_rows() const { return sent_rows() - own_rows; }
  // Send position `pos`'s row in the home side's exchange buffers; positions inside the
  // own range (never exchanged) map to its start.
  int64_t HomeRow(int64_t pos) const {
    return pos < own_first ? pos : pos < own_first + own_rows ? own_first : pos - own_rows;
  }
};

// InvalidArgument unless D, H >= 1, E >= 1, 1 <= K <= E and E % ep_size == 0 (the messages
// name the values, e.g. "E=6 ... P=4").
absl::Status ValidateDispatchConfig(const DispatchConfig& config, int ep_size);

// Forward. `ep_group`: the EP communicator (size P; this rank is EP slot ep_group.rank()).
// `local_weights`: the stacked weights of this rank's E / P experts (moe/experts.h).
// `a`: [T, D] this rank's tokens. `expert_index`: [T, K] experts in [0, E), or -1 for a copy
// that is not routed (the router marks padding tokens so). `combine_weight`: [T, K].
// `y`: [T, D], overwritten with sum_k w_tk Expert_{i_tk}(a_t) (0 for unrouted tokens).
// Collective over `ep_group`.
// Errors: InvalidArgument for a bad config, any span of the wrong size (named), or an
// expert index outside [-1, E) (names the token and slot); the communicator's errors
// (e.g. DeadlineExceeded when a rank does not take part) are returned as they are.
absl::Status DispatchCombineForward(Communicator& ep_group, const DispatchConfig& config,
                                    const ExpertWeights& local_weights, absl::Span<const float> a,
                                    absl::Span<const int32_t> expert_index,
                                    absl::Span<const float> combine_weight, absl::Span<float> y,
                                    DispatchState* state);

// Backward of the forward that filled `state`, with dy = dL/dy ([T, D]).
//   d_a              += sum_k (dL/d copy input)      [T, D], accumulated
//   d_combine_weight  = <dy_t, Expert_{i_tk}(a_t)>   [T, K], overwritten (0 for unrouted)
//   local_grads      += this rank's experts' weight gradients (sum over every rank's tokens
//                       that reached them; still to be summed over the EDP group, §7)
// Collective over `ep_group`. Errors: InvalidArgument for a bad config or span size, or a
// `state` that does not come from a forward with this config and group.
absl::Status DispatchCombineBackward(Communicator& ep_group, const DispatchConfig& config,
                                     const ExpertWeights& local_weights, const DispatchState& state,
                                     absl::Span<const float> dy, absl::Span<float> d_a,
                                     absl::Span<float> d_combine_weight,
                                     const ExpertWeightGrads& local_grads);

namespace internal {

// The same two calls with the owner side's compute passed in: the functions above pass the
// SwiGLU experts of moe/experts.h with their weights; bench/moe_bench.cc passes no-op experts
// to time the dispatch's data movement alone. Each call gets one pipeline chunk's rows (the
// chunk's experts only: the other local experts' group sizes are 0), as ExpertsForward /
// ExpertsBackward would, and `saved` is the chunk's.
using ExpertsForwardFn =
    std::function<absl::Status(absl::Span<const float> x, absl::Span<const int64_t> group_sizes,
                               absl::Span<float> y, ExpertsSaved* saved)>;
using ExpertsBackwardFn = std::function<absl::Status(
    absl::Span<const float> x, absl::Span<const int64_t> group_sizes, const ExpertsSaved& saved,
    absl::Span<const float> dy, absl::Span<float> dx)>;
absl::Status DispatchCombineForwardWith(Communicator& ep_group, const DispatchConfig& config,
                                        const ExpertsForwardFn& experts, absl::Span<const float> a,
                                        absl::Span<const int32_t> expert_index,
                                        absl::Span<const float> combine_weight, absl::Span<float> y,
                                        DispatchState* state);
absl::Status DispatchCombineBackwardWith(Communicator& ep_group, const DispatchConfig& config,
                                         const ExpertsBackwardFn& experts,
                                         const DispatchState& state, absl::Span<const float> dy,
                                         absl::Span<float> d_a, absl::Span<float> d_combine_weight);

}  // namespace internal

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_DISPATCH_H_
