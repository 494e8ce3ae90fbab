#ifndef GRADSUM_COLLECTIVES_FORWARDING_COMMUNICATOR_H_
#define GRADSUM_COLLECTIVES_FORWARDING_COMMUNICATOR_H_

// ForwardingCommunicator: the base of every Communicator decorator (the agreement check,
// checked_communicator.h; the timer, timed_communicator.h; the tests' recorders, limiters
// and slow links). It forwards every method of Communicator to an inner communicator
// (borrowed or owned): the identity queries, max_count(), device_stream(), every
// asynchronous and blocking operation and Split. A decorator overrides only what it
// observes or changes, and reaches the inner communicator through inner().
//
//   class CountingCommunicator : public ForwardingCommunicator {
//    public:
//     using ForwardingCommunicator::ForwardingCommunicator;
//     absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
//       ++barriers;
//       return inner().BarrierAsync();
//     }
//     int barriers = 0;
//   };
//   CountingCommunicator counting(&comm, ForwardingCommunicator::SyncCalls::kThroughAsync);
//
// Blocking calls go to the inner communicator's blocking forms (SyncCalls::kForward, the
// default), which keeps the backend's sync fast path (the thread and mpi backends run them
// on the caller's thread, without allocating). A decorator that overrides only the async
// primitives and must see blocking calls too constructs with SyncCalls::kThroughAsync: a
// blocking call is then this object's *Async and a Wait (Communicator's defaults).
//
// Split returns the inner sub-communicator as it is; a decorator that must wrap it
// (so that a Mesh built over it is decorated throughout) overrides Split.

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/dtype.h"

namespace gradsum {

class ForwardingCommunicator : public Communicator {
 public:
  // How blocking calls reach the inner communicator (see above).
  enum class SyncCalls { kForward, kThroughAsync };

  // Does not own `inner`, which must not be null and must outlive this object.
  explicit ForwardingCommunicator(Communicator* inner, SyncCalls sync = SyncCalls::kForward)
      : inner_(inner), sync_(sync) {}
  // Owns `owned`, which must not be null.
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> owned,
                                  SyncCalls sync = SyncCalls::kForward)
      : owned_(std::move(owned)), inner_(owned_.get()), sync_(sync) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  absl::Duration timeout() const override { return inner_->timeout(); }
  size_t max_count() const override { return inner_->max_count(); }
  DeviceStream* device_stream() override { return inner_->device_stream(); }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    return inner_->AllReduceAsync(send, recv, count, dtype, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    return inner_->ReduceScatterAsync(send, recv, recv_count, dtype, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    return inner_->AllGatherAsync(send, recv, send_count, dtype);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override {
    return inner_->AllToAllVAsync(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                                  dtype);
  }
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    return inner_->BroadcastAsync(buf, count, dtype, root);
  }
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override { return inner_->BarrierAsync(); }
  absl::StatusOr<std::unique_ptr<Work>> SendAsync(const void* buf, size_t count, DType dtype,
                                                  int peer, int tag = 0) override {
    return inner_->SendAsync(buf, count, dtype, peer, tag);
  }
  absl::StatusOr<std::unique_ptr<Work>> RecvAsync(void* buf, size_t count, DType dtype, int peer,
                                                  int tag = 0) override {
    return inner_->RecvAsync(buf, count, dtype, peer, tag);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    return inner_->Split(color, key);
  }

  // (Defaults repeated: a default argument belongs to the declaration it is called through.)
  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp op = ReduceOp::kSum) override {
    if (sync_ == SyncCalls::kThroughAsync) {
      return Communicator::AllReduce(send, recv, count, dtype, op);
    }
    return inner_->AllReduce(send, recv, count, dtype, op);
  }
  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                             ReduceOp op = ReduceOp::kSum) override {
    if (sync_ == SyncCalls::kThroughAsync) {
      return Communicator::ReduceScatter(send, recv, recv_count, dtype, op);
    }
    return inner_->ReduceScatter(send, recv, recv_count, dtype, op);
  }
  absl::Status AllGather(const void* send, void* recv, size_t send_count, DType dtype) override {
    if (sync_ == SyncCalls::kThroughAsync) {
      return Communicator::AllGather(send, recv, send_count, dtype);
    }
    return inner_->AllGather(send, recv, send_count, dtype);
  }
  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_counts,
                         absl::Span<const size_t> send_offsets, void* recv,
                         absl::Span<const size_t> recv_counts,
                         absl::Span<const size_t> recv_offsets, DType dtype) override {
    if (sync_ == SyncCalls::kThroughAsync) {
      return Communicator::AllToAllV(send, send_counts, send_offsets, recv, recv_counts,
                                     recv_offsets, dtype);
    }
    return inner_->AllToAllV(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                             dtype);
  }
  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root) override {
    if (sync_ == SyncCalls::kThroughAsync) return Communicator::Broadcast(buf, count, dtype, root);
    return inner_->Broadcast(buf, count, dtype, root);
  }
  absl::Status Barrier() override {
    if (sync_ == SyncCalls::kThroughAsync) return Communicator::Barrier();
    return inner_->Barrier();
  }

  // The options forms (Communicator's), which the positional overrides above would hide.
  using Communicator::AllGather;
  using Communicator::AllGatherAsync;
  using Communicator::AllReduce;
  using Communicator::AllReduceAsync;
  using Communicator::AllToAllV;
  using Communicator::AllToAllVAsync;
  using Communicator::Barrier;
  using Communicator::BarrierAsync;
  using Communicator::Broadcast;
  using Communicator::BroadcastAsync;
  using Communicator::ReduceScatter;
  using Communicator::ReduceScatterAsync;

 protected:
  Communicator& inner() const { return *inner_; }

 private:
  std::unique_ptr<Communicator> owned_;
  Communicator* const inner_;
  const SyncCalls sync_;
};

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_FORWARDING_COMMUNICATOR_H_
