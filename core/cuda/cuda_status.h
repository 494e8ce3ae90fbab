#ifndef GRADSUM_CORE_CUDA_CUDA_STATUS_H_
#define GRADSUM_CORE_CUDA_CUDA_STATUS_H_

// CUDA / cuBLAS errors as absl::Status, and the argument checks every GPU host wrapper
// shares (a usable device exists, a pointer is device memory).
//
//   GRADSUM_RETURN_IF_ERROR(RequireCudaDevice());
//   GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(logits, "logits"));
//   GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p, 0, n, stream), "zero grad");
//
// Code mapping (the message always carries the CUDA reason and `what`):
// - no device / driver too old for the runtime / CUDA unavailable -> FailedPrecondition;
// - out of memory                                                -> ResourceExhausted;
// - invalid value / pointer / device function                    -> InvalidArgument;
// - everything else (launch failures, illegal addresses, ...)    -> Internal.
// A wrapper never crashes on a machine without a GPU: it returns FailedPrecondition.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsum::cuda {

// OK for cudaSuccess; otherwise a Status as above, message "<what>: <cuda reason> (<name>)".
absl::Status CudaErrorToStatus(cudaError_t err, absl::string_view what);

// The same for cuBLAS status codes (NOT_INITIALIZED -> FailedPrecondition,
// ALLOC_FAILED -> ResourceExhausted, INVALID_VALUE -> InvalidArgument, else Internal).
absl::Status CublasStatusToStatus(cublasStatus_t status, absl::string_view what);

// OK when at least one CUDA device is usable; otherwise FailedPrecondition with the
// runtime's reason (e.g. "CUDA driver version is insufficient for CUDA runtime version").
absl::Status RequireCudaDevice();

// OK when `ptr` is device memory of the current device (or managed memory).
// InvalidArgument naming `name` for null, host (pageable or pinned) or unregistered memory,
// or memory of another device (kernels run on the current device: cudaSetDevice first).
absl::Status CheckDevicePointer(const void* ptr, absl::string_view name);

// Like CheckDevicePointer, but a null pointer is accepted (optional buffers).
absl::Status CheckOptionalDevicePointer(const void* ptr, absl::string_view name);

// Number of streaming multiprocessors of the current device (for grid sizing).
absl::StatusOr<int> CurrentDeviceSmCount();

}  // namespace gradsum::cuda

// Evaluates a cudaError_t expression; returns its Status from the enclosing function on error.
#define GRADSUM_CUDA_RETURN_IF_ERROR(expr, what)                            \
  do {                                                                      \
    const cudaError_t gradsum_cuda_err_ = (expr);                           \
    if (gradsum_cuda_err_ != cudaSuccess) {                                 \
      return ::gradsum::cuda::CudaErrorToStatus(gradsum_cuda_err_, (what)); \
    }                                                                       \
  } while (0)

#endif  // GRADSUM_CORE_CUDA_CUDA_STATUS_H_
