#ifndef GRADSUM_LOSSES_CROSS_ENTROPY_ROWS_H_
#define GRADSUM_LOSSES_CROSS_ENTROPY_ROWS_H_

// Internal: the row code of the fused CPU cross-entropy, built for three instruction sets
// and picked once at run time. The row code (losses/cross_entropy_rows.inc) is bound by the
// throughput of its vectorised fp32 exp (core/fast_exp.inc); the baseline x86-64 build
// (SSE2) runs it 4 wide, the AVX2 + FMA build 8 wide, the AVX-512 build 16 wide. All are
// compiled with -ffp-contract=off, the code never reassociates, and the exp's explicit fused
// multiply-adds round once in every build (FMA instructions, or an exact emulation in the
// baseline build), so every build gives the same bits (checked by cross_entropy_rows_test);
// only the speed differs.
//
// GRADSUM_CE_ISA in the environment forces a build (for comparison): "generic", "avx2" or
// "avx512" (a build the CPU cannot run falls back to the best one it can).

#include <cstdint>

#include "core/cpu_isa.h"

namespace gradsum::losses::internal {

// Per-row outcome, kept per row so the first bad row is reported whatever the threading.
// kRowSmoothNegInf: a -inf logit with label smoothing (the CE options path, §3.2, only).
enum RowCode : uint8_t {
  kRowOk = 0,
  kRowNaN,
  kRowPosInf,
  kRowAllNegInf,
  kRowTargetNegInf,
  kRowSmoothNegInf
};

inline constexpr int64_t kCeTile = 1024;  // floats per tile: 4 KiB, stays in L1

// Per-thread scratch for a block of rows with a gradient: two rows' exp values
// ([2 * vocab]) and two rows' tile reference maxes ([2 * ceil(vocab / kCeTile)]); one half
// holds the row being read, the other the row whose gradient is being written under it.
struct RowScratchView {
  float* exps = nullptr;
  float* tile_ref = nullptr;
};

// A block of `rows` rows of fused CE forward (+ backward when grad is non-null; it may alias
// logits), row r at logits + r * vocab, with labels[r] in [0, vocab) and weights[r] >= 0, d > 0.
// Per row: codes[r] = a RowCode; loss[r] = w * (logsumexp(row) - row[label]) on kRowOk, else
// 0; the gradient row = (w / d) * (softmax(row) - onehot(label)) on kRowOk, zeros where
// w == 0 (no forward), left as it was on any other code. The logits are read once: each row's
// exps are kept in the scratch and its gradient written from them while the next row of the
// block is read. `scratch` is only used with a gradient.
using CeRowsF32Fn = void (*)(const float* logits, float* grad, int64_t rows, int64_t vocab,
                             const int64_t* labels, const float* weights, double d,
                             const RowScratchView* scratch, double* loss, uint8_t* codes);
using CeRowsBf16Fn = void (*)(const uint16_t* logits, uint16_t* grad, int64_t rows, int64_t vocab,
                              const int64_t* labels, const float* weights, double d,
                              const RowScratchView* scratch, double* loss, uint8_t* codes);

// The per-row gradient scale of the scaled row kernels (the policy loss's hook into the CE
// rows, losses/policy_loss.h, so that it needs no second softmax): `fn` is called once per
// row of non-zero weight whose forward succeeded (kRowOk), before that row's gradient is
// written, with the row's index in the block and its CE value logsumexp(row) - row[label]
// in fp64 (= -log p_label); it returns the scale s of that gradient row,
// s * (softmax(row) - onehot(label)), and may record per-row values through `ctx` (each
// block has its own ctx, so no locking). The row's loss[r] stays w * CE as without a hook.
struct RowScaleHook {
  float (*fn)(void* ctx, int64_t row, double ce) = nullptr;
  void* ctx = nullptr;
};
// As CeRowsF32Fn / CeRowsBf16Fn, with the gradient scale taken from `hook` (non-null)
// instead of w / d; `d` is not used.
using CeRowsScaledF32Fn = void (*)(const float* logits, float* grad, int64_t rows, int64_t vocab,
                                   const int64_t* labels, const float* weights, double d,
                                   const RowScratchView* scratch, double* loss, uint8_t* codes,
                                   const RowScaleHook* hook);
using CeRowsScaledBf16Fn = void (*)(const uint16_t* logits, uint16_t* grad, int64_t rows,
                                    int64_t vocab, const int64_t* labels, const float* weights,
                                    double d, const RowScratchView* scratch, double* loss,
                                    uint8_t* codes, const RowScaleHook* hook);
// The rows' bf16 <-> fp32 conversions, n elements: widening is exact; narrowing rounds to
// nearest even and keeps NaN a quiet NaN, bit for bit as BF16::FromFloat (core/half.h).
using Bf16ToF32Fn = void (*)(const uint16_t* in, float* out, int64_t n);
using F32ToBf16Fn = void (*)(const float* in, uint16_t* out, int64_t n);

// Vocab-parallel CE (losses/vocab_parallel_ce.cc, SEMANTICS.md §3.1), f32 shards only.
//
// The local pass over a block of `rows` shard rows of `vocab` (>= 0) columns, before the
// exchange: for each row with weights[r] != 0, row_max[r] = the shard's max (-inf if the
// shard holds no finite value, or no column), row_sum[r] = sum of exp(x - row_max) over
// the shard (fp32 tiles, fp64 across them, online as the CE rows), target[r] =
// x[local_labels[r]] if local_labels[r] >= 0 (the label is in this shard) else 0, and, if
// row_zsum is non-null, row_zsum[r] = the sum of the row's values. codes[r]: kRowOk,
// kRowNaN or kRowPosInf. With `exps` non-null (it may alias logits), each row's exp values
// are kept there (row r at exps + r * vocab) relative to per-tile maxes kept in tile_ref
// (row r at tile_ref + r * ceil(vocab / kCeTile)), for VpGradRowsF32Fn. Rows of weight 0
// are not read (outputs 0, max -inf).
using VpLocalRowsF32Fn = void (*)(const float* logits, float* exps, float* tile_ref, int64_t rows,
                                  int64_t vocab, const float* weights, const int64_t* local_labels,
                                  float* row_max, double* row_sum, double* row_zsum, float* target,
                                  uint8_t* codes);
// One row's gradient after the exchange: grad_j = scale * exp(x_j - lse) + offset, with
// lse = global_max + log_sum, and grad[local_label] = target_grad if local_label >= 0.
// scale == 0 and offset == 0: the row is zeroed but for the target (weight 0 rows have
// local_label -1).
struct VpGradRow {
  double scale = 0.0;
  float global_max = 0.0f;
  double log_sum = 0.0;
  float offset = 0.0f;
  int64_t local_label = -1;
  float target_grad = 0.0f;
};
// Writes the gradient of a block of rows in place over the exps VpLocalRowsF32Fn kept.
using VpGradRowsF32Fn = void (*)(float* grad, const float* tile_ref, int64_t rows, int64_t vocab,
                                 const VpGradRow* params);

struct CeRowKernels {
  CeRowsF32Fn f32 = nullptr;
  CeRowsBf16Fn bf16 = nullptr;
  Bf16ToF32Fn bf16_to_f32 = nullptr;
  F32ToBf16Fn f32_to_bf16 = nullptr;
  const char* isa = "";  // "generic", "avx2+fma", "avx512" or "avx512+bf16"
  CeRowsScaledF32Fn f32_scaled = nullptr;
  CeRowsScaledBf16Fn bf16_scaled = nullptr;
  VpLocalRowsF32Fn vp_local_f32 = nullptr;
  VpGradRowsF32Fn vp_grad_f32 = nullptr;
};

namespace rows_generic {
CeRowKernels Kernels();
}  // namespace rows_generic

#if defined(GRADSUM_ISA_X86)
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
