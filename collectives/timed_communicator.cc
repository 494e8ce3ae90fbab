#include "collectives/timed_communicator.h"

#include <algorithm>
#include <utility>

#include "collectives/device_stream.h"
#include "core/status.h"

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

// An operation of a device backend, timed by markers recorded on its stream before and
// after it (TimedCommunicator::TimedStream).
class StreamTimedWork final : public Work {
 public:
  StreamTimedWork(std::unique_ptr<Work> inner, std::unique_ptr<StreamMarker> start,
                  std::unique_ptr<StreamMarker> end, absl::Duration blocked,
                  std::shared_ptr<CommTimer> timer, CommKind kind)
      : inner_(std::move(inner)),
        start_(std::move(start)),
        end_(std::move(end)),
        blocked_(blocked),
        timer_(std::move(timer)),
        kind_(kind) {}
  ~StreamTimedWork() override {
    if (!counted_ && end_->Reached()) Count();
  }
  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time start = absl::Now();
    absl::Status s = inner_->Wait(timeout);
    blocked_ += absl::Now() - start;
    if (s.ok() && !counted_) Count();
    return s;
  }
  bool IsCompleted() override {
    const bool done = inner_->IsCompleted();
    if (done && !counted_ && end_->Reached()) Count();
    return done;
  }
  absl::Time CompletionTime() override { return inner_->CompletionTime(); }

 private:
  // Busy: the markers' interval; exposed: the host's blocked time, capped at it.
  void Count() {
    counted_ = true;
    absl::StatusOr<absl::Duration> busy = end_->ElapsedSince(*start_);
    if (!busy.ok()) {  // an aborted operation: count the host's view of it
      timer_->AddBusy(blocked_);
      timer_->Add(blocked_, kind_);
      return;
    }
    timer_->AddBusy(*busy);
    timer_->Add(std::min(blocked_, *busy), kind_);
  }

  std::unique_ptr<Work> inner_;
  std::unique_ptr<StreamMarker> start_, end_;
  absl::Duration blocked_;
  std::shared_ptr<CommTimer> timer_;
  const CommKind kind_;
  bool counted_ = false;
};

}  // namespace

// The device-backend path: this decorator's view of the inner DeviceStream. Operations
// (and coalesced groups, as one) are timed by markers recorded on the stream around them.
class TimedCommunicator::TimedStream final : public DeviceStream {
 public:
  TimedStream(DeviceStream* inner, std::shared_ptr<CommTimer> timer, absl::Duration timeout)
      : inner_(inner), timer_(std::move(timer)), timeout_(timeout) {}

  CUstream_st* stream() const override { return inner_->stream(); }
  int device() const override { return inner_->device(); }
  absl::Status CheckBuffer(const void* p) const override { return inner_->CheckBuffer(p); }
  bool coalescing() const override { return inner_->coalescing(); }
  absl::StatusOr<std::unique_ptr<StreamMarker>> RecordMarker() override {
    return inner_->RecordMarker();
  }

  absl::Status BeginCoalescing() override {
    GRADSUM_RETURN_IF_ERROR(inner_->BeginCoalescing());
    absl::StatusOr<std::unique_ptr<StreamMarker>> start = inner_->RecordMarker();
    if (!start.ok()) {
      absl::StatusOr<std::unique_ptr<Work>> closed = inner_->EndCoalescing();
      if (closed.ok()) (*closed)->Wait(timeout_).IgnoreError();
      return start.status();
    }
    group_ = std::move(*start);
    group_start_ = absl::Now();
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Work>> EndCoalescing() override {
    std::unique_ptr<StreamMarker> start = std::move(group_);
    if (start == nullptr) return inner_->EndCoalescing();  // inner's FailedPrecondition
    return Finish(CommKind::kOther, group_start_, std::move(start), inner_->EndCoalescing());
  }
  absl::StatusOr<std::unique_ptr<Work>> AllReduceCoalescedAsync(absl::Span<const Buffer> buffers,
                                                                DType dtype, ReduceOp op) override {
    timer_->CountCall(CommKind::kAllReduce);
    return Timed(CommKind::kAllReduce,
                 [&] { return inner_->AllReduceCoalescedAsync(buffers, dtype, op); });
  }

  // Times what `issue` enqueues: a marker before, one after. Inside an open group the
  // operation is timed as part of the group.
  template <typename F>
  absl::StatusOr<std::unique_ptr<Work>> Timed(CommKind kind, F&& issue) {
    if (group_ != nullptr) return issue();
    const absl::Time start = absl::Now();
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<StreamMarker> before, inner_->RecordMarker());
    return Finish(kind, start, std::move(before), issue());
  }

