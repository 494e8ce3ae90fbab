#include "losses/cuda/cross_entropy_cuda.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"
#include "losses/cuda/cross_entropy_kernels.h"

namespace gradsum::losses {

using cuda_internal::CeErrorRecord;
using cuda_internal::kNoRow;

CrossEntropyErrorRecord::~CrossEntropyErrorRecord() {
  if (record_ != nullptr) cudaFree(record_);
}

CrossEntropyErrorRecord::CrossEntropyErrorRecord(CrossEntropyErrorRecord&& o) noexcept
    : record_(std::exchange(o.record_, nullptr)) {}

CrossEntropyErrorRecord& CrossEntropyErrorRecord::operator=(CrossEntropyErrorRecord&& o) noexcept {
  if (this != &o) {
    if (record_ != nullptr) cudaFree(record_);
    record_ = std::exchange(o.record_, nullptr);
  }
  return *this;
}

absl::StatusOr<CrossEntropyErrorRecord> CrossEntropyErrorRecord::Create() {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  CrossEntropyErrorRecord r;
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaMalloc(&r.record_, sizeof(CeErrorRecord)),
                               "cudaMalloc(CE error record)");
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::ResetCeErrorRecord(r.record_, nullptr),
                               "reset CE error record");
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "reset CE error record");
  return r;
}

absl::Status CrossEntropyErrorRecord::CheckAndReset(cudaStream_t stream) {
  if (record_ == nullptr) return absl::FailedPreconditionError("CE error record is empty");
  CeErrorRecord h;
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&h, record_, sizeof(h), cudaMemcpyDeviceToHost, stream),
      "read CE error record");
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "CE kernels");
  const bool any = h.bad_label_row != kNoRow || h.bad_weight_row != kNoRow || h.bad_normaliser ||
                   h.nonfinite_row != kNoRow || h.normaliser_too_small;
  if (!any) return absl::OkStatus();
  GRADSUM_CUDA_RETURN_IF_ERROR(cuda_internal::ResetCeErrorRecord(record_, stream),
                               "reset CE error record");
  if (h.bad_label_row != kNoRow) {
    return absl::InvalidArgumentError(
        absl::StrCat("cross-entropy: label ", h.bad_label_value, " at row ", h.bad_label_row,
                     " is outside [0, vocab) and is not ignore_index (", h.bad_label_count,
                     " such rows in all)"));
  }
  if (h.bad_weight_row != kNoRow) {
    return absl::InvalidArgumentError(absl::StrCat("cross-entropy: token weight at row ",
                                                   h.bad_weight_row, " is negative or not finite (",
                                                   h.bad_weight_count, " such rows in all)"));
  }
  if (h.bad_normaliser) {
    return absl::InvalidArgumentError(
        "cross-entropy: global weight sum D is negative or not finite");
  }
  if (h.nonfinite_row != kNoRow) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cross-entropy: row ", h.nonfinite_row,
        " has a NaN or infinite loss (NaN/+inf logits, all -inf, a -inf target logit, or "
        "with label_smoothing a -inf logit; ",
        h.nonfinite_count, " such rows in all)"));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("cross-entropy: global weight sum D = ", h.normaliser,
                   " is smaller than this call's own weight sum ", h.local_weight_sum,
                   "; D must be summed over all ranks and micro-batches of the step"));
}

namespace {

absl::Status CheckArgs(const CrossEntropyCudaArgs& a) {
  if (a.dtype != DType::kF32 && a.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("cross-entropy: logits dtype must be f32 or bf16, got ", DTypeName(a.dtype)));
  }
  if (a.rows < 0)
    return absl::InvalidArgumentError(absl::StrCat("cross-entropy: rows = ", a.rows, " < 0"));
  if (a.vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat("cross-entropy: vocab = ", a.vocab, " < 1"));
  }
  if (a.rows > 0 && a.vocab > std::numeric_limits<int64_t>::max() / a.rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("cross-entropy: rows * vocab = ", a.rows, " * ", a.vocab, " overflows int64"));
  }
  GRADSUM_RETURN_IF_ERROR(cuda::CheckDevicePointer(a.global_weight_sum, "global_weight_sum"));
  GRADSUM_RETURN_IF_ERROR(cuda::CheckDevicePointer(a.loss, "loss"));
  GRADSUM_RETURN_IF_ERROR(cuda::CheckOptionalDevicePointer(a.local_weight_sum, "local_weight_sum"));
  GRADSUM_RETURN_IF_ERROR(cuda::CheckOptionalDevicePointer(a.ce_loss, "ce_loss"));
  GRADSUM_RETURN_IF_ERROR(cuda::CheckOptionalDevicePointer(a.z_out_loss, "z_out_loss"));
  // The options of SEMANTICS.md §3.2, as losses/cross_entropy.h checks them (written so
  // that NaN fails every check).
  if (!(a.ce.label_smoothing >= 0.0 && a.ce.label_smoothing < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("cross-entropy: label_smoothing ",
                                                   a.ce.label_smoothing, " must be in [0, 1)"));
  }
  if (!(a.ce.logit_softcap >= 0.0 && std::isfinite(a.ce.logit_softcap))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cross-entropy: logit_softcap ", a.ce.logit_softcap, " must be finite and >= 0 (0 = off)"));
  }
  if (!(a.ce.alpha_lse >= 0.0 && std::isfinite(a.ce.alpha_lse))) {
    return absl::InvalidArgumentError(absl::StrCat("cross-entropy: alpha_lse ", a.ce.alpha_lse,
                                                   " must be finite and >= 0 (0 = off)"));
  }
  if (a.rows == 0) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(cuda::CheckDevicePointer(a.logits, "logits"));
  GRADSUM_RETURN_IF_ERROR(cuda::CheckDevicePointer(a.labels, "labels"));
  GRADSUM_RETURN_IF_ERROR(cuda::CheckOptionalDevicePointer(a.token_weights, "token_weights"));
  GRADSUM_RETURN_IF_ERROR(cuda::CheckOptionalDevicePointer(a.grad_logits, "grad_logits"));
  GRADSUM_RETURN_IF_ERROR(cuda::CheckOptionalDevicePointer(a.token_loss, "token_loss"));
  if (a.grad_logits != nullptr && a.grad_logits != a.logits) {
    const uintptr_t bytes = static_cast<uintptr_t>(a.rows * a.vocab) * DTypeSize(a.dtype);
    const uintptr_t z = reinterpret_cast<uintptr_t>(a.logits);
    const uintptr_t g = reinterpret_cast<uintptr_t>(a.grad_logits);
    if (z < g + bytes && g < z + bytes) {
      return absl::InvalidArgumentError(
          "cross-entropy: grad_logits partly overlaps logits (only exact aliasing is supported)");
    }
  }
  return absl::OkStatus();
}

