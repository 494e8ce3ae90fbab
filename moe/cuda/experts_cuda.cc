#include "moe/cuda/experts_cuda.h"

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"
#include "moe/cuda/layers_cuda.h"

namespace gradsum::moe {
namespace {

using cuda::CheckDevicePointer;

absl::Status CheckConfig(const ExpertsCudaConfig& c, absl::Span<const int64_t> offsets) {
  if (c.d_model < 1 || c.hidden < 1 || c.num_local_experts < 1) {
    return absl::InvalidArgumentError(absl::StrCat("experts: D = ", c.d_model, ", H = ", c.hidden,
                                                   ", local experts = ", c.num_local_experts,
                                                   " must all be >= 1"));
  }
  if (c.dtype != DType::kF32 && c.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts: dtype must be f32 or bf16, got ", DTypeName(c.dtype)));
  }
  if (offsets.size() != static_cast<size_t>(c.num_local_experts) + 1 || offsets[0] != 0) {
    return absl::InvalidArgumentError(absl::StrCat("experts: offsets must have ",
                                                   c.num_local_experts + 1,
                                                   " entries starting at 0, got ", offsets.size()));
  }
  for (int j = 0; j < c.num_local_experts; ++j) {
    if (offsets[j + 1] < offsets[j]) {
      return absl::InvalidArgumentError(absl::StrCat("experts: offsets decrease at expert ", j,
                                                     " (", offsets[j], " > ", offsets[j + 1], ")"));
    }
  }
  return absl::OkStatus();
}

// Byte address of row `row` of a [*, cols] matrix of `dtype`.
const void* At(const void* base, int64_t row, int64_t cols, DType dtype) {
  return static_cast<const char*>(base) + row * cols * static_cast<int64_t>(DTypeSize(dtype));
}
void* At(void* base, int64_t row, int64_t cols, DType dtype) {
  return static_cast<char*>(base) + row * cols * static_cast<int64_t>(DTypeSize(dtype));
}

}  // namespace

absl::Status ExpertsForwardCuda(const cuda::CublasHandle& blas, cudaStream_t stream,
                                const ExpertsCudaConfig& c, const ExpertsCudaWeights& w,
                                const void* x, absl::Span<const int64_t> offsets, void* y,
                                const ExpertsCudaSaved& saved) {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  GRADSUM_RETURN_IF_ERROR(CheckConfig(c, offsets));
  const int64_t D = c.d_model, H = c.hidden, N = offsets.back();
  if (N == 0) return absl::OkStatus();
  for (const auto& [p, name] : {std::pair<const void*, const char*>{x, "x"},
                                {y, "y"},
                                {w.gate, "gate weight"},
                                {w.up, "up weight"},
                                {w.down, "down weight"},
                                {saved.gate_pre, "saved.gate_pre"},
                                {saved.up_pre, "saved.up_pre"},
                                {saved.hidden, "saved.hidden"}}) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(p, name));
  }
  const DType t = c.dtype;
  for (int j = 0; j < c.num_local_experts; ++j) {
    const int64_t begin = offsets[j], rows = offsets[j + 1] - offsets[j];
    if (rows == 0) continue;
    const void* xj = At(x, begin, D, t);
    GRADSUM_RETURN_IF_ERROR(cuda::GemmRowMajor(blas, stream, false, false, rows, H, D, xj, D,
                                               At(w.gate, j * D, H, t), H, t,
                                               At(saved.gate_pre, begin, H, t), H, t, 0.0f));
    GRADSUM_RETURN_IF_ERROR(cuda::GemmRowMajor(blas, stream, false, false, rows, H, D, xj, D,
                                               At(w.up, j * D, H, t), H, t,
                                               At(saved.up_pre, begin, H, t), H, t, 0.0f));
  }
  SwiGluArgs s;
  s.dtype = t;
  s.n = N * H;
  s.gate = saved.gate_pre;
  s.up = saved.up_pre;
  s.out = saved.hidden;
  GRADSUM_RETURN_IF_ERROR(SwiGluForwardCuda(s, stream));
  for (int j = 0; j < c.num_local_experts; ++j) {
    const int64_t begin = offsets[j], rows = offsets[j + 1] - offsets[j];
    if (rows == 0) continue;
    GRADSUM_RETURN_IF_ERROR(
        cuda::GemmRowMajor(blas, stream, false, false, rows, D, H, At(saved.hidden, begin, H, t), H,
                           At(w.down, j * H, D, t), D, t, At(y, begin, D, t), D, t, 0.0f));
  }
  return absl::OkStatus();
}

