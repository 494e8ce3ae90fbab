#ifndef GRADSUM_MOE_DISPATCH_ROWS_H_
#define GRADSUM_MOE_DISPATCH_ROWS_H_

// Internal to moe/dispatch: the row kernels of the combine and its backward (scale, add,
// and the fp64 dot products d w = <dy, out>), built for baseline, AVX2 and AVX-512 and
// picked once per process at run time (core/cpu_isa.h). Every build gives the same bits
// (no FP contraction, no reassociation; moe/dispatch_rows_test compares each build with a
// scalar loop), so the choice changes speed only. GRADSUM_DISPATCH_ISA=generic|avx2|avx512
// forces one.

#include <cstdint>

#include "core/cpu_isa.h"

namespace gradsum::moe::internal {

// The most rows one dot_rows call takes.
inline constexpr int kDotRowsMax = 16;

struct RowKernels {
  // dst[d] = 0 + w * src[d] (-0 becomes +0).
  void (*set_scaled)(float* dst, float w, const float* src, int64_t n) = nullptr;
  // dst[d] += w * src[d].
  void (*add_scaled)(float* dst, float w, const float* src, int64_t n) = nullptr;
  // dst[d] = w * src[d].
  void (*scale)(float* dst, float w, const float* src, int64_t n) = nullptr;
  // dst[d] += src[d].
  void (*add)(float* dst, const float* src, int64_t n) = nullptr;
  // dot[i] = sum over d = 0, 1, ..., n - 1 in that order of double(a[i][d]) * b[i][d]
  // (each product exact in double, each add rounded), for i < rows <= kDotRowsMax.
  void (*dot_rows)(const float* const* a, const float* const* b, int64_t n, int rows,
                   double* dot) = nullptr;
  const char* isa = "";  // "generic", "avx2+fma" or "avx512"
};

// The build for "generic", "avx2" or "avx512" if this CPU runs it, else nullptr.
const RowKernels* RowKernelsFor(const char* isa);
// The build this process uses.
const RowKernels& SelectedRowKernels();

namespace dispatch_rows_generic {
RowKernels Kernels();
}
#if defined(GRADSUM_ISA_X86)
namespace dispatch_rows_avx2 {
RowKernels Kernels();
}
namespace dispatch_rows_avx512 {
RowKernels Kernels();
}
#endif

}  // namespace gradsum::moe::internal

#endif  // GRADSUM_MOE_DISPATCH_ROWS_H_
