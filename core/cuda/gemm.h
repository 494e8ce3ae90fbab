#ifndef GRADSUM_CORE_CUDA_GEMM_H_
#define GRADSUM_CORE_CUDA_GEMM_H_

// Row-major GEMMs through cuBLAS (cublasGemmEx) with fp32 accumulation, for the dense
// layers of moe_lm on the GPU (router logits, LM head, expert projections).
//
//   GRADSUM_ASSIGN_OR_RETURN(CublasHandle blas, CublasHandle::Create());
//   // logits[T, V] = h[T, D] @ Wo[D, V]   (bf16 in, fp32 accumulate, bf16 out)
//   GemmArgs g;
//   g.m = T; g.n = V; g.k = D;
//   g.a = h;  g.a_dtype = DType::kBF16; g.lda = D;
//   g.b = wo; g.b_dtype = DType::kBF16; g.ldb = V;
//   g.c = logits; g.c_dtype = DType::kBF16; g.ldc = V;
//   GRADSUM_RETURN_IF_ERROR(GemmRowMajor(blas, stream, g));
//
// Computes C = alpha * op(A) @ op(B) + beta * C with every matrix row-major:
// op(A) is [m, k] (A stored [m, k], or [k, m] when trans_a), op(B) is [k, n] (B stored
// [k, n], or [n, k] when trans_b), C is [m, n]. Leading dimensions are row strides in
// elements. Backward passes use the transposes: dA = dC @ B^T (trans_b), dB = A^T @ dC
// (trans_a), with beta = 1 to accumulate.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace gradsum::cuda {

// Owns a cuBLAS handle (move-only).
class CublasHandle {
 public:
  CublasHandle() = default;
  ~CublasHandle();
  CublasHandle(CublasHandle&& o) noexcept;
  CublasHandle& operator=(CublasHandle&& o) noexcept;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;

  // FailedPrecondition where no usable device exists.
  static absl::StatusOr<CublasHandle> Create();
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

struct GemmArgs {
  bool trans_a = false;  // A is stored [k, m]
  bool trans_b = false;  // B is stored [n, k]
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  float beta = 0.0f;  // 0: C is only written (its old contents may be garbage)
  const void* a = nullptr;
  DType a_dtype = DType::kF32;  // kF32 or kBF16; must equal b_dtype
  int64_t lda = 0;              // >= stored columns of A
  const void* b = nullptr;
  DType b_dtype = DType::kF32;
  int64_t ldb = 0;
  void* c = nullptr;
  DType c_dtype = DType::kF32;  // kF32, or kBF16 when A and B are bf16
  int64_t ldc = 0;              // >= n
  // f32 inputs: allow TF32 tensor cores (10-bit mantissa products). Off by default so
  // f32 GEMMs match a CPU reference to fp32 rounding.
  bool allow_tf32 = false;
};

// Enqueues the GEMM on `stream`. Errors: InvalidArgument for negative sizes, sizes or
// leading dimensions beyond int32 (cuBLAS's limit) or too small, an unsupported dtype
// combination, or a null / non-device pointer (named); FailedPrecondition without a GPU;
// other cuBLAS failures as CublasStatusToStatus. m, n or k == 0 is a no-op except that
// k == 0 scales C by beta (cuBLAS semantics).
absl::Status GemmRowMajor(const CublasHandle& handle, cudaStream_t stream, const GemmArgs& args);

// Shorthand for the common case alpha = 1: C[m, n] = op(A) op(B) + beta * C with A and B
// of dtype `in` and C of dtype `out`. Same checks and errors.
absl::Status GemmRowMajor(const CublasHandle& handle, cudaStream_t stream, bool trans_a,
                          bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                          const void* b, int64_t ldb, DType in, void* c, int64_t ldc, DType out,
                          float beta = 0.0f);

}  // namespace gradsum::cuda

#endif  // GRADSUM_CORE_CUDA_GEMM_H_
