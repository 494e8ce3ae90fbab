#include "collectives/communicator.h"

namespace gradsum {

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "invalid";
}

absl::Status Communicator::WaitIssued(absl::StatusOr<std::unique_ptr<Work>> work) {
  if (!work.ok()) return work.status();
  return (*work)->Wait(timeout() + absl::Seconds(5));
}

absl::Status Communicator::AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                     ReduceOp op) {
  return WaitIssued(AllReduceAsync(send, recv, count, dtype, op));
}

absl::Status Communicator::ReduceScatter(const void* send, void* recv, size_t recv_count,
                                         DType dtype, ReduceOp op) {
  return WaitIssued(ReduceScatterAsync(send, recv, recv_count, dtype, op));
}

absl::Status Communicator::AllGather(const void* send, void* recv, size_t send_count,
                                     DType dtype) {
  return WaitIssued(AllGatherAsync(send, recv, send_count, dtype));
}

absl::Status Communicator::AllToAllV(const void* send, absl::Span<const size_t> send_counts,
                                     absl::Span<const size_t> send_offsets, void* recv,
                                     absl::Span<const size_t> recv_counts,
                                     absl::Span<const size_t> recv_offsets, DType dtype) {
  return WaitIssued(
      AllToAllVAsync(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, dtype));
}

absl::Status Communicator::Broadcast(void* buf, size_t count, DType dtype, int root) {
  return WaitIssued(BroadcastAsync(buf, count, dtype, root));
}

absl::Status Communicator::Barrier() { return WaitIssued(BarrierAsync()); }

}  // namespace gradsum
