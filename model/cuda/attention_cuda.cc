// The attention on the GPU (model/cuda/attention_cuda.h): the argument checks (the CPU
// kernel's, model/attention_kernels.h, plus the kernels' limits and the pointers), the
// doc_start check on the device, and the launches (attention_cuda.cu).
#include "model/cuda/attention_cuda.h"

#include <climits>
#include <initializer_list>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"
#include "model/attention_kernels.h"
#include "model/cuda/attention_cuda_kernels.h"

namespace gradsum::model {
namespace {

using cuda::CheckDevicePointer;
using cuda_internal::AttentionCudaParams;

static_assert(kAttentionCudaMaxHeads == cuda_internal::kAttentionMaxHeads);
static_assert(kAttentionCudaMaxHeadDim == cuda_internal::kAttentionMaxHeadDim);

// The dims checked (model/attention.h's rules, then the kernels' limits) as launch
// parameters without pointers; `tokens` gets T.
absl::StatusOr<AttentionCudaParams> LaunchParams(const AttentionDims& dims, int64_t* tokens) {
  GRADSUM_ASSIGN_OR_RETURN(internal::AttentionShape shape, internal::CheckAttentionDims(dims));
  if (dims.head_dim > kAttentionCudaMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat("attention (CUDA): head_dim = ", dims.head_dim,
                                                   " is above the limit of ",
                                                   kAttentionCudaMaxHeadDim));
  }
  if (dims.q_heads > kAttentionCudaMaxHeads || dims.kv_heads > kAttentionCudaMaxHeads) {
    return absl::InvalidArgumentError(absl::StrCat("attention (CUDA): q_heads = ", dims.q_heads,
                                                   " and kv_heads = ", dims.kv_heads,
                                                   " must be at most ", kAttentionCudaMaxHeads));
  }
  const int64_t tiles = (dims.seq_len + 63) / 64;
  if (dims.seq_len > INT32_MAX || (tiles > 0 && dims.num_seqs > INT32_MAX / tiles)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention (CUDA): num_seqs = ", dims.num_seqs, " sequences of seq_len = ", dims.seq_len,
        " need more than 2^31 - 1 thread blocks of 64 tokens"));
  }
  AttentionCudaParams p;
  p.num_seqs = dims.num_seqs;
  p.seq_len = dims.seq_len;
  p.q_heads = dims.q_heads;
  p.kv_heads = dims.kv_heads;
  p.head_dim = static_cast<int>(dims.head_dim);
  p.scale = internal::AttentionScale(dims.head_dim);
  for (int h = 0; h < dims.q_heads; ++h) p.kv_of_q[h] = shape.kv_of_q[h];
  // The query heads of each kv head, ascending (the order dk / dv sum them in).
  int next = 0;
  for (int g = 0; g < dims.kv_heads; ++g) {
    p.heads_begin[g] = next;
    for (int h = 0; h < dims.q_heads; ++h) {
      if (shape.kv_of_q[h] == g) p.heads[next++] = h;
    }
  }
  p.heads_begin[dims.kv_heads] = next;
  *tokens = shape.tokens;
  return p;
}

// doc_start checked on the device: into `error` (no wait), or, without one, waited for and
// returned as the CPU kernel's InvalidArgument for the first bad token.
absl::Status CheckDocStart(const AttentionDims& dims, const int32_t* doc_start, cudaStream_t stream,
                           cuda::DeviceIndexFlag* error) {
  if (error != nullptr) {
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cuda_internal::LaunchAttentionCheckDocStart(doc_start, dims.num_seqs, dims.seq_len,
                                                    error->device_word(), stream),
        "launch attention doc_start check");
    return absl::OkStatus();
  }
  GRADSUM_ASSIGN_OR_RETURN(cuda::DeviceIndexFlag flag, cuda::DeviceIndexFlag::Create());
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cuda_internal::LaunchAttentionCheckDocStart(doc_start, dims.num_seqs, dims.seq_len,
                                                  flag.device_word(), stream),
      "launch attention doc_start check");
  GRADSUM_ASSIGN_OR_RETURN(std::optional<int64_t> bad, flag.ReadAndReset(stream));
  if (!bad.has_value()) return absl::OkStatus();
  int32_t value = -1, previous = -1;
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(&value, doc_start + *bad, sizeof(value), cudaMemcpyDeviceToHost),
      "read the bad doc_start");
  if (*bad % dims.seq_len != 0) {
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(&previous, doc_start + *bad - 1, sizeof(previous), cudaMemcpyDeviceToHost),
        "read the bad doc_start");
  }
  absl::Status s = internal::CheckDocStartToken(dims, *bad, value, previous);
  if (s.ok()) {
    return absl::InternalError(absl::StrCat("attention (CUDA): the device flagged doc_start[", *bad,
                                            "] = ", value, ", which the host accepts"));
  }
  return s;
}

