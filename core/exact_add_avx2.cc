// The avx2+fma build of core/exact_add.inc, x86-64 only; picked at run time (core/exact_add.cc).
#include <cstddef>
#include <cstdint>

#include "core/cpu_isa.h"
#include "core/exact_add.h"
#include "core/exact_sum.h"

#define GRADSUM_EXACT_NS exact_add_avx2
#define GRADSUM_EXACT_ISA_NAME "avx2+fma"
#define GRADSUM_ISA_TARGET GRADSUM_ISA_TARGET_AVX2
#define GRADSUM_ISA_BODY "core/exact_add.inc"
#include "core/isa_build.inc"
