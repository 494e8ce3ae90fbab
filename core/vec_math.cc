#include "core/vec_math.h"

#include "core/cpu_isa.h"

namespace gradsum::vec {

const VecKernels* VecKernelsFor(const char* isa) {
  static const IsaBuilds<VecKernels> builds(GRADSUM_ISA_BUILDS(internal::vec, Kernels));
  return builds.For(isa);
}

const VecKernels& SelectedVecKernels() {
  static const VecKernels& kernels = PickIsaBuild<VecKernels>("GRADSUM_VEC_ISA", &VecKernelsFor);
  return kernels;
}

}  // namespace gradsum::vec
