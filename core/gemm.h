#ifndef GRADSUM_CORE_GEMM_H_
#define GRADSUM_CORE_GEMM_H_

// Row-major fp32 GEMM through the system BLAS (OpenBLAS, which picks its kernel for the CPU
// at run time; no -march here). Every matrix product of the CPU compute path goes through
// it; Eigen stays for elementwise work only.
//
//   C = alpha * op(A) * op(B) + beta * C       op(A): [m, k], op(B): [k, n], C: [m, n]
//
//   // y[n, d] = act[n, h] * Wd[h, d]
//   GRADSUM_RETURN_IF_ERROR(Sgemm(Trans::kNo, Trans::kNo, n, d, h, 1.0f, act, h, wd, d,
//                                 0.0f, y, d));
//   // dW[d, h] += x^T[d, n] * dg[n, h], split over 2 threads
//   GRADSUM_RETURN_IF_ERROR(Sgemm(Trans::kYes, Trans::kNo, d, h, n, 1.0f, x, d, dg, h,
//                                 1.0f, dw, h, /*num_threads=*/2));
//
// A is stored [m, k] (kNo) or [k, m] (kYes) with row stride lda; B is stored [k, n] or
// [n, k] with row stride ldb; C is [m, n] with row stride ldc. beta = 0 overwrites C
// (whatever it held, NaN included). k = 0 gives C = beta * C. A product with k = 1,
// alpha = 1 and beta 0 or 1 (a rank-one update: every element one product) is computed
// here directly rather than through the BLAS driver, with the same bits.
//
// Threads: BLAS itself always runs single-threaded (its own thread pool is switched off
// on first use, so it never competes with the ranks' threads). num_threads > 1 splits C
// into up to num_threads bands (rows, or columns when C is wider than tall) run as
// single-threaded BLAS calls on the shared ThreadPool (core/thread_pool.h).

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace gradsum {

enum class Trans { kNo, kYes };

// InvalidArgument (naming the operand and the values) for negative sizes, a leading
// dimension smaller than the stored row, a span shorter than the strided extent, sizes
// beyond the BLAS's 32-bit integers, or C overlapping A or B.
absl::Status Sgemm(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   absl::Span<const float> a, int64_t lda, absl::Span<const float> b, int64_t ldb,
                   float beta, absl::Span<float> c, int64_t ldc, int num_threads = 1);

// The name of the kernel the BLAS chose for this CPU (e.g. "Haswell"), for benchmark logs.
const char* BlasCoreName();

}  // namespace gradsum

#endif  // GRADSUM_CORE_GEMM_H_