// Enqueues the kernels with `record` (a device record) on `stream`.
absl::Status Enqueue(const CrossEntropyCudaArgs& a, CeErrorRecord* record, cudaStream_t stream) {
  GRADSUM_ASSIGN_OR_RETURN(const int sms, cuda::CurrentDeviceSmCount());
  cuda_internal::CeLaunch l;
  l.logits = a.logits;
  l.grad_logits = a.grad_logits;
  l.dtype = a.dtype == DType::kBF16 ? cuda_internal::CeDType::kBF16 : cuda_internal::CeDType::kF32;
  l.rows = a.rows;
  l.vocab = a.vocab;
  l.labels = a.labels;
  l.token_weights = a.token_weights;
  l.global_weight_sum = a.global_weight_sum;
  l.ignore_index = a.ignore_index;
  l.grad_scale = a.grad_scale;
  l.loss = a.loss;
  l.local_weight_sum = a.local_weight_sum;
  l.accumulate = a.accumulate_loss;
  l.token_loss = a.token_loss;
  l.label_smoothing = a.ce.label_smoothing;
  l.logit_softcap = a.ce.logit_softcap;
  l.alpha_lse = a.ce.alpha_lse;
  l.ce_loss = a.ce_loss;
  l.z_out_loss = a.z_out_loss;
  l.error = record;
  l.stream = stream;
  // Wide rows get 512 threads (4 blocks of 2048 threads per SM); narrow rows fewer, so
  // threads are not left idle.
  const int64_t vec_chunks = a.vocab / (16 / DTypeSize(a.dtype));
  l.threads = vec_chunks >= 4096 ? 512 : (vec_chunks >= 1024 ? 256 : 128);
  const int64_t blocks_per_sm = 2048 / l.threads;
  l.num_blocks = static_cast<int>(std::min<int64_t>(
      {a.rows, static_cast<int64_t>(sms) * blocks_per_sm, cuda_internal::kCeMaxBlocks}));
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cudaMallocAsync(
          reinterpret_cast<void**>(&l.partials),
          sizeof(double) * cuda_internal::kCePartialsPerBlock * std::max(l.num_blocks, 1), stream),
      "cudaMallocAsync(CE partials)");
  const cudaError_t launch_err = cuda_internal::LaunchCrossEntropy(l);
  const cudaError_t free_err = cudaFreeAsync(l.partials, stream);
  GRADSUM_CUDA_RETURN_IF_ERROR(launch_err, "launch cross-entropy kernels");
  GRADSUM_CUDA_RETURN_IF_ERROR(free_err, "cudaFreeAsync(CE partials)");
  return absl::OkStatus();
}

}  // namespace

absl::Status CrossEntropyCuda(const CrossEntropyCudaArgs& args, cudaStream_t stream) {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  GRADSUM_RETURN_IF_ERROR(CheckArgs(args));
  if (args.error_record != nullptr) {
    if (args.error_record->device_record() == nullptr) {
      return absl::InvalidArgumentError("cross-entropy: error_record was not created");
    }
    return Enqueue(args, args.error_record->device_record(), stream);
  }
  GRADSUM_ASSIGN_OR_RETURN(CrossEntropyErrorRecord record, CrossEntropyErrorRecord::Create());
  GRADSUM_RETURN_IF_ERROR(Enqueue(args, record.device_record(), stream));
  return record.CheckAndReset(stream);
}

}  // namespace gradsum::losses
