#ifndef GRADSUM_TESTING_FORWARDING_COMMUNICATOR_H_
#define GRADSUM_TESTING_FORWARDING_COMMUNICATOR_H_

// The base of the tests' communicator decorators (recorders, limiters, slow links): it
// forwards the identity queries, every asynchronous operation and Split to an inner
// communicator (borrowed or owned), so a decorator overrides only what it observes or
// changes.
//
//   class CountingCommunicator : public gradsum::testing::ForwardingCommunicator {
//    public:
//     using ForwardingCommunicator::ForwardingCommunicator;
//     absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
//       ++barriers;
//       return inner().BarrierAsync();
//     }
//     int barriers = 0;
//   };
//
// The blocking calls keep Communicator's defaults (this object's *Async, then Wait), so an
// overridden *Async operation sees the blocking form too. Split returns the inner
// sub-communicator as it is; a decorator that must wrap it overrides Split.

#include <memory>
#include <string>
#include <utility>

#include "collectives/communicator.h"

namespace gradsum::testing {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(Communicator* inner) : inner_(inner) {}
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> owned)
      : owned_(std::move(owned)), inner_(owned_.get()) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  absl::Duration timeout() const override { return inner_->timeout(); }
  size_t max_count() const override { return inner_->max_count(); }

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
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    return inner_->Split(color, key);
  }

 protected:
  Communicator& inner() const { return *inner_; }

 private:
  std::unique_ptr<Communicator> owned_;
  Communicator* inner_;
};

}  // namespace gradsum::testing

#endif  // GRADSUM_TESTING_FORWARDING_COMMUNICATOR_H_
