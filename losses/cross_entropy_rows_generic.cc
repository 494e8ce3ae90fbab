// The generic build of the CE row code (losses/cross_entropy_rows.h).
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "losses/cross_entropy_rows.h"

#define GRADSUM_CE_ROWS_NS rows_generic
#define GRADSUM_CE_ROWS_ISA "generic"
#include "losses/cross_entropy_rows.inc"
