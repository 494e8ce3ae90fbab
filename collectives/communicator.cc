#include "collectives/communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace gradsum {

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "invalid";
}

absl::Status Communicator::WaitIssued(absl::StatusOr<std::unique_ptr<Work>> work) {
  if (!work.ok()) return work.status();
  return (*work)->Wait(OperationWaitLimit());
}

absl::Status Communicator::AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                     ReduceOp op) {
  return WaitIssued(AllReduceAsync(send, recv, count, dtype, op));
}

absl::Status Communicator::ReduceScatter(const void* send, void* recv, size_t recv_count,
                                         DType dtype, ReduceOp op) {
  return WaitIssued(ReduceScatterAsync(send, recv, recv_count, dtype, op));
}

absl::Status Communicator::AllGather(const void* send, void* recv, size_t send_count, DType dtype) {
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

absl::StatusOr<std::unique_ptr<Work>> Communicator::SendAsync(const void*, size_t, DType, int,
                                                              int) {
  return absl::UnimplementedError(
      absl::StrCat("send: the ", backend(), " backend has no point-to-point operations"));
}

absl::StatusOr<std::unique_ptr<Work>> Communicator::RecvAsync(void*, size_t, DType, int, int) {
  return absl::UnimplementedError(
      absl::StrCat("recv: the ", backend(), " backend has no point-to-point operations"));
}

absl::Status Communicator::Send(const void* buf, size_t count, DType dtype, int peer, int tag) {
  return WaitIssued(SendAsync(buf, count, dtype, peer, tag));
}

absl::Status Communicator::Recv(void* buf, size_t count, DType dtype, int peer, int tag) {
  return WaitIssued(RecvAsync(buf, count, dtype, peer, tag));
}

namespace {

// A Work whose Wait() without an argument uses the timeout of its options.
class TimeoutWork final : public Work {
 public:
  TimeoutWork(std::unique_ptr<Work> inner, absl::Duration timeout)
      : inner_(std::move(inner)), timeout_(timeout) {}
  absl::Status Wait(absl::Duration timeout) override {
    return inner_->Wait(timeout == absl::InfiniteDuration() ? timeout_ : timeout);
  }
  bool IsCompleted() override { return inner_->IsCompleted(); }
  absl::Time CompletionTime() override { return inner_->CompletionTime(); }

 private:
  std::unique_ptr<Work> inner_;
  absl::Duration timeout_;
};

}  // namespace

template <typename Sync, typename Async>
absl::Status Communicator::WithTimeout(absl::Duration timeout, Sync&& sync, Async&& async) {
  if (timeout == absl::ZeroDuration()) return sync();
  absl::StatusOr<std::unique_ptr<Work>> work = async();
  if (!work.ok()) return work.status();
  return (*work)->Wait(timeout);
}

absl::StatusOr<std::unique_ptr<Work>> Communicator::DefaultWait(
    absl::Duration timeout, absl::StatusOr<std::unique_ptr<Work>> work) {
  if (!work.ok() || timeout == absl::ZeroDuration()) return work;
  return std::unique_ptr<Work>(new TimeoutWork(std::move(*work), timeout));
}

absl::Status Communicator::AllReduce(const AllReduceOptions& o) {
  return WithTimeout(
      o.timeout, [&] { return AllReduce(o.send, o.recv, o.count, o.dtype, o.op); },
      [&] { return AllReduceAsync(o.send, o.recv, o.count, o.dtype, o.op); });
}
absl::StatusOr<std::unique_ptr<Work>> Communicator::AllReduceAsync(const AllReduceOptions& o) {
  return DefaultWait(o.timeout, AllReduceAsync(o.send, o.recv, o.count, o.dtype, o.op));
}

absl::Status Communicator::ReduceScatter(const ReduceScatterOptions& o) {
  return WithTimeout(
      o.timeout, [&] { return ReduceScatter(o.send, o.recv, o.recv_count, o.dtype, o.op); },
      [&] { return ReduceScatterAsync(o.send, o.recv, o.recv_count, o.dtype, o.op); });
}
absl::StatusOr<std::unique_ptr<Work>> Communicator::ReduceScatterAsync(
    const ReduceScatterOptions& o) {
  return DefaultWait(o.timeout, ReduceScatterAsync(o.send, o.recv, o.recv_count, o.dtype, o.op));
}

absl::Status Communicator::AllGather(const AllGatherOptions& o) {
  return WithTimeout(
      o.timeout, [&] { return AllGather(o.send, o.recv, o.send_count, o.dtype); },
      [&] { return AllGatherAsync(o.send, o.recv, o.send_count, o.dtype); });
}
absl::StatusOr<std::unique_ptr<Work>> Communicator::AllGatherAsync(const AllGatherOptions& o) {
  return DefaultWait(o.timeout, AllGatherAsync(o.send, o.recv, o.send_count, o.dtype));
}

absl::Status Communicator::AllToAllV(const AllToAllVOptions& o) {
  return WithTimeout(
      o.timeout,
      [&] {
        return AllToAllV(o.send, o.send_counts, o.send_offsets, o.recv, o.recv_counts,
                         o.recv_offsets, o.dtype);
      },
      [&] {
        return AllToAllVAsync(o.send, o.send_counts, o.send_offsets, o.recv, o.recv_counts,
                              o.recv_offsets, o.dtype);
      });
}
absl::StatusOr<std::unique_ptr<Work>> Communicator::AllToAllVAsync(const AllToAllVOptions& o) {
  return DefaultWait(o.timeout, AllToAllVAsync(o.send, o.send_counts, o.send_offsets, o.recv,
                                               o.recv_counts, o.recv_offsets, o.dtype));
}

absl::Status Communicator::Broadcast(const BroadcastOptions& o) {
  return WithTimeout(
      o.timeout, [&] { return Broadcast(o.buf, o.count, o.dtype, o.root); },
      [&] { return BroadcastAsync(o.buf, o.count, o.dtype, o.root); });
}
absl::StatusOr<std::unique_ptr<Work>> Communicator::BroadcastAsync(const BroadcastOptions& o) {
  return DefaultWait(o.timeout, BroadcastAsync(o.buf, o.count, o.dtype, o.root));
}

absl::Status Communicator::Barrier(const BarrierOptions& o) {
  return WithTimeout(
      o.timeout, [&] { return Barrier(); }, [&] { return BarrierAsync(); });
}
absl::StatusOr<std::unique_ptr<Work>> Communicator::BarrierAsync(const BarrierOptions& o) {
  return DefaultWait(o.timeout, BarrierAsync());
}

}  // namespace gradsum
