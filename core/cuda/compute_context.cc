#include "core/cuda/compute_context.h"

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"

namespace gradsum::cuda {

absl::StatusOr<std::shared_ptr<ComputeContext>> ComputeContext::Create(int device) {
  auto ctx = std::make_shared<ComputeContext>();
  ctx->device = device;
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  GRADSUM_ASSIGN_OR_RETURN(ctx->stream, CudaStream::Create());
  GRADSUM_ASSIGN_OR_RETURN(ctx->blas, CublasHandle::Create());
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ctx->fence, cudaEventDisableTiming),
                               "create fence event");
  return ctx;
}

ComputeContext::~ComputeContext() {
  if (fence != nullptr) cudaEventDestroy(fence);
}

}  // namespace gradsum::cuda
