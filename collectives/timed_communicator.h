#ifndef GRADSUM_TRAIN_TIMED_COMMUNICATOR_H_
#define GRADSUM_TRAIN_TIMED_COMMUNICATOR_H_

// A Communicator decorator that adds up the wall time this rank spends inside
// collectives (issuing them and waiting on them), for the per-step "comm" column of the
// training log and the step benchmark. Sub-communicators made by Split() share the
// timer, so the EP and EDP groups count too.
//
//   auto timer = std::make_shared<CommTimer>();
//   TimedCommunicator world(std::move(inner_world), timer);
//   ... train ...
//   absl::Duration in_collectives = timer->Take();   // and reset
//
// The time includes waiting for slower ranks inside a collective: on shared memory,
// moving the bytes and waiting for the peers cannot be told apart from one side.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "collectives/communicator.h"

namespace gradsum::train {

class CommTimer {
 public:
  void Add(absl::Duration d) { nanos_.fetch_add(absl::ToInt64Nanoseconds(d)); }
  absl::Duration Total() const { return absl::Nanoseconds(nanos_.load()); }
  // Returns the total so far and resets it to zero.
  absl::Duration Take() { return absl::Nanoseconds(nanos_.exchange(0)); }

 private:
  std::atomic<int64_t> nanos_{0};
};

class TimedCommunicator : public Communicator {
 public:
  // Owns `inner`. `timer` must not be null.
  TimedCommunicator(std::unique_ptr<Communicator> inner, std::shared_ptr<CommTimer> timer);
  // Does not own `inner`, which must outlive this object.
  TimedCommunicator(Communicator* inner, std::shared_ptr<CommTimer> timer);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  absl::Duration timeout() const override { return inner_->timeout(); }
  const std::shared_ptr<CommTimer>& timer() const { return timer_; }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override;
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override;
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override;
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override;
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override;
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override;
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override;

 private:
  absl::StatusOr<std::unique_ptr<Work>> Wrap(absl::Time start,
                                             absl::StatusOr<std::unique_ptr<Work>> work);

  std::unique_ptr<Communicator> owned_;
  Communicator* inner_;
  std::shared_ptr<CommTimer> timer_;
};

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_TIMED_COMMUNICATOR_H_
