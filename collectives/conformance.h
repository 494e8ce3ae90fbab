#ifndef GRADSUM_COLLECTIVES_CONFORMANCE_H_
#define GRADSUM_COLLECTIVES_CONFORMANCE_H_

// Conformance checks for any Communicator backend. Buffers are host memory: the thread and
// mpi tests call them directly; collectives/nccl_conformance_test.cc runs them against the
// nccl backend through an adapter that stages every call through device copies.
//
// Every check is collective: each rank of `comm` calls it with the same arguments, in the
// same order, as it would call the collective itself. Each rank generates every rank's
// input deterministically from (seed, rank, index), so it computes the expected result
// with a straightforward single-process reference and needs no extra communication.
// A check returns OK, the backend's own error, or Internal naming the first wrong
// element: operation, dtype, count, rank, index, got and expected values (bits too).
//
//   // Thread backend, from a test:
//   EXPECT_TRUE(testing::RunRanks(4, [](Communicator& comm) {
//     return conformance::CheckAllReduce(comm, DType::kBF16, ReduceOp::kSum, 1000,
//                                        /*in_place=*/true);
//   }).ok());
//   // MPI backend, in each process (integer-valued inputs: any summation order is exact):
//   conformance::CheckOptions opts;
//   opts.rank_ordered_sums = false;
//   absl::Status s = conformance::CheckAll(*mpi_comm, opts);
//
// In place follows the Communicator conventions: all-reduce send == recv; reduce-scatter
// recv == send + rank * recv_count; all-gather send == recv + rank * send_count.

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "collectives/communicator.h"
#include "core/dtype.h"

namespace gradsum::conformance {

struct CheckOptions {
  // true: floating inputs are random full-precision values and results must equal, bit for
  // bit, a reduction in ascending rank order with fp32 accumulation for bf16/f16/f32 and
  // fp64 for f64 (the CPU thread backend's contract, SEMANTICS.md §7). Integer inputs span
  // the full range (SUM wraps).
  // false: every input is a small integer, exact in every dtype and in any summation
  // order, so any backend that reduces correctly matches bit for bit.
  bool rank_ordered_sums = true;
  // Seeds the inputs; ranks must pass the same value.
  uint64_t seed = 1;
};

// recv = op over ranks of send, `count` elements.
absl::Status CheckAllReduce(Communicator& comm, DType dtype, ReduceOp op, size_t count,
                            bool in_place, const CheckOptions& options = {});

// Rank r receives the reduction of block r (recv_count elements); op is kSum or kAvg.
absl::Status CheckReduceScatter(Communicator& comm, DType dtype, ReduceOp op, size_t recv_count,
                                bool in_place, const CheckOptions& options = {});

// Block p of recv is rank p's send (send_count elements each).
absl::Status CheckAllGather(Communicator& comm, DType dtype, size_t send_count, bool in_place,
                            const CheckOptions& options = {});

// Uneven per-pair counts drawn from the seed, about a quarter of them zero (plus one rank
// that sends nothing at all when size() > 2), blocks at scattered offsets with gaps; checks
// every received block and that the gaps between receive blocks stay untouched.
// max_count bounds each pair's count.
absl::Status CheckAllToAllV(Communicator& comm, DType dtype, size_t max_count,
                            const CheckOptions& options = {});

// Every rank's buffer equals root's afterwards.
absl::Status CheckBroadcast(Communicator& comm, DType dtype, size_t count, int root,
                            const CheckOptions& options = {});

// Several async operations of different kinds issued back to back, waited in reverse
// order: each must complete with the right result (operations run in issue order).
// Then a barrier, and a zero-timeout Wait on a completed handle.
absl::Status CheckAsyncInIssueOrder(Communicator& comm, const CheckOptions& options = {});

// Split by parity with reversed keys (new rank order = descending old rank), an all-gather
// of old ranks inside the sub-communicator to verify membership and order, a split of that
// sub-communicator again (sub-of-sub, checked with an all-reduce), and a negative color
// (the last rank) that must return nullptr.
absl::Status CheckSplit(Communicator& comm, const CheckOptions& options = {});

// Disagreements that every rank must report as InvalidArgument mentioning the mismatch:
// the last rank passes a different count / dtype / reduce op / broadcast root / operation,
// or an all-to-all-v count matrix that does not match. Needs size() >= 2 (OK otherwise).
absl::Status CheckMismatchesFail(Communicator& comm);

// Point-to-point: each rank sends a stream of three messages (tag 0) and one on tag 7 to
// the next rank while receiving the previous rank's (tag 7 first), even ranks posting
// their sends first and odd ranks their receives, plus one message to itself; every Work
// waited for in reverse order; every message checked bit for bit.
absl::Status CheckSendRecv(Communicator& comm, DType dtype, size_t count,
                           const CheckOptions& options = {});

// Ranks 0 and 1 (others return OK): rank 0 sends 10 floats, rank 1 receives 12; both must
// fail with InvalidArgument naming the other rank and the counts, and a following
// exchange between them must still work.
absl::Status CheckSendRecvMismatchFails(Communicator& comm);

// CheckSendRecv over every dtype and counts {0, 1, 1000, 2^18}, then the mismatch. Not part
// of CheckAll: the nccl backend matches in order only (tag 0) and does not check sizes.
absl::Status CheckPointToPoint(Communicator& comm, const CheckOptions& options = {});

// Everything above over every dtype, in and out of place, counts {0, 1, 13, 1000, 4099}.
absl::Status CheckAll(Communicator& comm, const CheckOptions& options = {});

}  // namespace gradsum::conformance

#endif  // GRADSUM_COLLECTIVES_CONFORMANCE_H_
