#ifndef GRADSUM_BENCH_GPU_BENCH_MAIN_H_
#define GRADSUM_BENCH_GPU_BENCH_MAIN_H_

// The main() of the GPU benchmark binaries: without a usable GPU it prints why and returns
// 77 (skipped, nothing measured) instead of reporting numbers for nothing.
//
//   int main(int argc, char** argv) { return gradsum::bench::GpuBenchmarkMain("gpu_bench", argc,
//   argv); }

#include <cstdio>
#include <string>

#include "benchmark/benchmark.h"
#include "core/cuda/cuda_status.h"

namespace gradsum::bench {

inline int GpuBenchmarkMain(const char* name, int argc, char** argv) {
  const absl::Status device = cuda::RequireCudaDevice();
  if (!device.ok()) {
    std::fprintf(stderr, "%s: skipped, nothing measured: %s\n", name,
                 std::string(device.message()).c_str());
    return 77;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace gradsum::bench

#endif  // GRADSUM_BENCH_GPU_BENCH_MAIN_H_
