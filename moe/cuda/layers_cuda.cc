#include "moe/cuda/layers_cuda.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"
#include "moe/cuda/layer_kernels.h"

namespace gradsum::moe {
namespace {

using cuda::CheckDevicePointer;
using cuda_internal::ElemType;

constexpr int64_t kMaxRmsWidth = 24576;

absl::StatusOr<ElemType> ElemTypeOf(DType t, const char* what) {
  if (t == DType::kF32) return ElemType::kF32;
  if (t == DType::kBF16) return ElemType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": dtype must be f32 or bf16, got ", DTypeName(t)));
}

absl::StatusOr<cuda_internal::RmsNormLaunch> RmsNormCommon(const RmsNormArgs& a, const char* what) {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  cuda_internal::RmsNormLaunch l;
  GRADSUM_ASSIGN_OR_RETURN(l.dtype, ElemTypeOf(a.dtype, what));
  if (a.rows < 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ": rows = ", a.rows, " < 0"));
  if (a.width < 1 || a.width > kMaxRmsWidth) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": width = ", a.width, " is outside [1, ", kMaxRmsWidth, "]"));
  }
  if (!(a.eps > 0.0f))
    return absl::InvalidArgumentError(absl::StrCat(what, ": eps = ", a.eps, " <= 0"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.gamma, "gamma"));
  if (a.rows > 0) GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.x, "x"));
  GRADSUM_RETURN_IF_ERROR(cuda::CheckOptionalDevicePointer(a.rstd, "rstd"));
  GRADSUM_ASSIGN_OR_RETURN(const int sms, cuda::CurrentDeviceSmCount());
  l.rows = a.rows;
  l.width = a.width;
  l.eps = a.eps;
  l.x = a.x;
  l.gamma = a.gamma;
  l.rstd = a.rstd;
  l.threads = a.width >= 2048 ? 256 : 128;
  l.num_blocks =
      static_cast<int>(std::min<int64_t>(std::max<int64_t>(a.rows, 1), 4 * int64_t{sms}));
  return l;
}

}  // namespace

absl::Status RmsNormForwardCuda(const RmsNormArgs& a, cudaStream_t stream) {
  GRADSUM_ASSIGN_OR_RETURN(cuda_internal::RmsNormLaunch l, RmsNormCommon(a, "RMSNorm forward"));
  if (a.rows > 0) GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.y, "y"));
  l.y = a.y;
  l.stream = stream;
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchRmsNormForward(l), "launch RMSNorm forward");
  return absl::OkStatus();
}

absl::Status RmsNormBackwardCuda(const RmsNormArgs& a, cudaStream_t stream) {
  GRADSUM_ASSIGN_OR_RETURN(cuda_internal::RmsNormLaunch l, RmsNormCommon(a, "RMSNorm backward"));
  if (a.rows > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.dy, "dy"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.dx, "dx"));
  }
  GRADSUM_RETURN_IF_ERROR(cuda::CheckOptionalDevicePointer(a.dgamma, "dgamma"));
  l.dy = a.dy;
  l.dx = a.dx;
  l.accumulate_dx = a.accumulate_dx;
  l.dgamma = a.dgamma;
  l.stream = stream;
  if (a.dgamma != nullptr && a.rows > 0) {
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaMallocAsync(reinterpret_cast<void**>(&l.partials),
                                                 sizeof(float) * l.num_blocks * a.width, stream),
                                 "cudaMallocAsync(RMSNorm dgamma partials)");
  }
  const cudaError_t err = cuda_internal::LaunchRmsNormBackward(l);
  if (l.partials != nullptr) {
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaFreeAsync(l.partials, stream), "cudaFreeAsync");
  }
  GRADSUM_CUDA_RETURN_IF_ERROR(err, "launch RMSNorm backward");
  return absl::OkStatus();
}

namespace {

absl::StatusOr<cuda_internal::SwiGluLaunch> SwiGluCommon(const SwiGluArgs& a, const char* what) {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  cuda_internal::SwiGluLaunch l;
  GRADSUM_ASSIGN_OR_RETURN(l.dtype, ElemTypeOf(a.dtype, what));
  if (a.n < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": n = ", a.n, " < 0"));
  if (a.n > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.gate, "gate"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.up, "up"));
  }
  GRADSUM_ASSIGN_OR_RETURN(const int sms, cuda::CurrentDeviceSmCount());
  l.n = a.n;
  l.gate = a.gate;
  l.up = a.up;
  l.num_blocks = static_cast<int>(std::min<int64_t>((a.n + 255) / 256 + 1, 8 * int64_t{sms}));
  return l;
}

}  // namespace

absl::Status SwiGluForwardCuda(const SwiGluArgs& a, cudaStream_t stream) {
  GRADSUM_ASSIGN_OR_RETURN(cuda_internal::SwiGluLaunch l, SwiGluCommon(a, "SwiGLU forward"));
  if (a.n > 0) GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.out, "out"));
  l.out = a.out;
  l.stream = stream;
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchSwiGluForward(l), "launch SwiGLU forward");
  return absl::OkStatus();
}

absl::Status SwiGluBackwardCuda(const SwiGluArgs& a, cudaStream_t stream) {
  GRADSUM_ASSIGN_OR_RETURN(cuda_internal::SwiGluLaunch l, SwiGluCommon(a, "SwiGLU backward"));
  if (a.n > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.d_out, "d_out"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.d_gate, "d_gate"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.d_up, "d_up"));
  }
  l.d_out = a.d_out;
  l.d_gate = a.d_gate;
  l.d_up = a.d_up;
  l.stream = stream;
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchSwiGluBackward(l), "launch SwiGLU backward");
  return absl::OkStatus();
}

}  // namespace gradsum::moe
