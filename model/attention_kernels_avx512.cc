// The AVX-512 build of model/attention_kernels.inc, x86-64 only; picked at run time on CPUs
// with AVX-512 F/BW/VL/DQ (model/attention_kernels.h). The target (512-bit vectors) is set
// by pragma (core/isa_build.inc).
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/cpu_isa.h"
#include "model/attention_kernels.h"

#define GRADSUM_ATTENTION_NS attention_avx512
#define GRADSUM_ATTENTION_ISA_NAME "avx512"
#define GRADSUM_ISA_AVX512 1
#define GRADSUM_ISA_TARGET GRADSUM_ISA_TARGET_AVX512
#define GRADSUM_ISA_BODY "model/attention_kernels.inc"
#include "core/isa_build.inc"
