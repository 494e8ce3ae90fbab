#include "collectives/checked_communicator.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "collectives/device_stream.h"
#include "collectives/forwarding_communicator.h"
#include "collectives/op_descriptor.h"
#include "core/status.h"

namespace gradsum {
namespace {

using collectives_internal::MakeAllToAllVCall;
using collectives_internal::MakeBroadcastCall;
using collectives_internal::MakeCall;
using collectives_internal::OpCall;
using collectives_internal::OpDescriptor;
using collectives_internal::OpKind;

// Exchanges through `inner` itself, or through a separate host communicator (`exchange`,
// for a device backend). Data always moves through `inner`.
class CheckedCommunicator final : public ForwardingCommunicator {
 public:
  CheckedCommunicator(std::unique_ptr<Communicator> inner,
                      std::unique_ptr<Communicator> exchange = nullptr)
      : ForwardingCommunicator(std::move(inner)),
        own_exchange_(std::move(exchange)),
        exchange_(own_exchange_ != nullptr ? own_exchange_.get() : &this->inner()),
        stream_(this->inner().device_stream()),
        w_(static_cast<size_t>(size())),
        ones_(w_, 1),
        offsets_(w_),
        incoming_(w_),
        outgoing_(w_),
        expected_(w_),
        reports_(3 * w_) {
    for (size_t p = 0; p < w_; ++p) offsets_[p] = p;
  }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    GRADSUM_RETURN_IF_ERROR(AgreeAsync(MakeCall(OpKind::kAllReduce, send, recv, count, dtype, op)));
    return inner().AllReduceAsync(send, recv, count, dtype, op);
  }
  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp op) override {
    GRADSUM_RETURN_IF_ERROR(Agree(MakeCall(OpKind::kAllReduce, send, recv, count, dtype, op)));
    return inner().AllReduce(send, recv, count, dtype, op);
  }

  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    GRADSUM_RETURN_IF_ERROR(
        AgreeAsync(MakeCall(OpKind::kReduceScatter, send, recv, recv_count, dtype, op)));
    return inner().ReduceScatterAsync(send, recv, recv_count, dtype, op);
  }
  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                             ReduceOp op) override {
    GRADSUM_RETURN_IF_ERROR(
        Agree(MakeCall(OpKind::kReduceScatter, send, recv, recv_count, dtype, op)));
    return inner().ReduceScatter(send, recv, recv_count, dtype, op);
  }

  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    GRADSUM_RETURN_IF_ERROR(
        AgreeAsync(MakeCall(OpKind::kAllGather, send, recv, send_count, dtype)));
    return inner().AllGatherAsync(send, recv, send_count, dtype);
  }
  absl::Status AllGather(const void* send, void* recv, size_t send_count, DType dtype) override {
    GRADSUM_RETURN_IF_ERROR(Agree(MakeCall(OpKind::kAllGather, send, recv, send_count, dtype)));
    return inner().AllGather(send, recv, send_count, dtype);
  }

  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override {
    GRADSUM_RETURN_IF_ERROR(AgreeAsync(MakeAllToAllVCall(send, send_counts, send_offsets, recv,
                                                         recv_counts, recv_offsets, dtype)));
    return inner().AllToAllVAsync(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                                  dtype);
  }
  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_counts,
                         absl::Span<const size_t> send_offsets, void* recv,
                         absl::Span<const size_t> recv_counts,
                         absl::Span<const size_t> recv_offsets, DType dtype) override {
    GRADSUM_RETURN_IF_ERROR(Agree(MakeAllToAllVCall(send, send_counts, send_offsets, recv,
                                                    recv_counts, recv_offsets, dtype)));
    return inner().AllToAllV(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                             dtype);
  }

  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    GRADSUM_RETURN_IF_ERROR(AgreeAsync(MakeBroadcastCall(buf, count, dtype, root)));
    return inner().BroadcastAsync(buf, count, dtype, root);
  }
  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root) override {
    GRADSUM_RETURN_IF_ERROR(Agree(MakeBroadcastCall(buf, count, dtype, root)));
    return inner().Broadcast(buf, count, dtype, root);
  }

  // The descriptor exchange already waits for every rank, but the inner barrier also
  // orders it after the inner's pending async operations.
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override {
    GRADSUM_RETURN_IF_ERROR(
        AgreeAsync(MakeCall(OpKind::kBarrier, nullptr, nullptr, 0, DType::kF32)));
    return inner().BarrierAsync();
  }
  absl::Status Barrier() override {
    GRADSUM_RETURN_IF_ERROR(Agree(MakeCall(OpKind::kBarrier, nullptr, nullptr, 0, DType::kF32)));
    return inner().Barrier();
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    GRADSUM_RETURN_IF_ERROR(Agree(MakeCall(OpKind::kSplit, nullptr, nullptr, 0, DType::kF32)));
    if (own_exchange_ == nullptr) {
      GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, inner().Split(color, key));
      if (sub == nullptr) return sub;
      return std::unique_ptr<Communicator>(new CheckedCommunicator(std::move(sub)));
    }
    // Inside a coalesced group the backend refuses to split; nothing to split alongside.
    if (InGroup()) return inner().Split(color, key);
    // The same colors and keys give the same members in the same order on both.
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub_exchange,
                             exchange_->Split(color, key));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, inner().Split(color, key));
    if (sub == nullptr) return sub;
    if (sub_exchange == nullptr) {
      return absl::InternalError(absl::StrCat(Label(OpKind::kSplit, seq_ - 1),
                                              ": the exchange communicator's split has no group "
                                              "for color ",
                                              color));
    }
    return std::unique_ptr<Communicator>(
        new CheckedCommunicator(std::move(sub), std::move(sub_exchange)));
  }

 private:
  std::string Label(OpKind kind, int64_t seq) const {
    return absl::StrFormat("%s %s #%d (rank %d of %d)", inner().backend(),
                           collectives_internal::OpKindName(kind), seq, rank(), size());
  }

  // A device backend's coalesced group is open: its operations are one fused launch.
  bool InGroup() const { return stream_ != nullptr && stream_->coalescing(); }

  // The local checks: the validation every backend shares, with the inner backend's limit
  // (a count or offset it would reject must fail here, on every rank, not in the inner
  // backend on this rank alone while its peers wait), and a device backend's buffer rule.
  absl::Status CheckLocal(const OpCall& c) const {
    GRADSUM_RETURN_IF_ERROR(
        collectives_internal::ValidateCall(c, rank(), size(), inner().max_count()));
    if (stream_ == nullptr) return absl::OkStatus();
    return collectives_internal::CheckEachBuffer(
        c, size(), [this](const void* p) { return stream_->CheckBuffer(p); });
  }

  // Local validation, then the descriptor exchange; OK when every rank agrees. Whether the
  // call is sync or async is part of the descriptor: a backend may run the two forms in
  // ways that never match (the mpi backend: blocking versus non-blocking MPI). Inside a
  // coalesced group: nothing (the backend still validates its own arguments).
  absl::Status Agree(const OpCall& c, bool async = false) {
    const int64_t seq = seq_++;
    if (InGroup()) return absl::OkStatus();
    const absl::Status local = CheckLocal(c);
    OpDescriptor d = collectives_internal::Describe(c);
    d.async = async;
    if (!local.ok()) d.invalid_rank = rank();
    int64_t buf[collectives_internal::kDescriptorWords];
    collectives_internal::EncodeDescriptor(d, buf);
    GRADSUM_RETURN_IF_ERROR(exchange_->AllReduce(buf, buf, collectives_internal::kDescriptorWords,
                                                 DType::kI64, ReduceOp::kMax));
    if (!collectives_internal::DescriptorAgreed(buf)) {
      const int64_t bad = collectives_internal::HighestInvalidRank(buf);
      std::string message;
      if (bad >= 0 && exchange_->max_count() > 0) {
        // Every rank knows `bad` from the same reduced descriptor, so every rank joins this
        // broadcast of its error message (failures only; no cost on the agreed path).
        int32_t text[kMessageWords] = {};  // NUL-terminated, cut at the end if longer
        const size_t words = std::min(kMessageWords, exchange_->max_count());
        if (bad == rank()) {
          const absl::string_view m = local.message();
          std::memcpy(text, m.data(), std::min(m.size(), words * sizeof(int32_t) - 1));
        }
        GRADSUM_RETURN_IF_ERROR(
            exchange_->Broadcast(text, words, DType::kI32, static_cast<int>(bad)));
        message = reinterpret_cast<const char*>(text);
      }
      // A locally invalid call reports its own error, not the peers' view of it.
      if (!local.ok()) return local;
      return collectives_internal::CheckDescriptorAgreed(d, buf, Label(c.kind, seq), message);
    }
    if (c.kind == OpKind::kAllToAllV) return AgreeOnCounts(c, seq);
    return absl::OkStatus();
  }

  absl::Status AgreeAsync(const OpCall& c) { return Agree(c, /*async=*/true); }

  // Rank r's send_counts[p] must equal rank p's recv_counts[r]: each rank learns what its
  // peers will send it, then all ranks all-gather the first mismatch each one saw. Uses the
  // scratch below (sized once: no allocation per call).
  absl::Status AgreeOnCounts(const OpCall& c, int64_t seq) {
    for (size_t p = 0; p < w_; ++p) {
      outgoing_[p] = static_cast<int64_t>(c.send_counts[p]);
      expected_[p] = static_cast<int64_t>(c.recv_counts[p]);
    }
    GRADSUM_RETURN_IF_ERROR(exchange_->AllToAllV(outgoing_.data(), ones_, offsets_,
                                                 incoming_.data(), ones_, offsets_, DType::kI64));
    int64_t report[3];
    collectives_internal::MakeCountReport(incoming_, expected_, report);
    GRADSUM_RETURN_IF_ERROR(exchange_->AllGather(report, reports_.data(), 3, DType::kI64));
    for (size_t p = 0; p < w_; ++p) {
      if (reports_[3 * p] >= 0) {
        return collectives_internal::CheckCountReports(reports_, Label(c.kind, seq));
      }
    }
    return absl::OkStatus();
  }

  // The invalid rank's error message, shared on failure: at most 511 bytes of it (fewer if
  // the exchange's max_count is below 128 words).
  static constexpr size_t kMessageWords = 128;

  std::unique_ptr<Communicator> own_exchange_;  // null: the exchange is inner()
  Communicator* const exchange_;
  DeviceStream* const stream_;  // inner()'s, or null for a host backend
  const size_t w_;              // size()
  // AgreeOnCounts: one element to and from each peer (constant), and per-call scratch.
  std::vector<size_t> ones_, offsets_;
  std::vector<int64_t> incoming_, outgoing_, expected_, reports_;
  int64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> WithAgreementCheck(std::unique_ptr<Communicator> inner) {
  return std::make_unique<CheckedCommunicator>(std::move(inner));
}

absl::StatusOr<std::unique_ptr<Communicator>> WithAgreementCheckOver(
    std::unique_ptr<Communicator> inner, std::unique_ptr<Communicator> exchange) {
  if (inner == nullptr || exchange == nullptr) {
    return absl::InvalidArgumentError("WithAgreementCheckOver: null communicator");
  }
  if (inner->rank() != exchange->rank() || inner->size() != exchange->size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "WithAgreementCheckOver: the %s communicator is rank %d of %d but the %s exchange is "
        "rank %d of %d",
        inner->backend(), inner->rank(), inner->size(), exchange->backend(), exchange->rank(),
        exchange->size()));
  }
  return std::unique_ptr<Communicator>(
      std::make_unique<CheckedCommunicator>(std::move(inner), std::move(exchange)));
}

}  // namespace gradsum
