#ifndef GRADSUM_CORE_GRAD_PRECISION_H_
#define GRADSUM_CORE_GRAD_PRECISION_H_

// How a run's gradients are held, summed and reported: one choice, made once (the trainer
// takes it from --reduce_dtype and --reproducible) and handed to everything that depends on
// it: the units' gradient storage and reductions (parallel/unit_grad.h), the row blocks the
// compute is asked for (model/model_params.h), the grad norm and the display.
//
//   GradPrecision p = reproducible ? GradPrecision::kExact
//                     : reduce_bf16 ? GradPrecision::kBF16Wire : GradPrecision::kF32;
//   FlatParamOptions o;  o.precision = p;          // the units
//   losses::StepDisplay display(L, E, p);          // exact display sums when IsExact(p)
//
// What each implies:
// - kF32: fp32 local gradients, summed as f32, fp32 reduced gradients; the display and the
//   grad norm sum in fp64.
// - kBF16Wire: as kF32, but each SUM collective carries the gradients rounded to bf16 (a
//   real SUM of bf16 inputs, accumulated in fp32 by the CPU backends and rounded once,
//   SEMANTICS.md §7), added into fp32 accumulators. Half the bytes.
// - kExact: exact fixed-point limbs (core/exact_sum.h, SEMANTICS.md §11): local gradients
//   are int64 limbs, the SUMs carry them as i64 (16 bytes per element) beside a rejected
//   contribution count, and the reduced gradient is rounded once to fp32 per step. The
//   compute hands one row block per packed sequence; the display and the grad norm sum
//   exactly (IsExact below).

#include "core/dtype.h"

namespace gradsum {

enum class GradPrecision {
  kF32 = 0,
  kBF16Wire = 1,
  kExact = 2,
};

// "f32", "bf16_wire", "exact"; "invalid" for a value outside the enum.
const char* GradPrecisionName(GradPrecision p);

// True for the three values above (a cast integer may be none of them).
bool IsValidGradPrecision(GradPrecision p);

// The dtype the gradient's SUM collectives carry: kF32, kBF16, or kI64 (the exact limbs,
// exact::kLimbs words per element).
DType GradWireDType(GradPrecision p);

// Exact precision: every sum over sequences, micro-batches and ranks is an integer sum, so
// the result has the same bits at every mesh. It asks the compute for one row block per
// packed sequence (so that a contribution does not depend on its neighbours) and makes the
// display terms and the grad norm exact sums too, so the logs agree bit for bit.
constexpr bool IsExact(GradPrecision p) { return p == GradPrecision::kExact; }

}  // namespace gradsum

#endif  // GRADSUM_CORE_GRAD_PRECISION_H_
