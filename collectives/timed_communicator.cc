#include "collectives/timed_communicator.h"

#include <utility>

namespace gradsum {
namespace {

class TimedWork : public Work {
 public:
  TimedWork(std::unique_ptr<Work> inner, std::shared_ptr<CommTimer> timer, CommKind kind,
            absl::Time issued)
      : inner_(std::move(inner)), timer_(std::move(timer)), kind_(kind) {
    op_ = std::make_shared<CommTimer::InFlight>();
    op_->work = inner_.get();
    op_->issued = issued;
    timer_->Track(op_);
  }
  ~TimedWork() override {
    // Never waited on: count it until its completion (or now, if it is still in flight or
    // not stamped), and stop tracking the handle.
    timer_->Complete(*op_);
  }
  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time start = absl::Now();
    absl::Status s = inner_->Wait(timeout);
    const absl::Time end = absl::Now();
    timer_->Add(end - start, kind_);
    if (s.ok() || inner_->IsCompleted()) timer_->Complete(*op_);
    timer_->Poll();
    return s;
  }
  bool IsCompleted() override {
    const bool done = inner_->IsCompleted();
    if (done) timer_->Complete(*op_);
    return done;
  }
  absl::Time CompletionTime() override { return inner_->CompletionTime(); }

 private:
  std::unique_ptr<Work> inner_;
  std::shared_ptr<CommTimer> timer_;
  const CommKind kind_;
  std::shared_ptr<CommTimer::InFlight> op_;
};

}  // namespace

const char* CommKindName(CommKind kind) {
  switch (kind) {
    case CommKind::kAllGather:
      return "all_gather";
    case CommKind::kReduceScatter:
      return "reduce_scatter";
    case CommKind::kAllReduce:
      return "all_reduce";
    case CommKind::kAllToAll:
      return "all_to_all";
    case CommKind::kOther:
      return "other";
  }
  return "other";
}

absl::Duration CommTimer::Total() const {
  int64_t sum = 0;
  for (const std::atomic<int64_t>& n : nanos_) sum += n.load();
  return absl::Nanoseconds(sum);
}

CommTimer::Exposed CommTimer::TakeByKind() {
  Exposed e;
  int64_t sum = 0;
  for (int k = 0; k < kNumCommKinds; ++k) {
    const int64_t n = nanos_[k].exchange(0);
    e.by_kind[k] = absl::Nanoseconds(n);
    sum += n;
  }
  e.total = absl::Nanoseconds(sum);
  return e;
}

void CommTimer::Track(std::shared_ptr<InFlight> op) {
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_.push_back(std::move(op));
}

void CommTimer::CompleteLocked(InFlight& op, absl::Time now) {
  if (op.done) return;
  absl::Time end = op.work != nullptr ? op.work->CompletionTime() : absl::InfiniteFuture();
  if (end == absl::InfiniteFuture()) end = now;  // not stamped, or still in flight
  op.done = true;
  op.work = nullptr;
  AddBusy(end - op.issued);
}

void CommTimer::Complete(InFlight& op) {
  std::lock_guard<std::mutex> lock(mu_);
  CompleteLocked(op, absl::Now());
}

void CommTimer::Poll() {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time now = absl::Now();
  size_t kept = 0;
  for (size_t i = 0; i < in_flight_.size(); ++i) {
    InFlight& op = *in_flight_[i];
    if (!op.done && op.work->IsCompleted()) CompleteLocked(op, now);
    if (!op.done) in_flight_[kept++] = in_flight_[i];
  }
  in_flight_.resize(kept);
}

TimedCommunicator::TimedCommunicator(std::unique_ptr<Communicator> inner,
                                     std::shared_ptr<CommTimer> timer)
    : ForwardingCommunicator(std::move(inner)), timer_(std::move(timer)) {}

