#include "core/vec_math.h"

#include <string>

#include "core/cpu_isa.h"

namespace gradsum::vec {

const VecKernels* VecKernelsFor(const char* isa) {
  static const VecKernels generic = internal::vec_generic::Kernels();
  const std::string name = isa;
  if (name == "generic") return &generic;
#if defined(GRADSUM_ISA_X86)
  static const VecKernels avx2 = internal::vec_avx2::Kernels();
  static const VecKernels avx512 = internal::vec_avx512::Kernels();
  if (name == "avx2" && CpuHasAvx2Fma()) return &avx2;
  if (name == "avx512" && CpuHasAvx512()) return &avx512;
#endif
  return nullptr;
}

const VecKernels& SelectedVecKernels() {
  static const VecKernels& kernels = PickIsaBuild<VecKernels>("GRADSUM_VEC_ISA", &VecKernelsFor);
  return kernels;
}

}  // namespace gradsum::vec
