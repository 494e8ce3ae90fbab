// The AVX2 + FMA build of model/attention_kernels.inc, x86-64 only; picked at run time
// (model/attention_kernels.h). The target is set by pragma (core/isa_build.inc).
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/cpu_isa.h"
#include "model/attention_kernels.h"

#define GRADSUM_ATTENTION_NS attention_avx2
#define GRADSUM_ATTENTION_ISA_NAME "avx2+fma"
#define GRADSUM_ISA_TARGET GRADSUM_ISA_TARGET_AVX2
#define GRADSUM_ISA_BODY "model/attention_kernels.inc"
#include "core/isa_build.inc"
