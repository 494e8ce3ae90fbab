// The baseline build of core/exact_add.inc (SSE2 on x86-64).
#include <cstddef>
#include <cstdint>

#include "core/cpu_isa.h"
#include "core/exact_add.h"
#include "core/exact_sum.h"

#define GRADSUM_EXACT_NS exact_add_generic
#define GRADSUM_EXACT_ISA_NAME "generic"
#include "core/exact_add.inc"
