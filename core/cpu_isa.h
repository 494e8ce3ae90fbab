#ifndef GRADSUM_CORE_CPU_ISA_H_
#define GRADSUM_CORE_CPU_ISA_H_

// Run-time choice between builds of one kernel source for different instruction sets
// (no -march anywhere: the builds set their target by pragma, core/isa_build.inc).
//
// A kernel source is compiled three times: the baseline ("generic"), "avx2" (AVX2 + FMA)
// and "avx512" (AVX-512 F/BW/VL/DQ, 512-bit vectors; these two only on x86-64). Each
// library exposes a `const Kernels* KernelsFor(const char* isa)` that returns null for a
// build this CPU cannot run (IsaBuilds), and picks one build per process with PickIsaBuild:
//
//   const VecKernels* VecKernelsFor(const char* isa) {
//     static const IsaBuilds<VecKernels> builds(GRADSUM_ISA_BUILDS(internal::vec, Kernels));
//     return builds.For(isa);
//   }
//   const VecKernels& SelectedVecKernels() {
//     static const VecKernels& k = PickIsaBuild<VecKernels>("GRADSUM_VEC_ISA", &VecKernelsFor);
//     return k;
//   }
//
// The kernels built this way use no FP contraction and never reassociate, so every build
// gives the same bits (each library's tests compare them); the choice changes speed only,
// and ranks on different CPUs still agree.

#include <cstdlib>
#include <cstring>
#include <initializer_list>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GRADSUM_ISA_X86 1
#define GRADSUM_ISA_TARGET_AVX2 "avx2,fma"
#if defined(__clang__)
#define GRADSUM_ISA_TARGET_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"
#else
#define GRADSUM_ISA_TARGET_AVX512 \
  "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512"
#endif
// For single functions of an "avx512" build that use AVX-512 BF16's instructions (a target
// attribute, called only where CpuHasAvx512Bf16()).
#define GRADSUM_ISA_TARGET_AVX512_BF16 GRADSUM_ISA_TARGET_AVX512 ",avx512bf16"
#endif

// The table makers of a kernel library's three builds, `prefix`_generic::`fn`,
// `prefix`_avx2::`fn` and `prefix`_avx512::`fn` (the last two null off x86-64, where they
// are not built), as IsaBuilds' constructor takes them.
#if defined(GRADSUM_ISA_X86)
#define GRADSUM_ISA_BUILDS(prefix, fn) \
  &prefix##_generic::fn, &prefix##_avx2::fn, &prefix##_avx512::fn
#else
#define GRADSUM_ISA_BUILDS(prefix, fn) &prefix##_generic::fn, nullptr, nullptr
#endif

namespace gradsum {

// Whether this CPU runs the "avx2" build (AVX2 and FMA), and the "avx512" build (AVX-512
// F, BW, VL and DQ, and AVX2 + FMA). False off x86-64.
bool CpuHasAvx2Fma();
bool CpuHasAvx512();
// Whether it also has AVX-512 BF16 (bf16 conversions and dot products), which an "avx512"
// build may use in a function of its own, chosen at run time. False off x86-64.
bool CpuHasAvx512Bf16();

// The kernel tables of one library's builds, each made once, and the one a name selects.
template <typename Kernels>
class IsaBuilds {
 public:
  using Make = Kernels (*)();
  // `avx2` and `avx512` are null where those builds do not exist (GRADSUM_ISA_BUILDS).
  // A wider build's table is made only on a CPU that runs it: its maker is compiled for
  // that target too, and may itself use the wider instructions (filling a larger table).
  IsaBuilds(Make generic, Make avx2, Make avx512)
      : has_avx2_(avx2 != nullptr && CpuHasAvx2Fma()),
        has_avx512_(avx512 != nullptr && CpuHasAvx512()),
        generic_(generic()),
        avx2_(has_avx2_ ? avx2() : Kernels{}),
        avx512_(has_avx512_ ? avx512() : Kernels{}) {}
  // The build named "generic", "avx2" or "avx512"; null for another name or a build this
  // CPU cannot run.
  const Kernels* For(const char* isa) const {
    if (std::strcmp(isa, "generic") == 0) return &generic_;
    if (std::strcmp(isa, "avx2") == 0) return has_avx2_ ? &avx2_ : nullptr;
    if (std::strcmp(isa, "avx512") == 0) return has_avx512_ ? &avx512_ : nullptr;
    return nullptr;
  }

 private:
  bool has_avx2_, has_avx512_;  // first: the tables below are made only where true
  Kernels generic_, avx2_, avx512_;
};

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
