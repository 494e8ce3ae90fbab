#include "core/cuda/device_flag.h"

#include <utility>

#include "core/cuda/cuda_status.h"
#include "core/status.h"

namespace gradsum::cuda {

DeviceIndexFlag::~DeviceIndexFlag() {
  if (word_ != nullptr) cudaFree(word_);
}

DeviceIndexFlag::DeviceIndexFlag(DeviceIndexFlag&& o) noexcept
    : word_(std::exchange(o.word_, nullptr)) {}

DeviceIndexFlag& DeviceIndexFlag::operator=(DeviceIndexFlag&& o) noexcept {
  if (this != &o) {
    if (word_ != nullptr) cudaFree(word_);
    word_ = std::exchange(o.word_, nullptr);
  }
  return *this;
}

absl::StatusOr<DeviceIndexFlag> DeviceIndexFlag::Create() {
  GRADSUM_RETURN_IF_ERROR(RequireCudaDevice());
  DeviceIndexFlag f;
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMalloc(&f.word_, sizeof(*f.word_)), "cudaMalloc(flag)");
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemset(f.word_, 0xff, sizeof(*f.word_)), "clear flag");
  // cudaMemset may return before it lands, and the legacy stream it runs on does not order
  // the non-blocking streams the kernels use: wait, so the cleared word is what they see.
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy), "clear flag (sync)");
  return f;
}

absl::StatusOr<std::optional<int64_t>> DeviceIndexFlag::ReadAndReset(cudaStream_t stream) {
  if (word_ == nullptr) return absl::FailedPreconditionError("DeviceIndexFlag is empty");
  unsigned long long v = kNoIndex;
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&v, word_, sizeof(v), cudaMemcpyDeviceToHost, stream), "read flag");
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "kernels before flag read");
  if (v == kNoIndex) return std::optional<int64_t>();
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(word_, 0xff, sizeof(*word_), stream), "clear flag");
  return std::optional<int64_t>(static_cast<int64_t>(v));
}

}  // namespace gradsum::cuda
