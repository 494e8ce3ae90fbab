#include "core/cuda/gemm.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"

namespace gradsum::cuda {

CublasHandle::~CublasHandle() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

CublasHandle::CublasHandle(CublasHandle&& o) noexcept
    : handle_(std::exchange(o.handle_, nullptr)) {}

CublasHandle& CublasHandle::operator=(CublasHandle&& o) noexcept {
  if (this != &o) {
    if (handle_ != nullptr) cublasDestroy(handle_);
    handle_ = std::exchange(o.handle_, nullptr);
  }
  return *this;
}

absl::StatusOr<CublasHandle> CublasHandle::Create() {
  GRADSUM_RETURN_IF_ERROR(RequireCudaDevice());
  CublasHandle h;
  GRADSUM_RETURN_IF_ERROR(CublasStatusToStatus(cublasCreate(&h.handle_), "cublasCreate"));
  return h;
}

namespace {

cudaDataType_t CudaType(DType t) { return t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

absl::Status CheckInt32(int64_t v, const char* name) {
  if (v < 0 || v > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMM ", name, " = ", v, " is outside [0, 2^31) (cuBLAS int32 limit)"));
  }
  return absl::OkStatus();
}

absl::Status CheckLd(int64_t ld, int64_t cols, const char* name) {
  GRADSUM_RETURN_IF_ERROR(CheckInt32(ld, name));
  if (ld < std::max<int64_t>(cols, 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMM ", name, " = ", ld, " is smaller than the row length ", cols));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status GemmRowMajor(const CublasHandle& handle, cudaStream_t stream, const GemmArgs& g) {
  if (handle.get() == nullptr) return absl::FailedPreconditionError("GEMM: cuBLAS handle is empty");
  GRADSUM_RETURN_IF_ERROR(CheckInt32(g.m, "m"));
  GRADSUM_RETURN_IF_ERROR(CheckInt32(g.n, "n"));
  GRADSUM_RETURN_IF_ERROR(CheckInt32(g.k, "k"));
  if (g.a_dtype != g.b_dtype || (g.a_dtype != DType::kF32 && g.a_dtype != DType::kBF16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMM: A and B must both be f32 or both bf16, got ", DTypeName(g.a_dtype),
                     " and ", DTypeName(g.b_dtype)));
  }
  if (g.c_dtype != DType::kF32 && !(g.c_dtype == DType::kBF16 && g.a_dtype == DType::kBF16)) {
    return absl::InvalidArgumentError(absl::StrCat("GEMM: C dtype ", DTypeName(g.c_dtype),
                                                   " is not supported with A/B ",
                                                   DTypeName(g.a_dtype)));
  }
  GRADSUM_RETURN_IF_ERROR(CheckLd(g.lda, g.trans_a ? g.m : g.k, "lda"));
  GRADSUM_RETURN_IF_ERROR(CheckLd(g.ldb, g.trans_b ? g.k : g.n, "ldb"));
  GRADSUM_RETURN_IF_ERROR(CheckLd(g.ldc, g.n, "ldc"));
  if (g.m == 0 || g.n == 0) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(g.c, "GEMM C"));
  if (g.k > 0) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(g.a, "GEMM A"));
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(g.b, "GEMM B"));
  }
  GRADSUM_RETURN_IF_ERROR(
      CublasStatusToStatus(cublasSetStream(handle.get(), stream), "cublasSetStream"));
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  const cublasComputeType_t compute = (g.a_dtype == DType::kF32 && g.allow_tf32)
                                          ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : CUBLAS_COMPUTE_32F;
  return CublasStatusToStatus(
      cublasGemmEx(handle.get(), g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                   g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(g.n),
                   static_cast<int>(g.m), static_cast<int>(g.k), &g.alpha, g.b, CudaType(g.b_dtype),
                   static_cast<int>(g.ldb), g.a, CudaType(g.a_dtype), static_cast<int>(g.lda),
                   &g.beta, g.c, CudaType(g.c_dtype), static_cast<int>(g.ldc), compute,
                   CUBLAS_GEMM_DEFAULT),
      absl::StrCat("cublasGemmEx m=", g.m, " n=", g.n, " k=", g.k));
}

absl::Status GemmRowMajor(const CublasHandle& handle, cudaStream_t stream, bool trans_a,
                          bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                          const void* b, int64_t ldb, DType in, void* c, int64_t ldc, DType out,
                          float beta) {
  GemmArgs g;
  g.trans_a = trans_a;
  g.trans_b = trans_b;
  g.m = m;
  g.n = n;
  g.k = k;
  g.beta = beta;
  g.a = a;
  g.a_dtype = in;
  g.lda = lda;
  g.b = b;
  g.b_dtype = in;
  g.ldb = ldb;
  g.c = c;
  g.c_dtype = out;
  g.ldc = ldc;
  return GemmRowMajor(handle, stream, g);
}

}  // namespace gradsum::cuda
