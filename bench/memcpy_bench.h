#ifndef GRADSUM_BENCH_MEMCPY_BENCH_H_
#define GRADSUM_BENCH_MEMCPY_BENCH_H_

// BM_Memcpy: the memory-bandwidth limit that every suite reports beside its own numbers,
// so ratios are measured side by side in one run on this shared, noisy machine.
//
// Include in a suite's .cc and register sizes there:
//   BENCHMARK(gradsum::bench::BM_Memcpy)->Arg(64 << 20);

#include <cstddef>
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"

namespace gradsum::bench {

// Copies state.range(0) bytes per iteration; reports bytes/s of data copied (each byte
// is read once and written once).
inline void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

}  // namespace gradsum::bench

#endif  // GRADSUM_BENCH_MEMCPY_BENCH_H_
