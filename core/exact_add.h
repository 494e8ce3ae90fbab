#ifndef GRADSUM_CORE_EXACT_ADD_H_
#define GRADSUM_CORE_EXACT_ADD_H_

// Internal to core/exact_sum: the kernel that adds fp32 / fp64 contributions into the
// gradient format's two int64 limbs (exact::AddFloats / AddDoubles), built for baseline,
// AVX2 and AVX-512 and picked at run time (core/cpu_isa.h). Reproducible mode adds every
// sequence's weight-gradient contribution through it, so its speed is the mode's main
// cost. Every build computes the same integers (exact arithmetic only; core/exact_add_test
// compares them); GRADSUM_EXACT_ISA=generic|avx2|avx512 forces one.
//
// Per element x (float or double): rejected (counted, nothing added) unless
// |x| < 2^kMaxExponent; else limbs [2i, 2i + 1] += a split of round(x / 2^kLsbExponent) to
// nearest-even: q1 = round(y / 2^kLimbBits), q0 = round(y - q1 2^kLimbBits), both within
// +-2^45 (not canonical; Normalize() makes them so).

#include <cstddef>
#include <cstdint>

#include "core/cpu_isa.h"

namespace gradsum::exact::internal {

struct AddKernels {
  // Adds n values into out[0, 2n); returns how many were rejected.
  int64_t (*add_floats)(const float* values, size_t n, int64_t* out) = nullptr;
  int64_t (*add_doubles)(const double* values, size_t n, int64_t* out) = nullptr;
  const char* isa = "";
};

// The build for "generic", "avx2" or "avx512" if this CPU runs it, else nullptr.
const AddKernels* AddKernelsFor(const char* isa);
// The build this process uses.
const AddKernels& SelectedAddKernels();

namespace exact_add_generic {
AddKernels Kernels();
}
#if defined(GRADSUM_ISA_X86)
namespace exact_add_avx2 {
AddKernels Kernels();
}
namespace exact_add_avx512 {
AddKernels Kernels();
}
#endif

}  // namespace gradsum::exact::internal

#endif  // GRADSUM_CORE_EXACT_ADD_H_
