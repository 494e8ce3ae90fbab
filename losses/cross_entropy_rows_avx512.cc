// The AVX-512 build of the CE row code (losses/cross_entropy_rows.h), x86-64 only; the
// library picks it at run time on CPUs with AVX-512 F/BW/VL/DQ. Same source and same rules
// as the AVX2 build (cross_entropy_rows_avx2.cc): the target is set by a pragma after every
// #include, with 512-bit vectors preferred, and no FP contraction, so the bits are the
// generic build's.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "losses/cross_entropy_rows.h"

#if defined(GRADSUM_CE_ROWS_X86)
#if defined(__clang__)
#pragma clang attribute push(                                                              \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"),                 \
                   min_vector_width(512))),                                                \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512")
#endif

#define GRADSUM_CE_ROWS_NS rows_avx512
#define GRADSUM_CE_ROWS_ISA "avx512"
#define GRADSUM_CE_ROWS_AVX 1
#include "losses/cross_entropy_rows.inc"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // GRADSUM_CE_ROWS_X86
