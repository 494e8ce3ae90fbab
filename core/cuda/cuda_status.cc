#include "core/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace gradsum::cuda {

absl::Status CudaErrorToStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string msg =
      absl::StrCat(what, ": ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ")");
  switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStartupFailure:
    case cudaErrorNotSupported:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return absl::FailedPreconditionError(msg);
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidPitchValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidMemcpyDirection:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status CublasStatusToStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", cublasGetStatusString(status), " (",
                                       cublasGetStatusName(status), ")");
  switch (status) {
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::FailedPreconditionError(msg);
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(msg);
    case CUBLAS_STATUS_INVALID_VALUE:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status RequireCudaDevice() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // Clear the sticky "last error" so later, unrelated checks do not see it.
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device: ", cudaGetErrorString(err)));
  }
  if (count == 0) return absl::FailedPreconditionError("no usable CUDA device: device count is 0");
  return absl::OkStatus();
}

absl::Status CheckDevicePointer(const void* ptr, absl::string_view name) {
  if (ptr == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  cudaPointerAttributes attr;
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaErrorToStatus(err, absl::StrCat("cudaPointerGetAttributes(", name, ")"));
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " is not device memory (cudaPointerGetAttributes type ", static_cast<int>(attr.type),
        ": ", attr.type == cudaMemoryTypeHost ? "pinned host" : "unregistered host", ")"));
  }
  int current = 0;
  if (attr.type == cudaMemoryTypeDevice && cudaGetDevice(&current) == cudaSuccess &&
      attr.device != current) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is memory of device ", attr.device,
                                                   " but the current device is ", current));
  }
  return absl::OkStatus();
}

absl::Status CheckOptionalDevicePointer(const void* ptr, absl::string_view name) {
  if (ptr == nullptr) return absl::OkStatus();
  return CheckDevicePointer(ptr, name);
}

absl::StatusOr<int> CurrentDeviceSmCount() {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaErrorToStatus(err, "SM count of the current device");
  }
  return sms;
}

}  // namespace gradsum::cuda