 private:
  // Records the marker after `work` (of `kind`, issued since `start`) and wraps it.
  absl::StatusOr<std::unique_ptr<Work>> Finish(CommKind kind, absl::Time start,
                                               std::unique_ptr<StreamMarker> before,
                                               absl::StatusOr<std::unique_ptr<Work>> work) {
    const absl::Duration issuing = absl::Now() - start;
    if (!work.ok()) {
      timer_->Add(issuing, kind);
      timer_->AddBusy(issuing);
      return work.status();
    }
    absl::StatusOr<std::unique_ptr<StreamMarker>> after = inner_->RecordMarker();
    if (!after.ok()) {
      // Untimed rather than lost: the operation is in flight and its Work still works.
      timer_->Add(issuing, kind);
      timer_->AddBusy(issuing);
      return std::move(*work);
    }
    return std::unique_ptr<Work>(new StreamTimedWork(std::move(*work), std::move(before),
                                                     std::move(*after), issuing, timer_, kind));
  }

  DeviceStream* const inner_;
  const std::shared_ptr<CommTimer> timer_;
  const absl::Duration timeout_;
  std::unique_ptr<StreamMarker> group_;  // non-null while a coalesced group is open
  absl::Time group_start_;
};

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
    case CommKind::kSpAllToAll:
      return "sp_all_to_all";
    case CommKind::kCpRing:
      return "cp_ring";
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
    e.calls[k] = calls_[k].exchange(0);
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

namespace {

// Over a device backend, the stream path (null otherwise). (A template: the stream class is
// private to TimedCommunicator, which names it here.)
template <typename Stream>
std::unique_ptr<Stream> MakeStream(Communicator& inner, const std::shared_ptr<CommTimer>& timer) {
  DeviceStream* ds = inner.device_stream();
  if (ds == nullptr) return nullptr;
  return std::make_unique<Stream>(ds, timer, inner.timeout());
}

}  // namespace

TimedCommunicator::TimedCommunicator(std::unique_ptr<Communicator> inner,
                                     std::shared_ptr<CommTimer> timer)
    : ForwardingCommunicator(std::move(inner)),
      timer_(std::move(timer)),
      stream_(MakeStream<TimedStream>(this->inner(), timer_)) {}

TimedCommunicator::TimedCommunicator(Communicator* inner, std::shared_ptr<CommTimer> timer)
    : ForwardingCommunicator(inner),
      timer_(std::move(timer)),
      stream_(MakeStream<TimedStream>(this->inner(), timer_)) {}

TimedCommunicator::~TimedCommunicator() = default;

DeviceStream* TimedCommunicator::device_stream() { return stream_.get(); }

