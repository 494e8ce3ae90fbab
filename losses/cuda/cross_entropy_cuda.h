#ifndef GRADSUM_LOSSES_CUDA_CROSS_ENTROPY_CUDA_H_
#define GRADSUM_LOSSES_CUDA_CROSS_ENTROPY_CUDA_H_

// Fused cross-entropy forward + backward on a CUDA device (SEMANTICS.md §3); the GPU
// counterpart of losses/cross_entropy.h with the same math:
//
//   L_ce[r, m] = sum over rows t of  w_t * (logsumexp(z_t) - z_t[y_t]) / D
//   dL/dz_t    = grad_scale * (w_t / D) * (softmax(z_t) - onehot(y_t))
//
// Everything lives in device memory, including D (the global weight sum of the step,
// fp64, from a SUM all-reduce), so a training step enqueues CE without a host sync:
//
//   CrossEntropyCudaArgs ce;
//   ce.logits = logits; ce.dtype = DType::kBF16; ce.rows = T; ce.vocab = V;
//   ce.labels = labels_dev; ce.global_weight_sum = d_dev;   // double on the device
//   ce.grad_logits = logits;                                 // in place
//   ce.loss = loss_dev; ce.accumulate_loss = true;           // fp64 display accumulator
//   ce.error_record = &record;                               // asynchronous checking
//   GRADSUM_RETURN_IF_ERROR(CrossEntropyCuda(ce, stream));
//   ... rest of the step ...
//   GRADSUM_RETURN_IF_ERROR(record.CheckAndReset(stream));   // once, at step end
//
// With `error_record == nullptr` the call checks synchronously instead (it waits for the
// stream and returns the input errors below directly): simple, but a host sync.
//
// Kernel: one thread block per row, grid-stride; 16-byte vector loads when V and the
// pointers allow; logits read twice, gradient written once. Loss sums are fp64 and
// deterministic (fixed-order reduction). Scratch comes from cudaMallocAsync on `stream`.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "losses/ce_options.h"

namespace gradsum::losses {

namespace cuda_internal {
struct CeErrorRecord;
}

// Device record of the input errors CE kernels find (bad labels, non-finite rows, bad
// weights or D). Several CE calls on one stream may share a record; CheckAndReset
// reports the first error kind found (labels first) and clears it.
class CrossEntropyErrorRecord {
 public:
  CrossEntropyErrorRecord() = default;
  ~CrossEntropyErrorRecord();
  CrossEntropyErrorRecord(CrossEntropyErrorRecord&& o) noexcept;
  CrossEntropyErrorRecord& operator=(CrossEntropyErrorRecord&& o) noexcept;
  CrossEntropyErrorRecord(const CrossEntropyErrorRecord&) = delete;
  CrossEntropyErrorRecord& operator=(const CrossEntropyErrorRecord&) = delete;

  // Allocates and clears a record. FailedPrecondition without a usable GPU.
  static absl::StatusOr<CrossEntropyErrorRecord> Create();

  // Waits for `stream`, then returns (and clears):
  // - InvalidArgument "label L at row R is outside [0, V) ..." for the lowest such row
  //   (with the number of such rows);
  // - InvalidArgument for a negative or non-finite token weight (lowest row named);
  // - InvalidArgument for a negative or non-finite D;
  // - InvalidArgument naming the lowest weighted row whose loss is NaN or infinite
  //   (NaN/+inf logits, all -inf, or a -inf target logit; with label_smoothing, a -inf
  //   anywhere in the row; with logit_softcap, only NaN, as the cap maps +-inf to +-c);
  // - FailedPrecondition when D is smaller than a call's own weight sum (D must be the
  //   global sum over ranks and micro-batches);
  // OK otherwise. CUDA failures map as core/cuda/cuda_status.h.
  absl::Status CheckAndReset(cudaStream_t stream);

  cuda_internal::CeErrorRecord* device_record() const { return record_; }

 private:
  cuda_internal::CeErrorRecord* record_ = nullptr;
};

struct CrossEntropyCudaArgs {
  const void* logits = nullptr;          // [rows, vocab] row-major, device
  DType dtype = DType::kF32;             // of logits and grad_logits: kF32 or kBF16
  int64_t rows = 0;                      // >= 0
  int64_t vocab = 0;                     // >= 1
  const int64_t* labels = nullptr;       // [rows] device: a class in [0, vocab) or ignore_index
  const float* token_weights = nullptr;  // [rows] device w_t >= 0, or null: token mode (w_t = 1)
  const double* global_weight_sum = nullptr;  // device scalar D >= 0 (§3); 0 -> loss 0, grad 0
  void* grad_logits = nullptr;                // [rows, vocab] device, or null (forward only); may
                                              // equal `logits` (in place); fully overwritten,
                                              // ignored / zero-weight rows get zeros
  float grad_scale = 1.0f;                    // upstream dLoss multiplier (1 for the plain loss)
  double* loss = nullptr;                     // device scalar: the local component (required)
  bool accumulate_loss = false;               // += into loss / local_weight_sum (else =)
  double* local_weight_sum = nullptr;         // optional device scalar: sum of this call's w_t
  float* token_loss = nullptr;                // optional [rows] device: w_t * CE_t / D per row
                                              // (w_t (CE_t + alpha_lse lse_t^2) / D with options)
  int64_t ignore_index = -100;
  // The CE options of SEMANTICS.md §3.2 (losses/ce_options.h; label_smoothing eps in [0, 1),
  // logit_softcap c >= 0 and finite, alpha_lse >= 0 and finite): each 0 = off (the defaults), and
  // with all three 0 the plain kernel runs, its code and results unchanged. With any on, a kernel
  // of the same shape computes, per row, from the capped logits z_j = c tanh(x_j / c) (when c > 0)
  // over the WHOLE row,
  //   CE_t = lse_t - (1 - eps) z_y - (eps / V) sum_j z_j,  loss += w_t (CE_t + alpha lse_t^2) / D
  //   dL/dx_j = grad_scale (w_t / D) ((1 + 2 alpha lse_t) p_j - (1 - eps) [j == y] - eps / V)
  //             * (1 - (z_j / c)^2 with the cap)
  CeOptions ce;
  // Optional device scalars, written (or added, with accumulate_loss) like `loss`: the
  // loss's two display terms (§3.2), the CE alone sum_t w_t CE_t / D and the output z-loss
  // alpha_lse sum_t w_t lse_t^2 / D. Without options they are `loss` and 0.
  double* ce_loss = nullptr;
  double* z_out_loss = nullptr;
  CrossEntropyErrorRecord* error_record = nullptr;  // null: check synchronously
};

// Enqueues CE on `stream`. Errors returned immediately (nothing enqueued): InvalidArgument
// for a bad option of §3.2 (named with its value, as the CPU kernel words it),
// rows < 0, vocab < 1, rows * vocab overflowing int64, a dtype other than f32/bf16, a
// required pointer that is null or not device memory (named), an optional one that is
// host memory, or grad_logits overlapping logits other than exactly; FailedPrecondition
// without a usable GPU. With error_record == nullptr, also the input errors listed at
// CheckAndReset (after waiting for the stream).
absl::Status CrossEntropyCuda(const CrossEntropyCudaArgs& args, cudaStream_t stream);

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_CUDA_CROSS_ENTROPY_CUDA_H_
