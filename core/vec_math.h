#ifndef GRADSUM_CORE_VEC_MATH_H_
#define GRADSUM_CORE_VEC_MATH_H_

// Vectorised elementwise fp32 math for the CPU compute path: exp, sigmoid, the SwiGLU
// activation (forward and backward) and RMSNorm rows (forward and backward), built for three
// instruction sets and picked once per process at run time (core/cpu_isa.h): baseline (SSE2 on
// x86-64, 4 wide), AVX2 + FMA (8 wide) and AVX-512 (16 wide). All builds give the same bits (no FP
// contraction, no reassociation; core/vec_math_test compares them), so every rank computes the same
// values whichever build its CPU picks. GRADSUM_VEC_ISA=generic|avx2|avx512 forces one.
//
//   vec::Exp(x, y, n);                         // y[i] = exp(x[i])
//   vec::SwiGlu(g, u, a, n);                   // a[i] = SiLU(g[i]) * u[i]
//
// Accuracy (against the same functions in double; core/vec_math_test sweeps every 61st float
// of the range and asserts these bounds; it measured 0.99 and 2.33 ulp):
// - Exp: at most 2 ulp on [-86, 88.7228]; exactly 0 below -86 (the true value is < 4.5e-38);
//   +inf above 88.7228; NaN in, the same NaN out.
// - Sigmoid(x) = 1 / (1 + exp(-x)), computed from exp(-|x|) <= 1 (no overflow): at most
//   4 ulp for x >= -86; 0 below (the true value is < 4.5e-38).
// - SwiGlu and SwiGluBackward: the formulas below on those values, in the order written.

#include <cstdint>

#include "core/cpu_isa.h"

namespace gradsum::vec {

struct VecKernels {
  // y[i] = exp(x[i]); y may alias x.
  void (*exp)(const float* x, float* y, int64_t n) = nullptr;
  // y[i] = sigmoid(x[i]); y may alias x.
  void (*sigmoid)(const float* x, float* y, int64_t n) = nullptr;
  // a[i] = (g[i] * sigmoid(g[i])) * u[i].
  void (*swiglu)(const float* g, const float* u, float* a, int64_t n) = nullptr;
  // The SwiGLU backward, elementwise, with s = sigmoid(g[i]), silu = g[i] * s and
  // d = d_gate[i] (dL/da on entry):
  //   a[i] = silu * u[i]                                   (the forward, recomputed)
  //   d_up[i] = d * silu
  //   d_gate[i] = (((d * u[i]) * s) * (1 + g[i] * (1 - s)))  (SiLU'(g) = s (1 + g (1 - s)))
  void (*swiglu_backward)(const float* g, const float* u, float* d_gate, float* d_up, float* a,
                          int64_t n) = nullptr;
  // One RMSNorm row (model/layers.h): ms = sum(x^2) in fp64, the sum kept in 8 lanes
  // (lane k takes the elements i = k mod 8) added pairwise at the end, so every build
  // adds in the same order; r = float(1 / sqrt(ms / n + eps)); y[i] = (x[i] * r) * gain[i].
  // Returns r.
  float (*rms_norm_row)(const float* x, const float* gain, float eps, float* y,
                        int64_t n) = nullptr;
  // Its backward, given da = dL/dy: dgain_sum[i] += (double(da[i]) * x[i]) * r (fp64);
  // dot = sum(double(da[i]) * gain[i] * x[i]) in lanes as above;
  // coef = float(r^3 dot / n) (fp64); dx[i] += (r * gain[i]) * da[i] - coef * x[i].
  void (*rms_norm_backward_row)(const float* x, const float* da, const float* gain, float r,
                                double* dgain_sum, float* dx, int64_t n) = nullptr;
  const char* isa = "";  // "generic", "avx2+fma" or "avx512"
};

// The build for "generic", "avx2" or "avx512" if this CPU runs it, else nullptr.
const VecKernels* VecKernelsFor(const char* isa);

// The build this process uses (chosen once, core/cpu_isa.h).
const VecKernels& SelectedVecKernels();

inline void Exp(const float* x, float* y, int64_t n) { SelectedVecKernels().exp(x, y, n); }
inline void Sigmoid(const float* x, float* y, int64_t n) { SelectedVecKernels().sigmoid(x, y, n); }
inline void SwiGlu(const float* g, const float* u, float* a, int64_t n) {
  SelectedVecKernels().swiglu(g, u, a, n);
}
inline void SwiGluBackward(const float* g, const float* u, float* d_gate, float* d_up, float* a,
                           int64_t n) {
  SelectedVecKernels().swiglu_backward(g, u, d_gate, d_up, a, n);
}

inline float RmsNormRow(const float* x, const float* gain, float eps, float* y, int64_t n) {
  return SelectedVecKernels().rms_norm_row(x, gain, eps, y, n);
}
inline void RmsNormBackwardRow(const float* x, const float* da, const float* gain, float r,
                               double* dgain_sum, float* dx, int64_t n) {
  SelectedVecKernels().rms_norm_backward_row(x, da, gain, r, dgain_sum, dx, n);
}

namespace internal {
namespace vec_generic {
VecKernels Kernels();
}
#if defined(GRADSUM_ISA_X86)
namespace vec_avx2 {
VecKernels Kernels();  // only through VecKernelsFor: needs AVX2 + FMA
}
namespace vec_avx512 {
VecKernels Kernels();  // only through VecKernelsFor: needs AVX-512 F/BW/VL/DQ
}
#endif
}  // namespace internal

}  // namespace gradsum::vec

#endif  // GRADSUM_CORE_VEC_MATH_H_
