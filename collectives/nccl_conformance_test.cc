// The backend-independent conformance suite (//collectives:conformance) against the nccl
// backend, at world size 1 on one GPU (NCCL allows one rank per device, and the test
// machines have one). The suite works on host buffers, so an adapter stages every call
// through device copies: host -> device, the nccl operation, device -> host. Small-integer
// inputs (rank_ordered_sums = false): NCCL's summation order and bf16 accumulation are its
// own. Without a usable GPU the test skips with the CUDA runtime's reason.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collectives/communicator.h"
#include "collectives/conformance.h"
#include "collectives/nccl_backend.h"
#include "collectives/thread_backend.h"
#include "core/dtype.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "testing/gpu_test_util.h"

namespace gradsum {
namespace {

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

// Device memory for one staged call; a null host pointer stays null (the backend's own
// null checks then apply).
class Staged {
 public:
  Staged() = default;
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  ~Staged() {
    if (dev_ != nullptr) cudaFree(dev_);
  }
  absl::Status Init(const void* host, size_t bytes) {
    host_ = host;
    bytes_ = bytes;
    if (host == nullptr) return absl::OkStatus();
    GRADSUM_RETURN_IF_ERROR(Cuda(cudaMalloc(&dev_, std::max<size_t>(bytes, 1)), "cudaMalloc"));
    if (bytes > 0) {
      GRADSUM_RETURN_IF_ERROR(
          Cuda(cudaMemcpy(dev_, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D"));
    }
    return absl::OkStatus();
  }
  absl::Status CopyBack(void* host) const {
    if (host == nullptr || bytes_ == 0) return absl::OkStatus();
    return Cuda(cudaMemcpy(host, dev_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }
  void* dev() const { return dev_; }
  // The device address of host + off (host must lie inside this staging's host range).
  void* Map(const void* host) const {
    if (host == nullptr || dev_ == nullptr) return nullptr;
    return static_cast<char*>(dev_) +
           (static_cast<const char*>(host) - static_cast<const char*>(host_));
  }

 private:
  const void* host_ = nullptr;
  size_t bytes_ = 0;
  void* dev_ = nullptr;
};

class DoneWork final : public Work {
 public:
  explicit DoneWork(absl::Status s) : s_(std::move(s)) {}
  absl::Status Wait(absl::Duration) override { return s_; }
  bool IsCompleted() override { return true; }

 private:
  absl::Status s_;
};

// Host-buffer Communicator over an nccl one: each call runs synchronously through device
// copies and returns a completed Work. In-place layouts are preserved: a recv that
// aliases the send maps into the same device allocation.
class HostStagingCommunicator final : public Communicator {
 public:
  explicit HostStagingCommunicator(std::unique_ptr<Communicator> nccl) : nccl_(std::move(nccl)) {}

  int rank() const override { return nccl_->rank(); }
  int size() const override { return nccl_->size(); }
  std::string backend() const override { return nccl_->backend(); }
  absl::Duration timeout() const override { return nccl_->timeout(); }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    const size_t bytes = IsValidDType(static_cast<int>(dtype)) ? count * DTypeSize(dtype) : 0;
    return Done(TwoBuffers(send, bytes, recv, bytes, [&](const void* s, void* r) {
      return nccl_->AllReduce(s, r, count, dtype, op);
    }));
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) override {
    const size_t el = IsValidDType(static_cast<int>(dtype)) ? DTypeSize(dtype) : 0;
    return Done(TwoBuffers(
        send, recv_count * size() * el, recv, recv_count * el,
        [&](const void* s, void* r) { return nccl_->ReduceScatter(s, r, recv_count, dtype, op); }));
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const void* send, void* recv,
                                                       size_t send_count, DType dtype) override {
    const size_t el = IsValidDType(static_cast<int>(dtype)) ? DTypeSize(dtype) : 0;
    return Done(TwoBuffers(
        send, send_count * el, recv, send_count * size() * el,
        [&](const void* s, void* r) { return nccl_->AllGather(s, r, send_count, dtype); }));
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(
      const void* send, absl::Span<const size_t> send_counts, absl::Span<const size_t> send_offsets,
      void* recv, absl::Span<const size_t> recv_counts, absl::Span<const size_t> recv_offsets,
      DType dtype) override {
    const size_t el = IsValidDType(static_cast<int>(dtype)) ? DTypeSize(dtype) : 0;
    size_t send_end = 0, recv_end = 0;
    for (size_t p = 0; p < send_counts.size() && p < send_offsets.size(); ++p) {
      send_end = std::max(send_end, send_offsets[p] + send_counts[p]);
    }
    for (size_t p = 0; p < recv_counts.size() && p < recv_offsets.size(); ++p) {
      recv_end = std::max(recv_end, recv_offsets[p] + recv_counts[p]);
    }
    Staged s, r;
    absl::Status st = s.Init(send, send_end * el);
    if (st.ok()) st = r.Init(recv, recv_end * el);
    if (st.ok()) {
      st = nccl_->AllToAllV(s.dev(), send_counts, send_offsets, r.dev(), recv_counts, recv_offsets,
                            dtype);
    }
    if (st.ok()) st = r.CopyBack(recv);
    return Done(st);
  }
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(void* buf, size_t count, DType dtype,
                                                       int root) override {
    const size_t el = IsValidDType(static_cast<int>(dtype)) ? DTypeSize(dtype) : 0;
    Staged b;
    absl::Status st = b.Init(buf, count * el);
    if (st.ok()) st = nccl_->Broadcast(b.dev(), count, dtype, root);
    if (st.ok()) st = b.CopyBack(buf);
    return Done(st);
  }
  absl::StatusOr<std::unique_ptr<Work>> BarrierAsync() override { return Done(nccl_->Barrier()); }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, nccl_->Split(color, key));
    if (sub == nullptr) return sub;
    return std::unique_ptr<Communicator>(new HostStagingCommunicator(std::move(sub)));
  }

 private:
  static absl::StatusOr<std::unique_ptr<Work>> Done(absl::Status s) {
    if (!s.ok()) return s;
    return std::unique_ptr<Work>(new DoneWork(absl::OkStatus()));
  }

  // Stages the larger host range once when one buffer lies inside the other (in place),
  // else each separately; runs `op` on the device addresses and copies recv back.
  template <typename Op>
  absl::Status TwoBuffers(const void* send, size_t send_bytes, void* recv, size_t recv_bytes,
                          Op&& op) {
    const char* s = static_cast<const char*>(send);
    const char* r = static_cast<const char*>(recv);
    const bool recv_in_send = send != nullptr && recv != nullptr && r >= s &&
                              r + recv_bytes <= s + send_bytes && send_bytes >= recv_bytes;
    const bool send_in_recv = send != nullptr && recv != nullptr && s >= r &&
                              s + send_bytes <= r + recv_bytes && recv_bytes > send_bytes;
    if (recv_in_send || send_in_recv) {
      Staged whole;
      void* base = recv_in_send ? const_cast<void*>(send) : recv;
      GRADSUM_RETURN_IF_ERROR(whole.Init(base, recv_in_send ? send_bytes : recv_bytes));
      GRADSUM_RETURN_IF_ERROR(op(whole.Map(send), whole.Map(recv)));
      return whole.CopyBack(base);
    }
    Staged sd, rd;
    GRADSUM_RETURN_IF_ERROR(sd.Init(send, send_bytes));
    GRADSUM_RETURN_IF_ERROR(rd.Init(recv, recv_bytes));
    GRADSUM_RETURN_IF_ERROR(op(sd.dev(), rd.dev()));
    return rd.CopyBack(recv);
  }

  std::unique_ptr<Communicator> nccl_;
};

TEST(NcclConformanceTest, WholeSuiteAtWorldOne) {
  GRADSUM_SKIP_WITHOUT_GPU();
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> threads = CreateThreadCommunicators(1);
  ASSERT_TRUE(threads.ok()) << threads.status();
  absl::StatusOr<std::unique_ptr<Communicator>> nccl =
      CreateNcclCommunicator(*(*threads)[0], {.device = 0, .timeout = absl::Seconds(30)});
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  HostStagingCommunicator comm(std::move(*nccl));
  conformance::CheckOptions options;
  options.rank_ordered_sums = false;
  const absl::Status s = conformance::CheckAll(comm, options);
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum
