// The avx2+fma build of core/vec_math.inc, x86-64 only; core/vec_math.cc picks it at run
// time when the CPU runs it. The target is set by pragma (core/isa_build.inc).
#include <cstdint>
#include <cstring>

#include "core/cpu_isa.h"
#include "core/vec_math.h"

#define GRADSUM_VEC_NS vec_avx2
#define GRADSUM_VEC_ISA_NAME "avx2+fma"
#define GRADSUM_ISA_TARGET GRADSUM_ISA_TARGET_AVX2
#define GRADSUM_ISA_BODY "core/vec_math.inc"
#include "core/isa_build.inc"
