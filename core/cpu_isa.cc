#include "core/cpu_isa.h"

namespace gradsum {

bool CpuHasAvx2Fma() {
#if defined(GRADSUM_ISA_X86)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool CpuHasAvx512() {
#if defined(GRADSUM_ISA_X86)
  return CpuHasAvx2Fma() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool CpuHasAvx512Bf16() {
#if defined(GRADSUM_ISA_X86)
  return CpuHasAvx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace gradsum
