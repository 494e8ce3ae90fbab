#ifndef GRADSUM_COLLECTIVES_SELF_COMMUNICATOR_H_
#define GRADSUM_COLLECTIVES_SELF_COMMUNICATOR_H_

// SelfCommunicator: the group of one rank, for a mesh axis that is off (collectives/mesh.h:
// `group(axis)` is never null, so callers need no "is this parallelism on" branch beside
// the group they hold). Every collective of one rank is the identity: all-reduce,
// reduce-scatter, all-gather and all-to-all-v copy send to recv (nothing when in place),
// broadcast and barrier do nothing. Arguments are checked by the one rule every backend
// runs (collectives/op_descriptor.h ValidateCall), so a call that is wrong at size 1 fails
// here as it would on a real group.
//
// Host memory only: a device kernel never calls a group of one (it has nothing to
// exchange; the model's code asks `size() > 1` first).
//
//   SelfCommunicator self;
//   GRADSUM_RETURN_IF_ERROR(self.AllReduce(g, g, n, DType::kF32));  // no-op, in place

#include <memory>
#include <string>

#include "collectives/communicator.h"

namespace gradsum {

class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "self"; }
  absl::Duration timeout() const override { return absl::InfiniteDuration(); }

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
  // A group of one again (color >= 0), or null (color < 0).
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override;
};

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_SELF_COMMUNICATOR_H_