absl::Status ExpertsBackwardCuda(const cuda::CublasHandle& blas, cudaStream_t stream,
                                 const ExpertsCudaConfig& c, const ExpertsCudaWeights& w,
                                 const void* x, absl::Span<const int64_t> offsets,
                                 const ExpertsCudaSaved& saved, const void* dy, void* dx,
                                 const ExpertsCudaWeightGrads& g) {
  GRADSUM_RETURN_IF_ERROR(cuda::RequireCudaDevice());
  GRADSUM_RETURN_IF_ERROR(CheckConfig(c, offsets));
  const int64_t D = c.d_model, H = c.hidden, N = offsets.back();
  if (N == 0) return absl::OkStatus();
  for (const auto& [p, name] : {std::pair<const void*, const char*>{x, "x"},
                                {dy, "dy"},
                                {dx, "dx"},
                                {w.gate, "gate weight"},
                                {w.up, "up weight"},
                                {w.down, "down weight"},
                                {g.gate, "gate grad"},
                                {g.up, "up grad"},
                                {g.down, "down grad"},
                                {saved.gate_pre, "saved.gate_pre"},
                                {saved.up_pre, "saved.up_pre"},
                                {saved.hidden, "saved.hidden"}}) {
    GRADSUM_RETURN_IF_ERROR(CheckDevicePointer(p, name));
  }
  if (dx == dy) return absl::InvalidArgumentError("experts backward: dx must not alias dy");
  const DType t = c.dtype;
  // Per expert: dWd += hidden^T dy (before hidden is overwritten), then d_hidden = dy Wd^T
  // into saved.hidden.
  for (int j = 0; j < c.num_local_experts; ++j) {
    const int64_t begin = offsets[j], rows = offsets[j + 1] - offsets[j];
    if (rows == 0) continue;
    void* hid = At(saved.hidden, begin, H, t);
    const void* dyj = At(dy, begin, D, t);
    GRADSUM_RETURN_IF_ERROR(cuda::GemmRowMajor(blas, stream, true, false, H, D, rows, hid, H, dyj,
                                               D, t, g.down + j * H * D, D, DType::kF32, 1.0f));
    GRADSUM_RETURN_IF_ERROR(cuda::GemmRowMajor(blas, stream, false, true, rows, H, D, dyj, D,
                                               At(w.down, j * H, D, t), D, t, hid, H, t, 0.0f));
  }
  // SwiGLU backward in place: d_gate_pre into gate_pre, d_up_pre into up_pre.
  SwiGluArgs s;
  s.dtype = t;
  s.n = N * H;
  s.gate = saved.gate_pre;
  s.up = saved.up_pre;
  s.d_out = saved.hidden;
  s.d_gate = saved.gate_pre;
  s.d_up = saved.up_pre;
  GRADSUM_RETURN_IF_ERROR(SwiGluBackwardCuda(s, stream));
  for (int j = 0; j < c.num_local_experts; ++j) {
    const int64_t begin = offsets[j], rows = offsets[j + 1] - offsets[j];
    if (rows == 0) continue;
    const void* xj = At(x, begin, D, t);
    const void* dg = At(saved.gate_pre, begin, H, t);
    const void* du = At(saved.up_pre, begin, H, t);
    GRADSUM_RETURN_IF_ERROR(cuda::GemmRowMajor(blas, stream, true, false, D, H, rows, xj, D, dg, H,
                                               t, g.gate + j * D * H, H, DType::kF32, 1.0f));
    GRADSUM_RETURN_IF_ERROR(cuda::GemmRowMajor(blas, stream, true, false, D, H, rows, xj, D, du, H,
                                               t, g.up + j * D * H, H, DType::kF32, 1.0f));
    void* dxj = At(dx, begin, D, t);
    GRADSUM_RETURN_IF_ERROR(cuda::GemmRowMajor(blas, stream, false, true, rows, D, H, dg, H,
                                               At(w.gate, j * D, H, t), H, t, dxj, D, t, 0.0f));
    GRADSUM_RETURN_IF_ERROR(cuda::GemmRowMajor(blas, stream, false, true, rows, D, H, du, H,
                                               At(w.up, j * D, H, t), H, t, dxj, D, t, 1.0f));
  }
  return absl::OkStatus();
}

}  // namespace gradsum::moe