struct NamedPointer {
  const void* ptr;
  const char* name;
};

// Everything before a launch: the dims (launch parameters without pointers), a usable
// device, and, when there is work (*tokens > 0), every pointer and doc_start.
absl::StatusOr<AttentionCudaParams> Prepare(const AttentionDims& dims,
                                            std::initializer_list<NamedPointer> pointers,
                                            const int32_t* doc_start, cudaStream_t stream,
                                            cuda::DeviceIndexFlag* error, int64_t* tokens) {
  GRADSUM_ASSIGN_OR_RETURN(AttentionCudaParams p, LaunchParams(dims, tokens));
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  if (*tokens == 0) return p;
  for (const NamedPointer& x : pointers) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(x.ptr, x.name));
  }
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(doc_start, "doc_start"));
  GRADSUM_RETURN_IF_ERROR(CheckDocStart(dims, doc_start, stream, error));
  p.doc_start = doc_start;
  return p;
}

}  // namespace

absl::Status AttentionForwardCuda(const AttentionDims& dims, const float* q, const float* k,
                                  const float* v, const int32_t* doc_start, float* out, float* lse,
                                  cudaStream_t stream, cuda::DeviceIndexFlag* error) {
  int64_t tokens = 0;
  GRADSUM_ASSIGN_OR_RETURN(AttentionCudaParams p,
                           Prepare(dims, {{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}},
                                   doc_start, stream, error, &tokens));
  if (tokens == 0) return absl::OkStatus();
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse = lse;
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchAttentionForward(p, stream),
                               "launch attention forward");
  return absl::OkStatus();
}

absl::Status AttentionBackwardCuda(const AttentionDims& dims, const float* q, const float* k,
                                   const float* v, const int32_t* doc_start, const float* out,
                                   const float* lse, const float* d_out, float* dq, float* dk,
                                   float* dv, cudaStream_t stream, cuda::DeviceIndexFlag* error) {
  int64_t tokens = 0;
  GRADSUM_ASSIGN_OR_RETURN(AttentionCudaParams p, Prepare(dims,
                                                          {{q, "q"},
                                                           {k, "k"},
                                                           {v, "v"},
                                                           {out, "out"},
                                                           {lse, "lse"},
                                                           {d_out, "d_out"},
                                                           {dq, "dq"},
                                                           {dk, "dk"},
                                                           {dv, "dv"}},
                                                          doc_start, stream, error, &tokens));
  if (tokens == 0) return absl::OkStatus();
  p.q = q;
  p.k = k;
  p.v = v;
  p.fwd_out = out;
  p.fwd_lse = lse;
  p.d_out = d_out;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  void* dsum = nullptr;
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cudaMallocAsync(&dsum, static_cast<size_t>(tokens) * dims.q_heads * sizeof(float), stream),
      "allocate the attention backward's row terms");
  p.dsum = static_cast<float*>(dsum);
  const cudaError_t launched = cuda_internal::LaunchAttentionBackward(p, stream);
  const cudaError_t freed = cudaFreeAsync(dsum, stream);
  GRADSUM_CUDA_RETURN_IF_ERROR(launched, "launch attention backward");
  GRADSUM_CUDA_RETURN_IF_ERROR(freed, "free the attention backward's row terms");
  return absl::OkStatus();
}

}  // namespace gradsum::model
