#include "moe/cuda/permute_cuda.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"
#include "moe/cuda/permute_kernels.h"

namespace gradsum::moe {
namespace {

using cuda::CheckDevicePointer;

absl::Status CheckPlanShape(const PermutePlanCudaArgs& p) {
  if (p.tokens < 0)
    return absl::InvalidArgumentError(absl::StrCat("permute: tokens = ", p.tokens, " < 0"));
  if (p.top_k < 1)
    return absl::InvalidArgumentError(absl::StrCat("permute: top_k = ", p.top_k, " < 1"));
  if (p.experts < 1 || p.experts > cuda_internal::kMaxPermuteExperts) {
    return absl::InvalidArgumentError(absl::StrCat("permute: experts = ", p.experts,
                                                   " is outside [1, ",
                                                   cuda_internal::kMaxPermuteExperts, "]"));
  }
  if (p.tokens > std::numeric_limits<int32_t>::max() / p.top_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("permute: tokens * top_k = ", p.tokens, " * ", p.top_k, " >= 2^31"));
  }
  if (p.tokens > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(p.permuted_copy, "permuted_copy"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(p.copy_position, "copy_position"));
  }
  return CheckDevicePointer(p.expert_offsets, "expert_offsets");
}

int RowBlocks(int64_t rows, int sms) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, 16 * int64_t{sms})));
}

}  // namespace

absl::Status PermutePlanCuda(const PermutePlanCudaArgs& p, cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  GRADSUM_RETURN_IF_ERROR(CheckPlanShape(p));
  if (p.tokens > 0) GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(p.expert_index, "expert_index"));
  std::optional<cuda::DeviceIndexFlag> own_flag;
  cuda::DeviceIndexFlag* flag = p.error;
  if (flag == nullptr) {
    GRADSUM_ASSIGN_OR_RETURN(own_flag, cuda::DeviceIndexFlag::Create());
    flag = &*own_flag;
  }
  cuda_internal::PermutePlanLaunch l;
  l.expert_index = p.expert_index;
  l.copies = p.tokens * p.top_k;
  l.experts = p.experts;
  l.expert_offsets = p.expert_offsets;
  l.permuted_copy = p.permuted_copy;
  l.copy_position = p.copy_position;
  l.bad_copy = flag->device_word();
  l.stream = stream;
  const int64_t chunks =
      (l.copies + cuda_internal::kPermuteChunk - 1) / cuda_internal::kPermuteChunk;
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cudaMallocAsync(reinterpret_cast<void**>(&l.chunk_counts),
                      sizeof(int) * std::max<int64_t>(chunks, 1) * p.experts, stream),
      "cudaMallocAsync(permute chunk counts)");
  const cudaError_t err = cuda_internal::LaunchPermutePlan(l);
  cudaFreeAsync(l.chunk_counts, stream);
  GRADSUM_CUDA_RETURN_IF_ERROR(err, "launch permute plan");
  if (own_flag.has_value()) {
    GRADSUM_ASSIGN_OR_RETURN(std::optional<int64_t> bad, own_flag->ReadAndReset(stream));
    if (bad.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("permute: expert index of token ",
                                                     *bad / p.top_k, " slot ", *bad % p.top_k,
                                                     " is outside [-1, ", p.experts, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status PermuteRowsCuda(const PermuteRowsCudaArgs& a, const PermutePlanCudaArgs& plan,
                             cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  GRADSUM_RETURN_IF_ERROR(CheckPlanShape(plan));
  if (a.width < 0)
    return absl::InvalidArgumentError(absl::StrCat("permute rows: width = ", a.width, " < 0"));
  if (plan.tokens > 0 && a.width > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.src, "src"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.dst, "dst"));
  }
  GRADSUM_ASSIGN_OR_RETURN(const int sms, cuda::CurrentDeviceSmCount());
  cuda_internal::PermuteRowsLaunch l;
  l.src = a.src;
  l.dst = a.dst;
  l.width = a.width;
  l.elem_bytes = static_cast<int>(DTypeSize(a.dtype));
  l.top_k = plan.top_k;
  l.copies = plan.tokens * plan.top_k;
  l.experts = plan.experts;
  l.permuted_copy = plan.permuted_copy;
  l.expert_offsets = plan.expert_offsets;
  l.num_blocks = RowBlocks(l.copies, sms);
  l.stream = stream;
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchPermuteRows(l), "launch permute rows");
  return absl::OkStatus();
}

namespace {

absl::StatusOr<cuda_internal::CombineLaunch> CombineCommon(const CombineCudaArgs& a,
                                                           const PermutePlanCudaArgs& plan,
                                                           const char* what) {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  GRADSUM_RETURN_IF_ERROR(CheckPlanShape(plan));
  if (a.dtype != DType::kF32 && a.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": dtype must be f32 or bf16, got ", DTypeName(a.dtype)));
  }
  if (a.width < 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ": width = ", a.width, " < 0"));
  if (plan.tokens > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.rows, "rows"));
    GRADSUM_RETURN_IF_ERROR(cuda::CheckOptionalDevicePointer(a.weights, "weights"));
  }
  GRADSUM_ASSIGN_OR_RETURN(const int sms, cuda::CurrentDeviceSmCount());
  cuda_internal::CombineLaunch l;
  l.bf16 = a.dtype == DType::kBF16;
  l.tokens = plan.tokens;
  l.top_k = plan.top_k;
  l.width = a.width;
  l.copy_position = plan.copy_position;
  l.weights = a.weights;
  l.rows = a.rows;
  l.num_blocks = RowBlocks(plan.tokens, sms);
  return l;
}

}  // namespace

absl::Status CombineCuda(const CombineCudaArgs& a, const PermutePlanCudaArgs& plan,
                         cudaStream_t stream) {
  GRADSUM_ASSIGN_OR_RETURN(cuda_internal::CombineLaunch l, CombineCommon(a, plan, "combine"));
  if (plan.tokens > 0) GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.out, "out"));
  l.out = a.out;
  l.accumulate = a.accumulate;
  l.stream = stream;
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchCombine(l), "launch combine");
  return absl::OkStatus();
}

absl::Status CombineBackwardCuda(const CombineCudaArgs& a, const PermutePlanCudaArgs& plan,
                                 cudaStream_t stream) {
  GRADSUM_ASSIGN_OR_RETURN(cuda_internal::CombineLaunch l,
                           CombineCommon(a, plan, "combine backward"));
  if (plan.tokens > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.d_out, "d_out"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.d_rows, "d_rows"));
    GRADSUM_RETURN_IF_ERROR(cuda::CheckOptionalDevicePointer(a.d_weights, "d_weights"));
  }
  l.d_out = a.d_out;
  l.d_rows = a.d_rows;
  l.d_weights = a.d_weights;
  l.stream = stream;
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchCombineBackward(l), "launch combine backward");
  return absl::OkStatus();
}

}  // namespace gradsum::moe
