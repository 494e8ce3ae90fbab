#include "collectives/self_communicator.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collectives/op_descriptor.h"

namespace gradsum {
namespace {

using collectives_internal::MakeAllToAllVCall;
using collectives_internal::MakeBroadcastCall;
using collectives_internal::MakeCall;
using collectives_internal::OpCall;
using collectives_internal::OpKind;
using collectives_internal::ValidateCall;

// Finished when issued.
class DoneWork final : public Work {
 public:
  DoneWork() : done_(absl::Now()) {}
  absl::Status Wait(absl::Duration) override { return absl::OkStatus(); }
  bool IsCompleted() override { return true; }
  absl::Time CompletionTime() override { return done_; }

 private:
  absl::Time done_;
};

// Copies `count` elements from `from` to `to` unless they are the same place (the in-place
// forms), and hands back the finished operation.
std::unique_ptr<Work> Copy(const void* from, void* to, size_t count, DType dtype) {
  if (count > 0 && from != to) std::memmove(to, from, count * DTypeSize(dtype));
  return std::unique_ptr<Work>(new DoneWork());
}

// Checks the call as every backend does (a group of one: rank 0 of 1), then copies.
absl::StatusOr<std::unique_ptr<Work>> CheckedCopy(const OpCall& call, const void* from, void* to,
                                                  size_t count) {
  if (absl::Status s = ValidateCall(call, /*rank=*/0, /*size=*/1); !s.ok()) return s;
  return Copy(from, to, count, call.dtype);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Work>> SelfCommunicator::AllReduceAsync(const void* send, void* recv,
                                                                       size_t count, DType dtype,
                                                                       ReduceOp op) {
  return CheckedCopy(MakeCall(OpKind::kAllReduce, send, recv, count, dtype, op), send, recv, count);
}

absl::StatusOr<std::unique_ptr<Work>> SelfCommunicator::ReduceScatterAsync(
    const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op) {
  return CheckedCopy(MakeCall(OpKind::kReduceScatter, send, recv, recv_count, dtype, op), send,
                     recv, recv_count);
}

absl::StatusOr<std::unique_ptr<Work>> SelfCommunicator::AllGatherAsync(const void* send, void* recv,
                                                                       size_t send_count,
                                                                       DType dtype) {
  return CheckedCopy(MakeCall(OpKind::kAllGather, send, recv, send_count, dtype), send, recv,
                     send_count);
}

absl::StatusOr<std::unique_ptr<Work>> SelfCommunicator::AllToAllVAsync(
    const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
    void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
    DType dtype) {
  const OpCall call =
      MakeAllToAllVCall(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, dtype);
  if (absl::Status s = ValidateCall(call, 0, 1); !s.ok()) return s;
  // The one block goes to this rank itself: what it sends is what it receives.
  if (send_counts[0] != recv_counts[0]) {
    return absl::InvalidArgumentError(absl::StrCat("all_to_all_v: rank 0 sends ", send_counts[0],
                                                   " elements to itself but ", "expects ",
                                                   recv_counts[0]));
  }
  const size_t bytes = DTypeSize(dtype);
  return Copy(static_cast<const char*>(send) + send_offsets[0] * bytes,
              static_cast<char*>(recv) + recv_offsets[0] * bytes, send_counts[0], dtype);
}

absl::StatusOr<std::unique_ptr<Work>> SelfCommunicator::BroadcastAsync(void* buf, size_t count,
                                                                       DType dtype, int root) {
  return CheckedCopy(MakeBroadcastCall(buf, count, dtype, root), buf, buf, 0);
}

absl::StatusOr<std::unique_ptr<Work>> SelfCommunicator::BarrierAsync() {
  return CheckedCopy(MakeCall(OpKind::kBarrier, nullptr, nullptr, 0, DType::kF32), nullptr, nullptr,
                     0);
}

absl::StatusOr<std::unique_ptr<Communicator>> SelfCommunicator::Split(int color, int /*key*/) {
  if (color < 0) return std::unique_ptr<Communicator>();
  return std::unique_ptr<Communicator>(new SelfCommunicator());
}

}  // namespace gradsum
