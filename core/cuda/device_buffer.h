#ifndef GRADSUM_CORE_CUDA_DEVICE_BUFFER_H_
#define GRADSUM_CORE_CUDA_DEVICE_BUFFER_H_

// Owning handles for device memory and CUDA streams/events (RAII, move-only), with
// checked creation that returns absl::Status instead of crashing where no GPU exists.
//
//   GRADSUM_ASSIGN_OR_RETURN(DeviceBuffer logits, DeviceBuffer::Create(n * v * 2));
//   GRADSUM_RETURN_IF_ERROR(logits.CopyFromHost(host.data(), host.size() * 2));
//   GRADSUM_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
//   ... launch on stream.get() ...
//   GRADSUM_RETURN_IF_ERROR(stream.Synchronize());
//
// Destructors free without synchronising the device beyond what cudaFree itself does.

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gradsum::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // cudaMalloc of `bytes` (0 gives an empty buffer with a null pointer).
  // FailedPrecondition without a usable device, ResourceExhausted when out of memory.
  static absl::StatusOr<DeviceBuffer> Create(size_t bytes);

  // A buffer holding a copy of host[0..n).
  template <typename T>
  static absl::StatusOr<DeviceBuffer> FromHost(const std::vector<T>& host) {
    absl::StatusOr<DeviceBuffer> b = Create(host.size() * sizeof(T));
    if (!b.ok()) return b.status();
    absl::Status s = b->CopyFromHost(host.data(), host.size() * sizeof(T));
    if (!s.ok()) return s;
    return b;
  }

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t size() const { return bytes_; }

  // Synchronous copies (complete on return, also for kernels on non-blocking streams);
  // OutOfRange when `bytes` exceeds size().
  absl::Status CopyFromHost(const void* src, size_t bytes);
  absl::Status CopyToHost(void* dst, size_t bytes) const;
  // Copies the whole buffer into a host vector of size() / sizeof(T) elements.
  template <typename T>
  absl::StatusOr<std::vector<T>> ToHost() const {
    std::vector<T> out(bytes_ / sizeof(T));
    absl::Status s = CopyToHost(out.data(), out.size() * sizeof(T));
    if (!s.ok()) return s;
    return out;
  }
  // cudaMemset of the whole buffer (synchronous).
  absl::Status Fill(int byte_value);

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream();
  CudaStream(CudaStream&& o) noexcept;
  CudaStream& operator=(CudaStream&& o) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  // A non-blocking stream on the current device.
  static absl::StatusOr<CudaStream> Create();

  cudaStream_t get() const { return stream_; }
  // Waits for all work on the stream; reports any asynchronous kernel error.
  absl::Status Synchronize() const;

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  CudaEvent() = default;
  ~CudaEvent();
  CudaEvent(CudaEvent&& o) noexcept;
  CudaEvent& operator=(CudaEvent&& o) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  // A timing-capable event.
  static absl::StatusOr<CudaEvent> Create();

  cudaEvent_t get() const { return event_; }
  absl::Status Record(cudaStream_t stream);
  // Milliseconds between `start` and this event (both recorded; waits for this one).
  absl::StatusOr<float> ElapsedMsSince(const CudaEvent& start) const;

 private:
  cudaEvent_t event_ = nullptr;
};

// Grows `b` to at least `bytes` (contents are not kept). Never leaves a null buffer, so
// zero-count collectives still get valid device pointers.
absl::Status Reserve(DeviceBuffer* b, size_t bytes);

// `consumer` waits (on the device) for everything enqueued on `producer` so far, through
// `event` (recorded on producer).
absl::Status Fence(cudaStream_t producer, cudaStream_t consumer, cudaEvent_t event);

}  // namespace gradsum::cuda

#endif  // GRADSUM_CORE_CUDA_DEVICE_BUFFER_H_
