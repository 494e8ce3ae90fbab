#ifndef GRADSUM_CORE_CUDA_DEVICE_FLAG_H_
#define GRADSUM_CORE_CUDA_DEVICE_FLAG_H_

// A device word in which kernels record the lowest index (token, row, copy) where they
// found bad input, so that input checks cost no host sync until the caller asks:
//
//   GRADSUM_ASSIGN_OR_RETURN(DeviceIndexFlag flag, DeviceIndexFlag::Create());
//   ... kernels do atomicMin(flag.device_word(), index) on bad input ...
//   GRADSUM_ASSIGN_OR_RETURN(std::optional<int64_t> bad, flag.ReadAndReset(stream));
//   if (bad) return absl::InvalidArgumentError(absl::StrCat("token ", *bad, " ..."));

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"

namespace gradsum::cuda {

// The word's value when nothing was recorded.
constexpr unsigned long long kNoIndex = ~0ull;

class DeviceIndexFlag {
 public:
  DeviceIndexFlag() = default;
  ~DeviceIndexFlag();
  DeviceIndexFlag(DeviceIndexFlag&& o) noexcept;
  DeviceIndexFlag& operator=(DeviceIndexFlag&& o) noexcept;
  DeviceIndexFlag(const DeviceIndexFlag&) = delete;
  DeviceIndexFlag& operator=(const DeviceIndexFlag&) = delete;

  // A cleared flag. FailedPrecondition without a usable device.
  static absl::StatusOr<DeviceIndexFlag> Create();

  unsigned long long* device_word() const { return word_; }

  // Waits for `stream`; returns the recorded index (and clears the word, stream-ordered)
  // or nullopt when nothing was recorded.
  absl::StatusOr<std::optional<int64_t>> ReadAndReset(cudaStream_t stream);

 private:
  unsigned long long* word_ = nullptr;
};

}  // namespace gradsum::cuda

#endif  // GRADSUM_CORE_CUDA_DEVICE_FLAG_H_
