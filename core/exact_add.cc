#include "core/exact_add.h"

namespace gradsum::exact::internal {

const AddKernels* AddKernelsFor(const char* isa) {
  static const IsaBuilds<AddKernels> builds(GRADSUM_ISA_BUILDS(exact_add, Kernels));
  return builds.For(isa);
}

const AddKernels& SelectedAddKernels() {
  static const AddKernels& kernels = PickIsaBuild<AddKernels>("GRADSUM_EXACT_ISA", &AddKernelsFor);
  return kernels;
}

}  // namespace gradsum::exact::internal
