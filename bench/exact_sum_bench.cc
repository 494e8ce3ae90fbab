// Exact-sum conversion costs (core/exact_sum.h, reproducible mode) beside BM_Memcpy (the
// memory-bandwidth limit) and the fp32 accumulation it replaces, in the same run.
//
//   ./bazelw build -c opt //bench:exact_sum_bench && bazel-bin/bench/exact_sum_bench
//
// items_per_second counts elements. Rows:
// - BM_Memcpy/N: N bytes copied (N = 4 * elements for the fp32 buffers below).
// - BM_F32Accumulate: acc[i] += x[i] in fp32 (what the normal mode does per contribution).
// - BM_ExactAddFloats: exact::AddFloats, x[i] into 2 int64 limbs (16 bytes per element).
// - BM_ExactNormalize: canonical form of the limbs (once per micro-batch per element).
// - BM_ExactToFloats: limbs back to fp32 (once per step per owned element).
// - BM_ExactSquares: ExactScalar::AddSquares (the exact grad norm, per owned element).

#include <cstdint>
#include <random>
#include <vector>

#include "bench/memcpy_bench.h"
#include "benchmark/benchmark.h"
#include "core/exact_sum.h"

namespace gradsum::bench {
namespace {

std::vector<float> Values(int64_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 1e-3f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void BM_F32Accumulate(benchmark::State& state) {
  const int64_t n = state.range(0);
  const std::vector<float> x = Values(n);
  std::vector<float> acc(n, 0.0f);
  for (auto _ : state) {
    for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
    benchmark::DoNotOptimize(acc.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
}

void BM_ExactAddFloats(benchmark::State& state) {
  const int64_t n = state.range(0);
  const std::vector<float> x = Values(n);
  std::vector<int64_t> limbs(n * exact::kLimbs, 0);
  int64_t rejected = 0;
  for (auto _ : state) {
    if (!exact::AddFloats(x, absl::MakeSpan(limbs), &rejected).ok()) state.SkipWithError("add");
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
}

// Limbs holding the sum of 8 copies of Values(n) (not normalised).
std::vector<int64_t> SummedLimbs(int64_t n) {
  const std::vector<float> x = Values(n);
  std::vector<int64_t> limbs(n * exact::kLimbs, 0);
  int64_t rejected = 0;
  for (int k = 0; k < 8; ++k) (void)exact::AddFloats(x, absl::MakeSpan(limbs), &rejected);
  return limbs;
}

void BM_ExactNormalize(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<int64_t> limbs = SummedLimbs(n);
  for (auto _ : state) {
    if (!exact::Normalize(absl::MakeSpan(limbs)).ok()) state.SkipWithError("normalize");
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
}

void BM_ExactToFloats(benchmark::State& state) {
  const int64_t n = state.range(0);
  const std::vector<int64_t> limbs = SummedLimbs(n);
  std::vector<float> out(n);
  for (auto _ : state) {
    if (!exact::ToFloats(limbs, 0, absl::MakeSpan(out)).ok()) state.SkipWithError("to floats");
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
}

void BM_ExactSquares(benchmark::State& state) {
  const int64_t n = state.range(0);
  const std::vector<float> x = Values(n);
  for (auto _ : state) {
    exact::ExactScalar s;
    s.AddSquares(x);
    benchmark::DoNotOptimize(s.words().data());
  }
  state.SetItemsProcessed(state.iterations() * n);
}

constexpr int64_t kN = 1 << 20;  // 4 MiB of fp32, 16 MiB of limbs
BENCHMARK(BM_Memcpy)->Arg(4 * kN)->Arg(16 * kN);
BENCHMARK(BM_F32Accumulate)->Arg(kN);
BENCHMARK(BM_ExactAddFloats)->Arg(kN);
BENCHMARK(BM_ExactNormalize)->Arg(kN);
BENCHMARK(BM_ExactToFloats)->Arg(kN);
BENCHMARK(BM_ExactSquares)->Arg(kN);

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
