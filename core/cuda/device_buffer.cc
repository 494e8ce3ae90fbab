#include "core/cuda/device_buffer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"

namespace gradsum::cuda {

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Create(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return b;
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.ptr_, bytes), absl::StrCat("cudaMalloc(", bytes, ")"));
  b.bytes_ = bytes;
  return b;
}

absl::Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes) {
  if (bytes > bytes_) {
    return absl::OutOfRangeError(
        absl::StrCat("CopyFromHost of ", bytes, " bytes into a buffer of ", bytes_));
  }
  if (bytes == 0) return absl::OkStatus();
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpy(ptr_, src, bytes, cudaMemcpyHostToDevice),
                               "cudaMemcpy host->device");
  // From pageable memory cudaMemcpy may return once the data is staged, before the DMA
  // lands; kernels on non-blocking streams are not ordered after it. Wait for it.
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy),
                               "cudaMemcpy host->device (sync)");
  return absl::OkStatus();
}

absl::Status DeviceBuffer::CopyToHost(void* dst, size_t bytes) const {
  if (bytes > bytes_) {
    return absl::OutOfRangeError(
        absl::StrCat("CopyToHost of ", bytes, " bytes from a buffer of ", bytes_));
  }
  if (bytes == 0) return absl::OkStatus();
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, ptr_, bytes, cudaMemcpyDeviceToHost),
                               "cudaMemcpy device->host");
  return absl::OkStatus();
}

absl::Status DeviceBuffer::Fill(int byte_value) {
  if (bytes_ == 0) return absl::OkStatus();
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemset(ptr_, byte_value, bytes_), "cudaMemset");
  // Synchronous as documented: cudaMemset may return before it lands, and non-blocking
  // streams are not ordered after the legacy stream it runs on.
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy), "cudaMemset (sync)");
  return absl::OkStatus();
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

CudaStream::CudaStream(CudaStream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}

CudaStream& CudaStream::operator=(CudaStream&& o) noexcept {
  if (this != &o) {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = std::exchange(o.stream_, nullptr);
  }
  return *this;
}

absl::StatusOr<CudaStream> CudaStream::Create() {
  CudaStream s;
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking),
                               "cudaStreamCreate");
  return s;
}

absl::Status CudaStream::Synchronize() const {
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  return absl::OkStatus();
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

CudaEvent::CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& o) noexcept {
  if (this != &o) {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}

absl::StatusOr<CudaEvent> CudaEvent::Create() {
  CudaEvent e;
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e.event_), "cudaEventCreate");
  return e;
}

absl::Status CudaEvent::Record(cudaStream_t stream) {
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, stream), "cudaEventRecord");
  return absl::OkStatus();
}

absl::StatusOr<float> CudaEvent::ElapsedMsSince(const CudaEvent& start) const {
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_), "cudaEventSynchronize");
  float ms = 0;
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.event_, event_),
                               "cudaEventElapsedTime");
  return ms;
}

absl::Status Reserve(DeviceBuffer* b, size_t bytes) {
  bytes = std::max<size_t>(bytes, 256);
  if (b->size() >= bytes) return absl::OkStatus();
  *b = DeviceBuffer();
  absl::StatusOr<DeviceBuffer> fresh = DeviceBuffer::Create(bytes);
  if (!fresh.ok()) return fresh.status();
  *b = *std::move(fresh);
  return absl::OkStatus();
}

absl::Status Fence(cudaStream_t producer, cudaStream_t consumer, cudaEvent_t event) {
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaEventRecord(event, producer), "record stream fence");
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(consumer, event, 0), "wait on stream fence");
  return absl::OkStatus();
}

}  // namespace gradsum::cuda
