// The AVX-512 build of moe/dispatch_rows.inc, x86-64 only; picked at run time
// (moe/dispatch_rows.cc). The target is set by pragma (core/isa_build.inc).
#include <cstdint>

#include "core/cpu_isa.h"
#include "moe/dispatch_rows.h"
#if defined(GRADSUM_ISA_X86)
#include <immintrin.h>
#endif

#define GRADSUM_ROWS_NS dispatch_rows_avx512
#define GRADSUM_ROWS_ISA_NAME "avx512"
#define GRADSUM_ROWS_AVX512 1
#define GRADSUM_ISA_TARGET GRADSUM_ISA_TARGET_AVX512
#define GRADSUM_ISA_BODY "moe/dispatch_rows.inc"
#include "core/isa_build.inc"
