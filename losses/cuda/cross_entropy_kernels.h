#ifndef GRADSUM_LOSSES_CUDA_CROSS_ENTROPY_KERNELS_H_
#define GRADSUM_LOSSES_CUDA_CROSS_ENTROPY_KERNELS_H_

// Internal launch interface of the fused cross-entropy CUDA kernels (nvcc side; no absl).
// Use losses/cuda/cross_entropy_cuda.h, which checks arguments and returns absl::Status.

#include <cuda_runtime.h>

#include <cstdint>

namespace gradsum::losses::cuda_internal {

// Device-resident record of bad inputs seen by the kernels. Rows are "no error" when
// equal to kNoRow; the lowest offending row is kept (atomicMin), so the report is
// deterministic.
struct CeErrorRecord {
  unsigned long long bad_label_row;  // first row whose label is outside [0, V) and not ignored
  unsigned long long bad_label_count;
  long long bad_label_value;         // labels[bad_label_row], filled by the finalise kernel
  unsigned long long nonfinite_row;  // first weighted row whose loss is NaN/inf
  unsigned long long nonfinite_count;
  unsigned long long bad_weight_row;  // first row with a negative or non-finite weight
  unsigned long long bad_weight_count;
  int bad_normaliser;        // D < 0 or not finite
  int normaliser_too_small;  // D < this call's own weight sum
  double normaliser;         // D as read by the kernel
  double local_weight_sum;   // this call's sum of valid weights
};
constexpr unsigned long long kNoRow = ~0ull;

enum class CeDType { kF32, kBF16 };

struct CeLaunch {
  const void* logits = nullptr;  // [rows, vocab]
  void* grad_logits = nullptr;   // [rows, vocab] or null; may alias logits
  CeDType dtype = CeDType::kF32;
  int64_t rows = 0;
  int64_t vocab = 0;
  const int64_t* labels = nullptr;            // [rows]
  const float* token_weights = nullptr;       // [rows] or null (w = 1)
  const double* global_weight_sum = nullptr;  // D, one double
  int64_t ignore_index = -100;
  float grad_scale = 1.0f;
  double* loss = nullptr;              // one double
  double* local_weight_sum = nullptr;  // one double or null
  bool accumulate = false;             // += into loss / local_weight_sum instead of =
  float* token_loss = nullptr;         // [rows] or null
  // The CE options of SEMANTICS.md §3.2. All three 0: the plain row kernel, unchanged;
  // any of them on: the options row kernel (OptionsOn).
  double label_smoothing = 0.0;  // eps in [0, 1)
  double logit_softcap = 0.0;    // c >= 0 (applied in fp32, as the CPU kernel does)
  double alpha_lse = 0.0;        // >= 0
  double* ce_loss = nullptr;     // one double or null: sum w CE / D (the CE alone)
  double* z_out_loss = nullptr;  // one double or null: alpha_lse sum w lse^2 / D
  CeErrorRecord* error = nullptr;
  double* partials = nullptr;  // [3 * num_blocks] scratch
  int num_blocks = 0;          // upper bound of the grid (<= kCeMaxBlocks); the
                               // launcher lowers it to the blocks that are resident
                               // at once, so rows spread evenly over one wave
  int threads = 0;             // block size, multiple of 32, <= 1024
  cudaStream_t stream = nullptr;
};
constexpr int kCeMaxBlocks = 8192;
// Per-block partials: loss and weight (plain), CE sum, lse^2 sum and weight (options).
constexpr int kCePartialsPerBlock = 3;

inline bool OptionsOn(const CeLaunch& l) {
  return l.label_smoothing != 0.0 || l.logit_softcap != 0.0 || l.alpha_lse != 0.0;
}

// Launches the row kernel and the single-block finalise kernel on `stream`.
cudaError_t LaunchCrossEntropy(const CeLaunch& launch);

// Writes a fresh (no-error) record into device memory `record`, stream-ordered.
cudaError_t ResetCeErrorRecord(CeErrorRecord* record, cudaStream_t stream);

}  // namespace gradsum::losses::cuda_internal

#endif  // GRADSUM_LOSSES_CUDA_CROSS_ENTROPY_KERNELS_H_
