#ifndef GRADSUM_MOE_EP_EXCHANGE_H_
#define GRADSUM_MOE_EP_EXCHANGE_H_

// The row bookkeeping of one dropless EP exchange when rows stay grouped by source on the
// receiving side (the GPU path, moe/cuda/moe_layer_cuda.h): pure host arithmetic, no
// communication, so it is tested on the CPU.
//
// Send side: the K copies of this rank's tokens sorted by expert (moe/cuda/permute_cuda.h),
// expert e's rows at [offsets[e], offsets[e+1]); EP rank p owns experts [p*El, (p+1)*El),
// so its rows are the contiguous block [offsets[p*El], offsets[(p+1)*El]).
// Receive side: source p's rows at [source_first_row[p], +source_offsets[p][El]), and within
// them local expert j's rows at [source_offsets[p][j], source_offsets[p][j+1]) (relative).
// The reverse exchange (expert outputs home, or input gradients home) swaps the two sides.
//
//   GRADSUM_ASSIGN_OR_RETURN(std::vector<int64_t> peer_counts,
//                            ExchangeExpertCounts(host_ep_group, offsets));
//   GRADSUM_ASSIGN_OR_RETURN(EpExchangePlan plan, PlanEpExchange(offsets, peer_counts, P, D));
//   comm.AllToAllV(send, plan.send_counts, plan.send_offsets, recv, plan.recv_counts,
//                  plan.recv_offsets, DType::kF32);

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"

namespace gradsum::moe {

struct EpExchangePlan {
  // Per EP rank, in elements (rows * width), for Communicator::AllToAllV.
  std::vector<size_t> send_counts, send_offsets, recv_counts, recv_offsets;
  // Per source rank p: El + 1 row prefix sums of its rows by local expert.
  std::vector<std::vector<int64_t>> source_offsets;
  std::vector<int64_t> source_first_row;  // per source: first received row
  int64_t recv_rows = 0;                  // R: rows this rank's experts process
};

// `expert_offsets`: E + 1 non-decreasing row offsets from 0 (E = P * El);
// `peer_counts`: P * El non-negative counts; `ep_size` P >= 1 dividing E; `width` >= 0
// elements per row. InvalidArgument naming the offending value otherwise.
absl::StatusOr<EpExchangePlan> PlanEpExchange(absl::Span<const int64_t> expert_offsets,
                                              absl::Span<const int64_t> peer_counts, int ep_size,
                                              int64_t width);

// The count exchange that precedes the rows': sends every EP rank p the row counts of its
// experts [p*El, (p+1)*El) (from `expert_offsets`, E + 1 entries as above) and returns
// peer_counts for PlanEpExchange: P * El entries, [p * El + j] = rows source p sends to my
// local expert j. Collective over `ep_group` (host buffers: the mpi or thread backend).
// InvalidArgument for offsets that are not E + 1 non-decreasing values from 0 with
// E % P == 0 (before any communication); the communicator's errors otherwise.
absl::StatusOr<std::vector<int64_t>> ExchangeExpertCounts(Communicator& ep_group,
                                                          absl::Span<const int64_t> expert_offsets);

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_EP_EXCHANGE_H_
