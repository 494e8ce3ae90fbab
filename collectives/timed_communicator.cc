#include "collectives/timed_communicator.h"

#include <utility>

namespace gradsum::train {
namespace {

class TimedWork : public Work {
 public:
  TimedWork(std::unique_ptr<Work> inner, std::shared_ptr<CommTimer> timer)
      : inner_(std::move(inner)), timer_(std::move(timer)) {}
  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time start = absl::Now();
    absl::Status s = inner_->Wait(timeout);
    timer_->Add(absl::Now() - start);
    return s;
  }
  bool IsCompleted() override { return inner_->IsCompleted(); }

 private:
  std::unique_ptr<Work> inner_;
  std::shared_ptr<CommTimer> timer_;
};

}  // namespace

TimedCommunicator::TimedCommunicator(std::unique_ptr<Communicator> inner,
                                     std::shared_ptr<CommTimer> timer)
    : owned_(std::move(inner)), inner_(owned_.get()), timer_(std::move(timer)) {}

TimedCommunicator::TimedCommunicator(Communicator* inner, std::shared_ptr<CommTimer> timer)
    : inner_(inner), timer_(std::move(timer)) {}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::Wrap(
    absl::Time start, absl::StatusOr<std::unique_ptr<Work>> work) {
  timer_->Add(absl::Now() - start);
  if (!work.ok()) return work.status();
  return std::unique_ptr<Work>(new TimedWork(std::move(*work), timer_));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::AllReduceAsync(const void* send,
                                                                        void* recv, size_t count,
                                                                        DType dtype, ReduceOp op) {
  const absl::Time start = absl::Now();
  return Wrap(start, inner_->AllReduceAsync(send, recv, count, dtype, op));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::ReduceScatterAsync(
    const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op) {
  const absl::Time start = absl::Now();
  return Wrap(start, inner_->ReduceScatterAsync(send, recv, recv_count, dtype, op));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::AllGatherAsync(const void* send,
                                                                        void* recv,
                                                                        size_t send_count,
                                                                        DType dtype) {
  const absl::Time start = absl::Now();
  return Wrap(start, inner_->AllGatherAsync(send, recv, send_count, dtype));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::AllToAllVAsync(
    const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
    void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
    DType dtype) {
  const absl::Time start = absl::Now();
  return Wrap(start, inner_->AllToAllVAsync(send, send_counts, send_offsets, recv, recv_counts,
                                            recv_offsets, dtype));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::BroadcastAsync(void* buf, size_t count,
                                                                        DType dtype, int root) {
  const absl::Time start = absl::Now();
  return Wrap(start, inner_->BroadcastAsync(buf, count, dtype, root));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::BarrierAsync() {
  const absl::Time start = absl::Now();
  return Wrap(start, inner_->BarrierAsync());
}

absl::StatusOr<std::unique_ptr<Communicator>> TimedCommunicator::Split(int color, int key) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Communicator>> sub = inner_->Split(color, key);
  timer_->Add(absl::Now() - start);
  if (!sub.ok() || *sub == nullptr) return sub;
  return std::unique_ptr<Communicator>(new TimedCommunicator(std::move(*sub), timer_));
}

}  // namespace gradsum::train
