// The AVX2 + FMA build of the CE row code (losses/cross_entropy_rows.h), x86-64 only; the
// library picks it at run time. The target is set by pragma (cross_entropy_rows_x86.inc).
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "losses/cross_entropy_rows.h"

#define GRADSUM_CE_ROWS_NS rows_avx2
#define GRADSUM_CE_ROWS_ISA "avx2+fma"
#define GRADSUM_ISA_TARGET GRADSUM_ISA_TARGET_AVX2
#include "losses/cross_entropy_rows_x86.inc"
