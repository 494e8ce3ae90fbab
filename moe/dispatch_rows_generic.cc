// The baseline build of moe/dispatch_rows.inc (SSE2 on x86-64).
#include <cstdint>

#include "core/cpu_isa.h"
#include "moe/dispatch_rows.h"

#define GRADSUM_ROWS_NS dispatch_rows_generic
#define GRADSUM_ROWS_ISA_NAME "generic"
#include "moe/dispatch_rows.inc"
