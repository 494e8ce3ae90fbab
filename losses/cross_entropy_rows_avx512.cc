// The AVX-512 build of the CE row code (losses/cross_entropy_rows.h), x86-64 only; the
// library picks it at run time on CPUs with AVX-512 F/BW/VL/DQ, and its bf16 narrowing uses
// AVX-512 BF16 where the CPU has that too. The target (512-bit vectors preferred) is set by
// cross_entropy_rows_x86.inc; no FP contraction, so the bits are the generic build's.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "losses/cross_entropy_rows.h"

#define GRADSUM_CE_ROWS_NS rows_avx512
#define GRADSUM_CE_ROWS_ISA "avx512"
#define GRADSUM_ISA_AVX512 1
#define GRADSUM_ISA_TARGET GRADSUM_ISA_TARGET_AVX512
#include "losses/cross_entropy_rows_x86.inc"
