#ifndef GRADSUM_COLLECTIVES_REDUCE_KERNELS_H_
#define GRADSUM_COLLECTIVES_REDUCE_KERNELS_H_

// Element-wise reduction of W same-typed buffers: the arithmetic of the CPU backends.
//
//   // out = a + b + c, summed in that order, rounded once into bf16.
//   std::vector<const void*> srcs = {a, b, c};
//   std::vector<void*> dsts = {out};
//   ReduceInto(DType::kBF16, ReduceOp::kSum, srcs, n, dsts);
//
// Semantics (SEMANTICS.md §7), which make results deterministic and independent of who
// computes them:
// - sources are combined in the order given (callers pass ascending rank order);
// - bf16/f16 accumulate in fp32 and round once; f32 in f32; f64 in f64;
// - i32/i64 SUM wraps modulo 2^32 / 2^64 (no undefined overflow); AVG needs a floating
//   dtype (the caller checks); AVG is the SUM divided by the number of sources;
// - MAX propagates NaN; otherwise it returns one of the inputs exactly.
// The result is rounded once and stored into every destination, 64 elements at a time. A
// destination may equal a source (in place); otherwise destinations must not overlap the
// sources or each other.

#include <cstddef>

#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/dtype.h"

namespace gradsum {

// Precondition: srcs non-empty, dsts non-empty, every pointer valid for n elements,
// op valid for dtype (kAvg only for floating dtypes).
void ReduceInto(DType dtype, ReduceOp op, absl::Span<const void* const> srcs, size_t n,
                absl::Span<void* const> dsts);

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_REDUCE_KERNELS_H_
