#ifndef GRADSUM_CORE_CUDA_COMPUTE_CONTEXT_H_
#define GRADSUM_CORE_CUDA_COMPUTE_CONTEXT_H_

// What one rank's GPU compute runs on: the device, its compute stream, a cuBLAS handle on
// it, and an event for ordering other streams (NCCL's) after the compute stream. Shared by
// the device unit store (parallel/cuda) and the device ops (model/cuda) of one rank.
//
//   GRADSUM_ASSIGN_OR_RETURN(std::shared_ptr<ComputeContext> ctx, ComputeContext::Create(0));
//   ... launch on ctx->stream.get() ...

#include <cuda_runtime.h>

#include <memory>

#include "absl/status/statusor.h"
#include "core/cuda/device_buffer.h"
#include "core/cuda/gemm.h"

namespace gradsum::cuda {

struct ComputeContext {
  // Makes `device` current and creates the stream, the handle and the event.
  // FailedPrecondition without a usable GPU (the CUDA runtime's reason).
  static absl::StatusOr<std::shared_ptr<ComputeContext>> Create(int device);
  ~ComputeContext();

  int device = 0;
  CudaStream stream;
  CublasHandle blas;
  cudaEvent_t fence = nullptr;  // no timing
};

}  // namespace gradsum::cuda

#endif  // GRADSUM_CORE_CUDA_COMPUTE_CONTEXT_H_