template <typename F>
absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::Timed(CommKind kind, F&& issue,
                                                               bool count_call) {
  if (count_call) timer_->CountCall(kind);
  if (stream_ != nullptr) return stream_->Timed(kind, issue);
  const absl::Time start = absl::Now();
  return Wrap(kind, start, issue());
}

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
  return Timed(CommKind::kAllReduce,
               [&] { return inner().AllReduceAsync(send, recv, count, dtype, op); });
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::ReduceScatterAsync(
    const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op) {
  return Timed(CommKind::kReduceScatter,
               [&] { return inner().ReduceScatterAsync(send, recv, recv_count, dtype, op); });
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::AllGatherAsync(const void* send,
                                                                        void* recv,
                                                                        size_t send_count,
                                                                        DType dtype) {
  return Timed(CommKind::kAllGather,
               [&] { return inner().AllGatherAsync(send, recv, send_count, dtype); });
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::AllToAllVAsync(
    const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
    void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
    DType dtype) {
  return Timed(all_to_all_kind_, [&] {
    return inner().AllToAllVAsync(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                                  dtype);
  });
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::BroadcastAsync(void* buf, size_t count,
                                                                        DType dtype, int root) {
  return Timed(CommKind::kOther, [&] { return inner().BroadcastAsync(buf, count, dtype, root); });
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::BarrierAsync() {
  return Timed(CommKind::kOther, [&] { return inner().BarrierAsync(); });
}

// Point-to-point counts as the group's all-to-all kind (a ring's shift on a CP group is
// kCpRing, as its all-to-all-v was): a shift moves the same bytes either way. A Recv is the
// other half of a peer's Send, so only the Send counts as a call (a ring step is one call
// per rank, as before); the Recv's blocked and busy time count all the same.
absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::SendAsync(const void* buf, size_t count,
                                                                   DType dtype, int peer, int tag) {
  return Timed(all_to_all_kind_, [&] { return inner().SendAsync(buf, count, dtype, peer, tag); });
}

absl::StatusOr<std::unique_ptr<Work>> TimedCommunicator::RecvAsync(void* buf, size_t count,
                                                                   DType dtype, int peer, int tag) {
  return Timed(
      all_to_all_kind_, [&] { return inner().RecvAsync(buf, count, dtype, peer, tag); },
      /*count_call=*/false);
}

absl::StatusOr<std::unique_ptr<Communicator>> TimedCommunicator::Split(int color, int key) {
  return SplitAs(color, key, all_to_all_kind_);
}

absl::StatusOr<std::unique_ptr<Communicator>> TimedCommunicator::SplitAs(int color, int key,
                                                                         CommKind all_to_all_kind) {
  timer_->CountCall(CommKind::kOther);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Communicator>> sub = inner().Split(color, key);
  timer_->Add(absl::Now() - start, CommKind::kOther);
  if (!sub.ok() || *sub == nullptr) return sub;
  auto timed = std::make_unique<TimedCommunicator>(std::move(*sub), timer_);
  timed->all_to_all_kind_ = all_to_all_kind;
  return std::unique_ptr<Communicator>(std::move(timed));
}

template <typename F>
absl::Status TimedCommunicator::TimeSync(CommKind kind, F&& call) {
  timer_->CountCall(kind);
  const absl::Time start = absl::Now();
  absl::Status s = call();
  const absl::Duration took = absl::Now() - start;
  timer_->Add(took, kind);
  timer_->AddBusy(took);
  timer_->Poll();
  return s;
}

// Over a device backend a blocking call is Communicator's default, the async form (timed
// on the stream above) and a Wait.

absl::Status TimedCommunicator::AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                          ReduceOp op) {
  if (stream_ != nullptr) return Communicator::AllReduce(send, recv, count, dtype, op);
  return TimeSync(CommKind::kAllReduce,
                  [&] { return inner().AllReduce(send, recv, count, dtype, op); });
}

absl::Status TimedCommunicator::ReduceScatter(const void* send, void* recv, size_t recv_count,
                                              DType dtype, ReduceOp op) {
  if (stream_ != nullptr) return Communicator::ReduceScatter(send, recv, recv_count, dtype, op);
  return TimeSync(CommKind::kReduceScatter,
                  [&] { return inner().ReduceScatter(send, recv, recv_count, dtype, op); });
}

absl::Status TimedCommunicator::AllGather(const void* send, void* recv, size_t send_count,
                                          DType dtype) {
  if (stream_ != nullptr) return Communicator::AllGather(send, recv, send_count, dtype);
  return TimeSync(CommKind::kAllGather,
                  [&] { return inner().AllGather(send, recv, send_count, dtype); });
}

absl::Status TimedCommunicator::AllToAllV(const void* send, absl::Span<const size_t> send_counts,
                                          absl::Span<const size_t> send_offsets, void* recv,
                                          absl::Span<const size_t> recv_counts,
                                          absl::Span<const size_t> recv_offsets, DType dtype) {
  if (stream_ != nullptr) {
    return Communicator::AllToAllV(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                                   dtype);
  }
  return TimeSync(all_to_all_kind_, [&] {
    return inner().AllToAllV(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                             dtype);
  });
}

absl::Status TimedCommunicator::Broadcast(void* buf, size_t count, DType dtype, int root) {
  if (stream_ != nullptr) return Communicator::Broadcast(buf, count, dtype, root);
  return TimeSync(CommKind::kOther, [&] { return inner().Broadcast(buf, count, dtype, root); });
}

absl::Status TimedCommunicator::Barrier() {
  if (stream_ != nullptr) return Communicator::Barrier();
  return TimeSync(CommKind::kOther, [&] { return inner().Barrier(); });
}

}  // namespace gradsum