TimedCommunicator::TimedCommunicator(Communicator* inner, std::shared_ptr<CommTimer> timer)
    : ForwardingCommunicator(inner), timer_(std::move(timer)) {}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::Wrap(
    CommKind kind, absl::Time start, absl::StatusOr<std::unique_ptr<Work>> work) {
  const absl::Duration issuing = absl::Now() - start;
  timer_->Add(issuing, kind);
  timer_->Poll();
  if (!work.ok()) {
    timer_->AddBusy(issuing);
    return work.status();
  }
  return std::unique_ptr<Work>(new TimedWork(std::move(*work), timer_, kind, start));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::AllReduceAsync(const void* send,
                                                                        void* recv, size_t count,
                                                                        DType dtype, ReduceOp op) {
  const absl::Time start = absl::Now();
  return Wrap(CommKind::kAllReduce, start, inner().AllReduceAsync(send, recv, count, dtype, op));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::ReduceScatterAsync(
    const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op) {
  const absl::Time start = absl::Now();
  return Wrap(CommKind::kReduceScatter, start,
              inner().ReduceScatterAsync(send, recv, recv_count, dtype, op));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::AllGatherAsync(const void* send,
                                                                        void* recv,
                                                                        size_t send_count,
                                                                        DType dtype) {
  const absl::Time start = absl::Now();
  return Wrap(CommKind::kAllGather, start, inner().AllGatherAsync(send, recv, send_count, dtype));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::AllToAllVAsync(
    const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
    void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
    DType dtype) {
  const absl::Time start = absl::Now();
  return Wrap(CommKind::kAllToAll, start,
              inner().AllToAllVAsync(send, send_counts, send_offsets, recv, recv_counts,
                                     recv_offsets, dtype));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::BroadcastAsync(void* buf, size_t count,
                                                                        DType dtype, int root) {
  const absl::Time start = absl::Now();
  return Wrap(CommKind::kOther, start, inner().BroadcastAsync(buf, count, dtype, root));
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::BarrierAsync() {
  const absl::Time start = absl::Now();
  return Wrap(CommKind::kOther, start, inner().BarrierAsync());
}

absl::StatusOr<std::unique_ptr<Communicator>> TimedCommunicator::Split(int color, int key) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Communicator>> sub = inner().Split(color, key);
  timer_->Add(absl::Now() - start, CommKind::kOther);
  if (!sub.ok() || *sub == nullptr) return sub;
  return std::unique_ptr<Communicator>(new TimedCommunicator(std::move(*sub), timer_));
}

template <typename F>
absl::Status TimedCommunicator::TimeSync(CommKind kind, F&& call) {
  const absl::Time start = absl::Now();
  absl::Status s = call();
  const absl::Duration took = absl::Now() - start;
  timer_->Add(took, kind);
  timer_->AddBusy(took);
  timer_->Poll();
  return s;
}

absl::Status TimedCommunicator::AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                          ReduceOp op) {
  return TimeSync(CommKind::kAllReduce,
                  [&] { return inner().AllReduce(send, recv, count, dtype, op); });
}

absl::Status TimedCommunicator::ReduceScatter(const void* send, void* recv, size_t recv_count,
                                              DType dtype, ReduceOp op) {
  return TimeSync(CommKind::kReduceScatter,
                  [&] { return inner().ReduceScatter(send, recv, recv_count, dtype, op); });
}

absl::Status TimedCommunicator::AllGather(const void* send, void* recv, size_t send_count,
                                          DType dtype) {
  return TimeSync(CommKind::kAllGather,
                  [&] { return inner().AllGather(send, recv, send_count, dtype); });
}

absl::Status TimedCommunicator::AllToAllV(const void* send, absl::Span<const size_t> send_counts,
                                          absl::Span<const size_t> send_offsets, void* recv,
                                          absl::Span<const size_t> recv_counts,
                                          absl::Span<const size_t> recv_offsets, DType dtype) {
  return TimeSync(CommKind::kAllToAll, [&] {
    return inner().AllToAllV(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                             dtype);
  });
}

absl::Status TimedCommunicator::Broadcast(void* buf, size_t count, DType dtype, int root) {
  return TimeSync(CommKind::kOther, [&] { return inner().Broadcast(buf, count, dtype, root); });
}

absl::Status TimedCommunicator::Barrier() {
  return TimeSync(CommKind::kOther, [&] { return inner().Barrier(); });
}

}  // namespace gradsum
