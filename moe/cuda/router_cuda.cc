#include "moe/cuda/router_cuda.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"
#include "moe/cuda/router_kernels.h"

namespace gradsum::moe {
namespace {

using cuda::CheckDevicePointer;
using cuda::CheckOptionalDevicePointer;
using cuda_internal::kMaxCudaExperts;
using cuda_internal::kMaxCudaTopK;

absl::Status CheckShape(int64_t tokens, int experts, int top_k, const char* what) {
  if (tokens < 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ": tokens = ", tokens, " < 0"));
  if (experts < 1 || experts > kMaxCudaExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": experts = ", experts, " is outside [1, ", kMaxCudaExperts, "]"));
  }
  if (top_k < 1 || top_k > std::min(experts, kMaxCudaTopK)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": top_k = ", top_k, " is outside [1, ",
                                                   std::min(experts, kMaxCudaTopK), "]"));
  }
  return absl::OkStatus();
}

int WarpBlocks(int64_t tokens, int sms) {
  // 8 warps (tokens) per block, up to 8 blocks per SM.
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((tokens + 7) / 8, 8 * int64_t{sms})));
}

}  // namespace

absl::Status RouterForwardCuda(const RouterForwardCudaArgs& a, cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  GRADSUM_RETURN_IF_ERROR(CheckShape(a.tokens, a.experts, a.top_k, "router forward"));
  if (!std::isfinite(a.router_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("router forward: router_scale = ", a.router_scale));
  }
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.local_expert_counts, "local_expert_counts"));
  GRADSUM_RETURN_IF_ERROR(CheckOptionalDevicePointer(a.local_routed_tokens, "local_routed_tokens"));
  GRADSUM_RETURN_IF_ERROR(CheckOptionalDevicePointer(a.local_gating_sums, "local_gating_sums"));
  if (a.tokens > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.logits, "logits"));
    GRADSUM_RETURN_IF_ERROR(CheckOptionalDevicePointer(a.mask, "mask"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.probs, "probs"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.expert_index, "expert_index"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.combine_weight, "combine_weight"));
    GRADSUM_RETURN_IF_ERROR(CheckOptionalDevicePointer(a.logsumexp, "logsumexp"));
    GRADSUM_RETURN_IF_ERROR(CheckOptionalDevicePointer(a.expert_bias, "expert_bias"));
  }
  std::optional<cuda::DeviceIndexFlag> own_flag;
  cuda::DeviceIndexFlag* flag = a.error;
  if (flag == nullptr) {
    GRADSUM_ASSIGN_OR_RETURN(own_flag, cuda::DeviceIndexFlag::Create());
    flag = &*own_flag;
  }
  GRADSUM_ASSIGN_OR_RETURN(const int sms, cuda::CurrentDeviceSmCount());

  cuda_internal::RouterForwardLaunch l;
  l.logits = a.logits;
  l.mask = a.mask;
  l.tokens = a.tokens;
  l.experts = a.experts;
  l.top_k = a.top_k;
  l.norm_topk_prob = a.norm_topk_prob;
  l.router_scale = a.router_scale;
  l.sigmoid = a.sigmoid_scores;
  l.expert_bias = a.expert_bias;
  l.probs = a.probs;
  l.expert_index = a.expert_index;
  l.combine_weight = a.combine_weight;
  l.logsumexp = a.logsumexp;
  // int64 counts are accumulated with 64-bit unsigned atomics (same representation).
  l.expert_counts = reinterpret_cast<unsigned long long*>(a.local_expert_counts);
  l.bad_token = flag->device_word();
  l.num_blocks = WarpBlocks(a.tokens, sms);
  l.stream = stream;
  unsigned long long* routed_scratch = nullptr;
  l.routed_tokens = reinterpret_cast<unsigned long long*>(a.local_routed_tokens);
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(a.local_expert_counts, 0, sizeof(int64_t) * a.experts, stream),
      "zero counts");
  if (l.routed_tokens == nullptr) {
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMallocAsync(reinterpret_cast<void**>(&routed_scratch), sizeof(int64_t), stream),
        "cudaMallocAsync");
    l.routed_tokens = routed_scratch;
  }
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(l.routed_tokens, 0, sizeof(int64_t), stream),
                               "zero routed count");
  if (a.local_gating_sums != nullptr) {
    l.gating_sums = a.local_gating_sums;
    l.gating_chunks =
        static_cast<int>(std::clamp<int64_t>((a.tokens + 1023) / 1024, 1, 4 * int64_t{sms}));
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMallocAsync(reinterpret_cast<void**>(&l.gating_partials),
                        sizeof(double) * l.gating_chunks * a.experts, stream),
        "cudaMallocAsync(gating partials)");
  }
  const cudaError_t err = cuda_internal::LaunchRouterForward(l);
  if (l.gating_partials != nullptr) cudaFreeAsync(l.gating_partials, stream);
  if (routed_scratch != nullptr) cudaFreeAsync(routed_scratch, stream);
  GRADSUM_CUDA_RETURN_IF_ERROR(err, "launch router forward");
  if (own_flag.has_value()) {
    GRADSUM_ASSIGN_OR_RETURN(std::optional<int64_t> bad, own_flag->ReadAndReset(stream));
    if (bad.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("router forward: token ", *bad,
                       " has a non-finite logit or a mask value other than 0/1"));
    }
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<cuda_internal::RouterAuxLaunch> AuxCommon(const RouterAuxCudaArgs& a,
                                                         const char* what) {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  GRADSUM_RETURN_IF_ERROR(CheckShape(a.tokens, a.experts, a.top_k, what));
  if (!std::isfinite(a.alpha_z) || !std::isfinite(a.alpha_b)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": alpha_z = ", a.alpha_z,
                                                   ", alpha_b = ", a.alpha_b, " must be finite"));
  }
  if (a.num_micro_batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": num_micro_batches = ", a.num_micro_batches, " < 1"));
  }
  if (a.sigmoid_scores && a.alpha_b != 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": alpha_b = ", a.alpha_b,
        " with sigmoid scores; the balancing loss is of the softmax (SEMANTICS.md §5.1)"));
  }
  if (a.alpha_z != 0.0f) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.global_routed_tokens, "global_routed_tokens"));
    if (a.tokens > 0) GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.logsumexp, "logsumexp"));
  }
  if (a.alpha_b != 0.0f) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.global_expert_counts, "global_expert_counts"));
  }
  if (a.tokens > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.probs, "probs"));
    GRADSUM_RETURN_IF_ERROR(CheckOptionalDevicePointer(a.mask, "mask"));
  }
  GRADSUM_ASSIGN_OR_RETURN(const int sms, cuda::CurrentDeviceSmCount());
  cuda_internal::RouterAuxLaunch l;
  l.probs = a.probs;
  l.logsumexp = a.logsumexp;
  l.mask = a.mask;
  l.tokens = a.tokens;
  l.experts = a.experts;
  l.top_k = a.top_k;
  l.norm_topk_prob = a.norm_topk_prob;
  l.router_scale = a.router_scale;
  l.sigmoid = a.sigmoid_scores;
  l.logits = a.logits;
  l.alpha_z = a.alpha_z;
  l.alpha_b = a.alpha_b;
  l.num_micro_batches = a.num_micro_batches;
  l.global_routed_tokens = a.alpha_z != 0.0f ? a.global_routed_tokens : nullptr;
  l.global_expert_counts = a.alpha_b != 0.0f ? a.global_expert_counts : nullptr;
  l.num_blocks = WarpBlocks(a.tokens, sms);
  return l;
}

}  // namespace

