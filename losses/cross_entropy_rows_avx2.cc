// The AVX2 + FMA build of the CE row code (losses/cross_entropy_rows.h), x86-64 only; the
// library picks it at run time. The target is set by a pragma after every #include (not by
// -mavx2 on the command line): header code stays baseline, and the file builds whatever
// --cpu Bazel is given.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "losses/cross_entropy_rows.h"

#if defined(GRADSUM_CE_ROWS_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#define GRADSUM_CE_ROWS_NS rows_avx2
#define GRADSUM_CE_ROWS_ISA "avx2+fma"
#define GRADSUM_CE_ROWS_AVX 1
#include "losses/cross_entropy_rows.inc"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // GRADSUM_CE_ROWS_X86
