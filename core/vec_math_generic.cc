// The baseline build of core/vec_math.inc (SSE2 on x86-64).
#include <cstdint>
#include <cstring>

#include "core/vec_math.h"

#define GRADSUM_VEC_NS vec_generic
#define GRADSUM_VEC_ISA_NAME "generic"
#include "core/vec_math.inc"