absl::Status RouterAuxLossCuda(const RouterAuxCudaArgs& a, cudaStream_t stream) {
  GRADSUM_ASSIGN_OR_RETURN(cuda_internal::RouterAuxLaunch l, AuxCommon(a, "router aux loss"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.z_loss, "z_loss"));
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.balance_loss, "balance_loss"));
  if (a.alpha_b != 0.0f)
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.local_gating_sums, "local_gating_sums"));
  // The finalise kernel reads these unconditionally; disabled terms get zero stand-ins.
  double* zeros = nullptr;
  const size_t zero_bytes = sizeof(double) * (1 + a.experts) + sizeof(int64_t) * a.experts;
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cudaMallocAsync(reinterpret_cast<void**>(&zeros), zero_bytes, stream), "cudaMallocAsync");
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(zeros, 0, zero_bytes, stream), "cudaMemsetAsync");
  if (l.global_routed_tokens == nullptr) l.global_routed_tokens = zeros;
  l.local_gating_sums = a.alpha_b != 0.0f ? a.local_gating_sums : zeros + 1;
  if (l.global_expert_counts == nullptr) {
    l.global_expert_counts = reinterpret_cast<const int64_t*>(zeros + 1 + a.experts);
  }
  if (a.alpha_z == 0.0f) l.tokens = 0;  // nothing to sum for z
  l.z_loss = a.z_loss;
  l.balance_loss = a.balance_loss;
  l.accumulate = a.accumulate_loss;
  l.stream = stream;
  cudaError_t err =
      cudaMallocAsync(reinterpret_cast<void**>(&l.partials), sizeof(double) * l.num_blocks, stream);
  if (err == cudaSuccess) {
    err = cuda_internal::LaunchRouterAuxLoss(l);
    cudaFreeAsync(l.partials, stream);
  }
  cudaFreeAsync(zeros, stream);
  GRADSUM_CUDA_RETURN_IF_ERROR(err, "launch router aux loss");
  return absl::OkStatus();
}

absl::Status RouterBackwardCuda(const RouterAuxCudaArgs& a, cudaStream_t stream) {
  GRADSUM_ASSIGN_OR_RETURN(cuda_internal::RouterAuxLaunch l, AuxCommon(a, "router backward"));
  if (a.tokens > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.d_logits, "d_logits"));
    GRADSUM_RETURN_IF_ERROR(CheckOptionalDevicePointer(a.d_combine_weight, "d_combine_weight"));
    if (a.d_combine_weight != nullptr) {
      GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.expert_index, "expert_index"));
    }
    if (a.sigmoid_scores && a.alpha_z != 0.0f) {
      GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(a.logits, "logits"));
    }
  }
  if (!std::isfinite(a.router_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("router backward: router_scale = ", a.router_scale));
  }
  l.expert_index = a.expert_index;
  l.d_combine_weight = a.d_combine_weight;
  l.d_logits = a.d_logits;
  l.accumulate = a.accumulate_grad;
  if (a.alpha_z == 0.0f) l.logsumexp = nullptr;
  l.stream = stream;
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchRouterBackward(l), "launch router backward");
  return absl::OkStatus();
}

}  // namespace gradsum::moe
