#include "core/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "core/thread_pool.h"

namespace gradsum {
namespace {

// Stored extent of a row-major [rows, cols] matrix with row stride ld.
int64_t Extent(int64_t rows, int64_t cols, int64_t ld) {
  return rows == 0 || cols == 0 ? 0 : (rows - 1) * ld + cols;
}

absl::Status CheckOperand(const char* name, size_t size, int64_t rows, int64_t cols, int64_t ld) {
  if (ld < std::max<int64_t>(cols, 1) || ld > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: leading dimension of ", name, " is ", ld,
                                                   "; needs ", std::max<int64_t>(cols, 1),
                                                   " <= ld <= ", INT_MAX));
  }
  const int64_t need = Extent(rows, cols, ld);
  if (static_cast<int64_t>(size) < need) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: ", name, " holds ", size, " floats; [",
                                                   rows, ", ", cols, "] with ld ", ld, " needs ",
                                                   need));
  }
  return absl::OkStatus();
}

bool Overlap(const float* a, int64_t na, const float* b, int64_t nb) {
  return na > 0 && nb > 0 && a < b + nb && b < a + na;
}

void DisableBlasThreads() {
  // OpenBLAS's own threads would oversubscribe the cores the ranks already use.
  static const bool done = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)done;
}

CBLAS_TRANSPOSE Cblas(Trans t) { return t == Trans::kYes ? CblasTrans : CblasNoTrans; }

// C = op(A) op(B) + beta C for k = 1, alpha = 1, beta 0 or 1: each element is one product,
// so there is nothing to block; the BLAS driver would still zero C (beta = 0), pack both
// operands and run its kernel, three passes over C where one does. Same bits as the BLAS:
// its kernel starts each element from +0 (so the product's -0 becomes +0) and adds it to C
// (zeroed for beta = 0), c = round(c + (round(a b) + 0)); core/gemm_test compares the two.
// A's element i is a[i * a_step], B's element j is b[j * b_step].
void RankOneUpdate(int64_t m, int64_t n, const float* a, int64_t a_step, const float* b,
                   int64_t b_step, bool beta_zero, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    const float ai = a[i * a_step];
    float* ci = c + i * ldc;
    if (beta_zero) {
      for (int64_t j = 0; j < n; ++j) ci[j] = 0.0f + (ai * b[j * b_step] + 0.0f);
    } else {
      for (int64_t j = 0; j < n; ++j) ci[j] += ai * b[j * b_step] + 0.0f;
    }
  }
}

}  // namespace

absl::Status Sgemm(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   absl::Span<const float> a, int64_t lda, absl::Span<const float> b, int64_t ldb,
                   float beta, absl::Span<float> c, int64_t ldc, int num_threads) {
  if (m < 0 || n < 0 || k < 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: sizes m=", m, ", n=", n, ", k=", k, " must be in [0, ", INT_MAX, "]"));
  }
  const bool ta = trans_a == Trans::kYes, tb = trans_b == Trans::kYes;
  absl::Status s = CheckOperand(ta ? "A^T" : "A", a.size(), ta ? k : m, ta ? m : k, lda);
  if (s.ok()) s = CheckOperand(tb ? "B^T" : "B", b.size(), tb ? n : k, tb ? k : n, ldb);
  if (s.ok()) s = CheckOperand("C", c.size(), m, n, ldc);
  if (!s.ok()) return s;
  const int64_t c_extent = Extent(m, n, ldc);
  if (Overlap(c.data(), c_extent, a.data(), Extent(ta ? k : m, ta ? m : k, lda)) ||
      Overlap(c.data(), c_extent, b.data(), Extent(tb ? n : k, tb ? k : n, ldb))) {
    return absl::InvalidArgumentError("gemm: C overlaps A or B");
  }
  if (m == 0 || n == 0) return absl::OkStatus();
  DisableBlasThreads();

  // Bands of C: rows when C is at least as tall as wide, else columns; each band at least
  // kMinBand wide so that the BLAS kernel still runs full tiles.
  constexpr int64_t kMinBand = 32;
  const bool by_rows = m >= n;
  const int64_t extent = by_rows ? m : n;
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(std::max(num_threads, 1), extent / kMinBand));
  const bool rank_one = k == 1 && alpha == 1.0f && (beta == 0.0f || beta == 1.0f);
  auto band = [&](int64_t p) {
    const int64_t begin = extent * p / parts;
    const int64_t size = extent * (p + 1) / parts - begin;
    const float* ap = a.data();
    const float* bp = b.data();
    float* cp = c.data();
    int64_t bm = m, bn = n;
    if (by_rows) {
      ap += ta ? begin : begin * lda;
      cp += begin * ldc;
      bm = size;
    } else {
      bp += tb ? begin * ldb : begin;
      cp += begin;
      bn = size;
    }
    if (rank_one) {
      RankOneUpdate(bm, bn, ap, ta ? 1 : lda, bp, tb ? ldb : 1, beta == 0.0f, cp, ldc);
      return;
    }
    cblas_sgemm(CblasRowMajor, Cblas(trans_a), Cblas(trans_b), static_cast<int>(bm),
                static_cast<int>(bn), static_cast<int>(k), alpha, ap, static_cast<int>(lda), bp,
                static_cast<int>(ldb), beta, cp, static_cast<int>(ldc));
  };
  ParallelFor(static_cast<int>(parts), parts, band);
  return absl::OkStatus();
}

const char* BlasCoreName() { return openblas_get_corename(); }

}  // namespace gradsum
