// The AVX2 + FMA build (x86-64 only; the library picks it at run time) of the CE row code (losses/cross_entropy_rows.h).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "losses/cross_entropy_rows.h"

#if defined(__x86_64__)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "cross_entropy_rows_avx2.cc must be compiled with -mavx2 -mfma"
#endif

#define GRADSUM_CE_ROWS_NS rows_avx2
#define GRADSUM_CE_ROWS_ISA "avx2+fma"
#include "losses/cross_entropy_rows.inc"
#endif  // defined(__x86_64__)
