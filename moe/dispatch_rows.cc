#include "moe/dispatch_rows.h"

namespace gradsum::moe::internal {

const RowKernels* RowKernelsFor(const char* isa) {
  static const IsaBuilds<RowKernels> builds(GRADSUM_ISA_BUILDS(dispatch_rows, Kernels));
  return builds.For(isa);
}

const RowKernels& SelectedRowKernels() {
  static const RowKernels& kernels =
      PickIsaBuild<RowKernels>("GRADSUM_DISPATCH_ISA", &RowKernelsFor);
  return kernels;
}

}  // namespace gradsum::moe::internal
