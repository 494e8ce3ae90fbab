// The baseline build of model/attention_kernels.inc (SSE2 on x86-64, without FMA: the fused
// multiply-adds are emulated exactly, so this build is several times slower and only runs
// on CPUs without AVX2 + FMA, or when forced for a comparison).
#include <cstdint>
#include <cstring>

#include "model/attention_kernels.h"

#define GRADSUM_ATTENTION_NS attention_generic
#define GRADSUM_ATTENTION_ISA_NAME "generic"
#include "model/attention_kernels.inc"
