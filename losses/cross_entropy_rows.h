#ifndef GRADSUM_LOSSES_CROSS_ENTROPY_ROWS_H_
#define GRADSUM_LOSSES_CROSS_ENTROPY_ROWS_H_

// Internal: the per-row body of the fused CPU cross-entropy, built for three instruction
// sets and picked once at run time. The row code (losses/cross_entropy_rows.inc) is bound by
// the throughput of its vectorised fp32 exp; the baseline x86-64 build (SSE2) runs it 4 wide,
// the AVX2 + FMA build 8 wide, the AVX-512 build 16 wide. All are compiled with
// -ffp-contract=off and the code never reassociates, so every build gives the same bits
// (checked by cross_entropy_rows_test); only the speed differs.
//
// GRADSUM_CE_ISA in the environment forces a build (for comparison): "generic", "avx2" or
// "avx512" (a build the CPU cannot run falls back to the best one it can).

#include <cstdint>

#include "core/cpu_isa.h"

namespace gradsum::losses::internal {

// Per-row outcome, kept per row so the first bad row is reported whatever the threading.
enum RowCode : uint8_t { kRowOk = 0, kRowNaN, kRowPosInf, kRowAllNegInf, kRowTargetNegInf };

inline constexpr int64_t kCeTile = 1024;  // floats per tile: 4 KiB, stays in L1

// Per-thread scratch for one row with a gradient: the row's exp values ([vocab]) and each
// tile's reference max ([ceil(vocab / kCeTile)]).
struct RowScratchView {
  float* exps = nullptr;
  float* tile_ref = nullptr;
};

// One row of fused CE forward (+ backward when grad_row is non-null; it may alias row):
// returns a RowCode; on kRowOk *loss = w * (logsumexp(row) - row[label]) and
// grad_row = (w / d) * (softmax(row) - onehot(label)). `label` in [0, vocab), w > 0, d > 0.
using CeRowF32Fn = uint8_t (*)(const float* row, float* grad_row, int64_t vocab, int64_t label,
                               float w, double d, const RowScratchView* scratch, double* loss);
using CeRowBf16Fn = uint8_t (*)(const uint16_t* row, uint16_t* grad_row, int64_t vocab,
                                int64_t label, float w, double d, const RowScratchView* scratch,
                                double* loss);
// The rows' bf16 <-> fp32 conversions, n elements: widening is exact; narrowing rounds to
// nearest even and keeps NaN a quiet NaN, bit for bit as BF16::FromFloat (core/half.h).
using Bf16ToF32Fn = void (*)(const uint16_t* in, float* out, int64_t n);
using F32ToBf16Fn = void (*)(const float* in, uint16_t* out, int64_t n);

struct CeRowKernels {
  CeRowF32Fn f32 = nullptr;
  CeRowBf16Fn bf16 = nullptr;
  Bf16ToF32Fn bf16_to_f32 = nullptr;
  F32ToBf16Fn f32_to_bf16 = nullptr;
  const char* isa = "";  // "generic", "avx2+fma" or "avx512"
};

namespace rows_generic {
CeRowKernels Kernels();
}  // namespace rows_generic

#if defined(GRADSUM_ISA_X86)
#define GRADSUM_CE_ROWS_X86 1
namespace rows_avx2 {
// Only call through SelectedCeRowKernels (the CPU must support AVX2 and FMA).
CeRowKernels Kernels();
}  // namespace rows_avx2
namespace rows_avx512 {
// Only call when CpuHasAvx512() (core/cpu_isa.h).
CeRowKernels Kernels();
}  // namespace rows_avx512
#endif

// The kernels for "generic", "avx2" or "avx512" if the CPU runs that build, else nullptr.
const CeRowKernels* CeRowKernelsFor(const char* isa);

// The build for this CPU, chosen once (PickIsaBuild, core/cpu_isa.h): the widest the CPU
// supports, unless GRADSUM_CE_ISA names another (see above).
const CeRowKernels& SelectedCeRowKernels();

}  // namespace gradsum::losses::internal

#endif  // GRADSUM_LOSSES_CROSS_ENTROPY_ROWS_H_
