// Proves that Google Benchmark links and runs: one tiny benchmark, run for a few
// iterations; the test fails if it did not run.
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "benchmark/benchmark.h"

static int g_runs = 0;

static void BM_Smoke(benchmark::State& state) {
  for (auto _ : state) {
    int x = 1;
    benchmark::DoNotOptimize(x += 1);
  }
  ++g_runs;
}
BENCHMARK(BM_Smoke)->Iterations(10);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  size_t ran = benchmark::RunSpecifiedBenchmarks();
  if (ran != 1 || g_runs == 0) {
    std::cerr << "expected one benchmark to run, ran " << ran << "\n";
    return 1;
  }
  return 0;
}
