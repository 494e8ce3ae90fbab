#ifndef GRADSUM_MOE_CUDA_LAYERS_CUDA_H_
#define GRADSUM_MOE_CUDA_LAYERS_CUDA_H_

// RMSNorm and the SwiGLU elementwise product of moe_lm (SEMANTICS.md §10) on a CUDA device,
// f32 or bf16 activations with fp32 math; the GEMMs around them go through
// core/cuda/gemm.h. All pointers are device memory; calls enqueue on `stream` and return
// without a host sync.
//
//   // a = RMSNorm(h; g), keeping 1/rms per row for backward
//   RmsNormArgs n;
//   n.dtype = DType::kBF16; n.rows = T; n.width = D;
//   n.x = h; n.gamma = g; n.y = a; n.rstd = rstd;
//   GRADSUM_RETURN_IF_ERROR(RmsNormForwardCuda(n, stream));
//   // backward: d_h += dx, d_g += dgamma
//   n.dy = d_a; n.dx = d_h; n.accumulate_dx = true; n.dgamma = d_g;
//   GRADSUM_RETURN_IF_ERROR(RmsNormBackwardCuda(n, stream));
//
//   // expert hidden: hid = SiLU(x Wg) * (x Wu)
//   SwiGluArgs s; s.dtype = DType::kBF16; s.n = rows * H;
//   s.gate = gate_pre; s.up = up_pre; s.out = hid;
//   GRADSUM_RETURN_IF_ERROR(SwiGluForwardCuda(s, stream));

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"

namespace gradsum::moe {

struct RmsNormArgs {
  DType dtype = DType::kF32;     // of x, y, dy, dx: kF32 or kBF16
  int64_t rows = 0;              // >= 0
  int64_t width = 0;             // D, 1 <= D <= 24576 (the dgamma accumulator is in shared memory)
  float eps = 1e-6f;             // > 0 (§10 uses 1e-6)
  const void* x = nullptr;       // [rows, width]
  const float* gamma = nullptr;  // [width] fp32 gain g
  // Forward.
  void* y = nullptr;      // [rows, width]; may equal x
  float* rstd = nullptr;  // [rows] 1/sqrt(mean(x^2)+eps); forward writes it when non-null,
                          // backward reads it when non-null (else recomputes from x)
  // Backward.
  const void* dy = nullptr;    // [rows, width]
  void* dx = nullptr;          // [rows, width]; may equal dy
  bool accumulate_dx = false;  // dx += (the residual stream's gradient) instead of dx =
  float* dgamma = nullptr;     // [width], accumulated (+=; deterministic); null: not needed
};

// y = x * rstd * gamma per row. Errors: InvalidArgument for a bad dtype, rows < 0,
// width outside [1, 24576], eps <= 0, or a null / non-device pointer (named);
// FailedPrecondition without a usable GPU.
absl::Status RmsNormForwardCuda(const RmsNormArgs& args, cudaStream_t stream);

// dx (and dgamma) from dy. Same errors; x must be the forward's input (not overwritten by y).
absl::Status RmsNormBackwardCuda(const RmsNormArgs& args, cudaStream_t stream);

struct SwiGluArgs {
  DType dtype = DType::kF32;    // kF32 or kBF16, all tensors
  int64_t n = 0;                // number of elements (rows * H), >= 0
  const void* gate = nullptr;   // [n] x Wg (pre-activation)
  const void* up = nullptr;     // [n] x Wu
  void* out = nullptr;          // forward: [n] SiLU(gate) * up; may equal gate or up
  const void* d_out = nullptr;  // backward: [n] dL/d out
  void* d_gate = nullptr;       // backward: [n] dL/d gate, overwritten; may equal gate
  void* d_up = nullptr;         // backward: [n] dL/d up, overwritten; may equal up
};

// Errors: InvalidArgument for a bad dtype, n < 0, or a null / non-device pointer (named);
// FailedPrecondition without a usable GPU.
absl::Status SwiGluForwardCuda(const SwiGluArgs& args, cudaStream_t stream);
absl::Status SwiGluBackwardCuda(const SwiGluArgs& args, cudaStream_t stream);

}  // namespace gradsum::moe

#endif  // GRADSUM_MOE_CUDA_LAYERS_CUDA_H_
