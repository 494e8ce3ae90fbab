#include "model/cuda/model_kernels.h"

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"

namespace gradsum::model {
namespace cuda_internal {
cudaError_t LaunchEmbeddingForward(const float* emb, const int32_t* tokens, int64_t rows,
                                   int64_t dim, float* h, cudaStream_t stream);
cudaError_t LaunchEmbeddingBackward(const int32_t* tokens, const float* dh, int64_t rows,
                                    int64_t dim, float* d_emb, cudaStream_t stream);
cudaError_t LaunchAdd(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream);
cudaError_t LaunchBf16ToF32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);
cudaError_t LaunchF32ToBf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);
cudaError_t LaunchRope(float* x, const float* cos_t, const float* sin_t, int64_t rows, int heads,
                       int64_t half, bool inverse, cudaStream_t stream);
cudaError_t LaunchSumGroups(const float* x, float* out, int64_t rows, int64_t groups, int group,
                            int64_t dim, cudaStream_t stream);
}  // namespace cuda_internal

namespace {

using cuda::CheckDevicePointer;

absl::Status CheckSizes(const char* what, int64_t rows, int64_t dim) {
  if (rows < 0 || dim < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": rows = ", rows, ", dim = ", dim, " must be >= 0"));
  }
  return cuda::RequireCudaDevice();
}

}  // namespace

absl::Status EmbeddingForwardCuda(const float* emb, const int32_t* tokens, int64_t rows,
                                  int64_t dim, float* h, cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(CheckSizes("embedding forward", rows, dim));
  if (rows * dim == 0) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(emb, "emb"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(tokens, "tokens"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(h, "h"));
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cuda_internal::LaunchEmbeddingForward(emb, tokens, rows, dim, h, stream),
      "launch embedding forward");
  return absl::OkStatus();
}

absl::Status EmbeddingBackwardCuda(const int32_t* tokens, const float* dh, int64_t rows,
                                   int64_t dim, float* d_emb, cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(CheckSizes("embedding backward", rows, dim));
  if (rows * dim == 0) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(tokens, "tokens"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(dh, "dh"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(d_emb, "d_emb"));
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cuda_internal::LaunchEmbeddingBackward(tokens, dh, rows, dim, d_emb, stream),
      "launch embedding backward");
  return absl::OkStatus();
}

absl::Status AddCuda(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(CheckSizes("add", n, 1));
  if (n == 0) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a, "a"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(b, "b"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(out, "out"));
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchAdd(a, b, out, n, stream), "launch add");
  return absl::OkStatus();
}

absl::Status Bf16ToF32Cuda(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(CheckSizes("bf16 -> f32", n, 1));
  if (n == 0) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(in, "in"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(out, "out"));
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchBf16ToF32(in, out, n, stream),
                               "launch bf16 -> f32");
  return absl::OkStatus();
}

absl::Status F32ToBf16Cuda(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(CheckSizes("f32 -> bf16", n, 1));
  if (n == 0) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(in, "in"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(out, "out"));
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchF32ToBf16(in, out, n, stream),
                               "launch f32 -> bf16");
  return absl::OkStatus();
}

absl::Status RopeCuda(float* x, const float* cos_table, const float* sin_table, int64_t rows,
                      int heads, int64_t head_dim, bool inverse, cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(CheckSizes("RoPE", rows, head_dim));
  if (heads < 0 || head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RoPE: heads = ", heads, ", head_dim = ", head_dim, " (must be even)"));
  }
  if (rows * heads * head_dim == 0) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(x, "x"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(cos_table, "cos_table"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(sin_table, "sin_table"));
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchRope(x, cos_table, sin_table, rows, heads,
                                                         head_dim / 2, inverse, stream),
                               "launch RoPE");
  return absl::OkStatus();
}

absl::Status SumGroupsCuda(const float* x, float* out, int64_t rows, int64_t groups, int group,
                           int64_t dim, cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(CheckSizes("group sum", rows, dim));
  if (groups < 0 || group < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("group sum: groups = ", groups, ", group = ", group));
  }
  if (rows * groups * dim == 0) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(x, "x"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(out, "out"));
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cuda_internal::LaunchSumGroups(x, out, rows, groups, group, dim, stream), "launch group sum");
  return absl::OkStatus();
}

}  // namespace gradsum::model
