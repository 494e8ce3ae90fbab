// Collectives benchmarks. The collectives issue adds the all-reduce suites here;
// BM_Memcpy is the physical limit they are compared against in the same run.
#include "bench/memcpy_bench.h"

BENCHMARK(gradsum::bench::BM_Memcpy)->RangeMultiplier(16)->Range(4 << 10, 256 << 20);

BENCHMARK_MAIN();
