#include "core/exact_add.h"

#include <string>

namespace gradsum::exact::internal {

const AddKernels* AddKernelsFor(const char* isa) {
  static const AddKernels generic = exact_add_generic::Kernels();
  const std::string name = isa;
  if (name == "generic") return &generic;
#if defined(GRADSUM_ISA_X86)
  static const AddKernels avx2 = exact_add_avx2::Kernels();
  static const AddKernels avx512 = exact_add_avx512::Kernels();
  if (name == "avx2" && CpuHasAvx2Fma()) return &avx2;
  if (name == "avx512" && CpuHasAvx512()) return &avx512;
#endif
  return nullptr;
}

const AddKernels& SelectedAddKernels() {
  static const AddKernels& kernels =
      PickIsaBuild<AddKernels>("GRADSUM_EXACT_ISA", &AddKernelsFor);
  return kernels;
}

}  // namespace gradsum::exact::internal
