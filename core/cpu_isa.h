#ifndef GRADSUM_CORE_CPU_ISA_H_
#define GRADSUM_CORE_CPU_ISA_H_

// Run-time choice between builds of one kernel source for different instruction sets
// (no -march anywhere: the builds set their target by pragma, core/isa_build.inc).
//
// A kernel source is compiled three times: the baseline ("generic"), "avx2" (AVX2 + FMA)
// and "avx512" (AVX-512 F/BW/VL/DQ, 512-bit vectors). Each library exposes a
// `const Kernels* KernelsFor(const char* isa)` that returns null for a build this CPU
// cannot run, and picks one build per process with PickIsaBuild:
//
//   const VecKernels& SelectedVecKernels() {
//     static const VecKernels& k = PickIsaBuild<VecKernels>("GRADSUM_VEC_ISA", &VecKernelsFor);
//     return k;
//   }
//
// The kernels built this way use no FP contraction and never reassociate, so every build
// gives the same bits (each library's tests compare them); the choice changes speed only,
// and ranks on different CPUs still agree.

#include <cstdlib>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GRADSUM_ISA_X86 1
#define GRADSUM_ISA_TARGET_AVX2 "avx2,fma"
#if defined(__clang__)
#define GRADSUM_ISA_TARGET_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"
#else
#define GRADSUM_ISA_TARGET_AVX512 \
  "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512"
#endif
#endif

namespace gradsum {

// Whether this CPU runs the "avx2" build (AVX2 and FMA), and the "avx512" build (AVX-512
// F, BW, VL and DQ, and AVX2 + FMA). False off x86-64.
bool CpuHasAvx2Fma();
bool CpuHasAvx512();

// The build a process uses: the one `env_var` names ("generic", "avx2", "avx512") if set
// and this CPU runs it, else the widest this CPU runs. `kernels_for` must return non-null
// for "generic".
template <typename Kernels>
const Kernels& PickIsaBuild(const char* env_var, const Kernels* (*kernels_for)(const char*)) {
  if (const char* forced = std::getenv(env_var); forced != nullptr) {
    if (const Kernels* k = kernels_for(forced); k != nullptr) return *k;
  }
  for (const char* isa : {"avx512", "avx2"}) {
    if (const Kernels* k = kernels_for(isa); k != nullptr) return *k;
  }
  return *kernels_for("generic");
}

}  // namespace gradsum

#endif  // GRADSUM_CORE_CPU_ISA_H_
