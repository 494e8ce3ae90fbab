// Sharding benchmarks: the optimizer update and the per-micro-batch reduce-scatter +
// fp32 accumulation, beside BM_Memcpy (the memory-bandwidth limit) in the same run.
//
//   ./bazelw run -c opt //bench:sharding_bench -- --benchmark_min_time=0.1
//
// Bytes reported:
// - BM_AdamWStep: memory traffic, 28 bytes per element (reads p, g, m, v; writes p, m, v).
// - BM_ReduceGradSharded: the full fp32 gradient bytes each rank contributes per call.
// - BM_Memcpy: bytes copied (traffic is twice that: each byte read once, written once).

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "bench/memcpy_bench.h"
#include "benchmark/benchmark.h"
#include "collectives/thread_backend.h"
#include "optim/adamw.h"
#include "parallel/flat_param.h"

namespace gradsum::bench {
namespace {

void BM_AdamWStep(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto comms = CreateThreadCommunicators(1);
  auto fp = FlatParam::Create("g", {{"w", {n}}}, (*comms)[0].get());
  for (float& g : (*fp)->master_grad()) g = 1e-3f;
  auto opt = ShardedAdamW::Create({fp->get()}, {.lr = 1e-4, .weight_decay = 0.1});
  for (auto _ : state) {
    if (!(*opt)->Step().ok()) state.SkipWithError("step failed");
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n * 28);
}

// Communicators shared by the benchmark threads of one world size (created once).
Communicator* SharedComm(int world, int rank) {
  static std::mutex mu;
  static auto* comms = new std::map<int, std::vector<std::unique_ptr<Communicator>>>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = comms->find(world);
  if (it == comms->end()) {
    it = comms->emplace(world, std::move(*CreateThreadCommunicators(world))).first;
  }
  return it->second[rank].get();
}

// One rank per benchmark thread: each call reduce-scatters (SUM) a full fp32 gradient of
// n elements over the thread backend and adds the shard into the fp32 accumulator.
// range(1): 0 fp32, 1 bf16, 2 exact (int64 limbs, 16 bytes per element on the wire, plus
// the normalisation before and after; SEMANTICS.md §11).
void BM_ReduceGradSharded(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int world = state.threads();
  FlatParamOptions opts;
  constexpr GradPrecision kPrecisions[] = {GradPrecision::kF32, GradPrecision::kBF16Wire,
                                           GradPrecision::kExact};
  opts.precision = kPrecisions[state.range(1)];
  auto fp = FlatParam::Create("g", {{"w", {n}}}, SharedComm(world, state.thread_index()), opts);
  // One untimed call first: the receive buffers are allocated (and their pages first
  // touched) on the first reduction, which single-iteration runs would otherwise time.
  if (!(*fp)->ReduceGrad(false).ok()) state.SkipWithError("reduce failed");
  for (auto _ : state) {
    if (!(*fp)->ReduceGrad(false).ok()) state.SkipWithError("reduce failed");
  }
  state.SetBytesProcessed(state.iterations() * n * 4);
  const char* const kLabels[] = {"f32", "bf16", "exact"};
  state.SetLabel(kLabels[state.range(1)]);
}

BENCHMARK(BM_Memcpy)->Arg(4 << 20)->Arg(64 << 20);
BENCHMARK(BM_AdamWStep)->Arg(1 << 20)->Arg(16 << 20);
BENCHMARK(BM_ReduceGradSharded)
    ->Args({1 << 20, 0})
    ->Args({1 << 20, 1})
    ->Args({1 << 20, 2})
    ->Args({16 << 20, 0})
    ->Args({4 << 20, 2})
    ->Args({16 << 20, 2})
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
