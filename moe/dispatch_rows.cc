#include "moe/dispatch_rows.h"

#include <string>

namespace gradsum::moe::internal {

const RowKernels* RowKernelsFor(const char* isa) {
  static const RowKernels generic = dispatch_rows_generic::Kernels();
  const std::string name = isa;
  if (name == "generic") return &generic;
#if defined(GRADSUM_ISA_X86)
  static const RowKernels avx2 = dispatch_rows_avx2::Kernels();
  static const RowKernels avx512 = dispatch_rows_avx512::Kernels();
  if (name == "avx2" && CpuHasAvx2Fma()) return &avx2;
  if (name == "avx512" && CpuHasAvx512()) return &avx512;
#endif
  return nullptr;
}

const RowKernels& SelectedRowKernels() {
  static const RowKernels& kernels =
      PickIsaBuild<RowKernels>("GRADSUM_DISPATCH_ISA", &RowKernelsFor);
  return kernels;
}

}  // namespace gradsum::moe::internal
