#ifndef GRADSUM_LOSSES_CROSS_ENTROPY_ROWS_H_
#define GRADSUM_LOSSES_CROSS_ENTROPY_ROWS_H_

// Internal: the per-row body of the fused CPU cross-entropy, built for two instruction
// sets and picked once at run time. The row code (losses/cross_entropy_rows.inc) is bound by
// the throughput of its vectorised fp32 exp; the baseline x86-64 build (SSE2) runs it 4 wide,
// the AVX2 + FMA build 8 wide. Both are compiled with -ffp-contract=off and the code
// never reassociates, so both builds give the same bits (checked by
// cross_entropy_rows_test); only the speed differs.
//
// GRADSUM_CE_ISA=generic in the environment forces the baseline build (for comparison).

#include <cstdint>

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

struct CeRowKernels {
  CeRowF32Fn f32 = nullptr;
  CeRowBf16Fn bf16 = nullptr;
  const char* isa = "";  // "generic" or "avx2+fma"
};

namespace rows_generic {
CeRowKernels Kernels();
}  // namespace rows_generic

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
namespace rows_avx2 {
// Only call through SelectedCeRowKernels (the CPU must support AVX2 and FMA).
CeRowKernels Kernels();
}  // namespace rows_avx2
#endif

// The build for this CPU, chosen once: AVX2 + FMA when the CPU has both (and
// GRADSUM_CE_ISA is not "generic"), else the baseline build.
const CeRowKernels& SelectedCeRowKernels();

}  // namespace gradsum::losses::internal

#endif  // GRADSUM_LOSSES_CROSS_ENTROPY_ROWS_H_
