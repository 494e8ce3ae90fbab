// The CPU attention kernel (model/attention.h) against the BLAS GEMM rate measured in the
// same run (issue 29: forward + backward at >= 50% of it, counting useful FLOPs).
//
//   ./bazelw run -c opt //bench:attention_bench -- --benchmark_min_time=1
//
// BM_Attention/T/kv_heads/threads: one sequence of T tokens, 8 query heads of 64, kv_heads
//   8 or 2 (GQA), packed with four documents of random lengths (fixed seed; mean T/4;
//   the label lists them), forward then backward on `threads` threads
//   (ScopedComputeThreads). Useful FLOPs count only the visible (query, key) pairs,
//   P = 8 heads x sum over documents of n (n + 1) / 2: forward 4 P d (q k^T and p v),
//   backward 8 P d (d_out v^T, p^T d_out, ds^T q, ds k; the recomputed q k^T is not
//   counted), 12 P d in all. GFLOP_per_s = 12 P d / time; fwd_ / bwd_GFLOP_per_s the
//   two directions alone.
//   gemm_GFLOP_per_s: the BLAS (core/gemm.h) rate on the same number of threads, a
//   [1024, 1024] x [1024, 1024] product (BLAS's best shape here), measured once per thread
//   count in this run; gemm_1core_GFLOP_per_s the same on one thread; pct_of_gemm =
//   GFLOP_per_s / gemm_GFLOP_per_s (all wall-clock).
//   On this shared machine the wall-clock rates are mostly the share of the cores the run
//   got, so the same ratio per CPU second is reported too: cpu_GFLOP_per_s = useful FLOPs
//   per second of process CPU time, gemm_cpu_GFLOP_per_s likewise for the GEMM on the same
//   threads, cpu_pct_of_gemm their ratio (how well a core-second is used, whatever the
//   load).
// BM_BlockProduct/variant: the kernel's block product, c[64, 64] = a[64, 64] b[64, 64],
//   through the BLAS (0: a b, 1: a b^T as q k^T, 2: a^T b as p^T d_out) and through the
//   attention's own micro-kernel (3, the build this CPU picks): why the kernel does not
//   call the BLAS at these sizes.
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmark/benchmark.h"
#include "core/gemm.h"
#include "core/random.h"
#include "core/thread_pool.h"
#include "model/attention.h"
#include "model/attention_kernels.h"

namespace gradsum::bench {
namespace {

constexpr int kQHeads = 8;
constexpr int64_t kHeadDim = 64;
constexpr int64_t kLimitSize = 1024;  // the limit GEMM: [n, n] x [n, n]

// Seconds of CPU time used by this process (all its threads).
double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Rate {
  double wall = 0;  // GFLOP per wall-clock second
  double cpu = 0;   // GFLOP per second of process CPU time
};

// The [n, n] x [n, n] BLAS GEMM on `threads` threads, timed over >= `seconds`.
Rate GemmGflops(int threads, double seconds) {
  const int64_t n = kLimitSize;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  int64_t reps = 0;
  const double cpu_start = ProcessCpuSeconds();
  const absl::Time start = absl::Now();
  absl::Duration elapsed;
  do {
    (void)Sgemm(Trans::kNo, Trans::kNo, n, n, n, 1.0f, a, n, b, n, 0.0f, absl::MakeSpan(c), n,
                threads);
    ++reps;
    elapsed = absl::Now() - start;
  } while (elapsed < absl::Seconds(seconds));
  const double cpu_s = ProcessCpuSeconds() - cpu_start;
  benchmark::DoNotOptimize(c.data());
  const double gflop = 2.0 * n * n * n * reps / 1e9;
  return {gflop / absl::ToDoubleSeconds(elapsed), gflop / cpu_s};
}

// Measured once per thread count per run (first use).
Rate LimitGflops(int threads) {
  static Rate rate[64] = {};
  threads = std::clamp(threads, 1, 63);
  if (rate[threads].wall == 0) rate[threads] = GemmGflops(threads, 1.0);
  return rate[threads];
}

// Four documents of random lengths (mean exactly len / 4): cut at three distinct random
// points of (0, len). Returns doc_start; `lengths` gets the lengths.
std::vector<int32_t> RandomDocuments(int64_t len, uint64_t seed, std::vector<int64_t>* lengths) {
  SplitMix64 rng(MixSeed(seed, static_cast<uint64_t>(len)));
  std::vector<int64_t> cuts = {0, len};
  while (cuts.size() < 5) {
    const int64_t c = 1 + static_cast<int64_t>(rng.Below(static_cast<uint64_t>(len - 1)));
    if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<int32_t> ds;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    lengths->push_back(cuts[i + 1] - cuts[i]);
    for (int64_t t = cuts[i]; t < cuts[i + 1]; ++t) ds.push_back(static_cast<int32_t>(cuts[i]));
  }
  return ds;
}

std::vector<float> RandomFloats(size_t n, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.Normal());
  return v;
}

void BM_Attention(benchmark::State& state) {
  const int64_t len = state.range(0);
  const int kv_heads = static_cast<int>(state.range(1));
  const int threads = static_cast<int>(state.range(2));
  model::AttentionDims dims;
  dims.num_seqs = 1;
  dims.seq_len = len;
  dims.q_heads = kQHeads;
  dims.kv_heads = kv_heads;
  dims.head_dim = kHeadDim;
  std::vector<int64_t> lengths;
  const std::vector<int32_t> ds = RandomDocuments(len, 29, &lengths);
  double pairs = 0;
  for (int64_t n : lengths) pairs += 0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
  pairs *= kQHeads;
  const int64_t q_size = len * kQHeads * kHeadDim, kv_size = len * kv_heads * kHeadDim;
  const std::vector<float> q = RandomFloats(q_size, 1), k = RandomFloats(kv_size, 2),
                           v = RandomFloats(kv_size, 3), d_out = RandomFloats(q_size, 4);
  std::vector<float> out(q_size), lse(len * kQHeads), dq(q_size), dk(kv_size), dv(kv_size);
  const Rate limit = LimitGflops(threads);  // before the timed loop
  const Rate limit_1core = LimitGflops(1);
  ScopedComputeThreads budget(threads);
  double fwd_s = 0, bwd_s = 0, cpu_s = 0;
  for (auto _ : state) {
    const double cpu0 = ProcessCpuSeconds();
    const absl::Time t0 = absl::Now();
    absl::Status s =
        model::AttentionForward(dims, q, k, v, ds, absl::MakeSpan(out), absl::MakeSpan(lse));
    const absl::Time t1 = absl::Now();
    if (s.ok()) {
      s = model::AttentionBackward(dims, q, k, v, ds, out, lse, d_out, absl::MakeSpan(dq),
                                   absl::MakeSpan(dk), absl::MakeSpan(dv));
    }
    const absl::Time t2 = absl::Now();
    cpu_s += ProcessCpuSeconds() - cpu0;
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      return;
    }
    fwd_s += absl::ToDoubleSeconds(t1 - t0);
    bwd_s += absl::ToDoubleSeconds(t2 - t1);
    state.SetIterationTime(absl::ToDoubleSeconds(t2 - t0));
    benchmark::DoNotOptimize(dv.data());
  }
  const double iters = static_cast<double>(state.iterations());
  const double fwd_flops = 4 * pairs * kHeadDim, bwd_flops = 8 * pairs * kHeadDim;
  const double rate = (fwd_flops + bwd_flops) * iters / (fwd_s + bwd_s) / 1e9;
  state.counters["GFLOP_per_s"] = rate;
  state.counters["fwd_GFLOP_per_s"] = fwd_flops * iters / fwd_s / 1e9;
  state.counters["bwd_GFLOP_per_s"] = bwd_flops * iters / bwd_s / 1e9;
  state.counters["gemm_GFLOP_per_s"] = limit.wall;
  state.counters["gemm_1core_GFLOP_per_s"] = limit_1core.wall;
  state.counters["pct_of_gemm"] = 100 * rate / limit.wall;
  const double cpu_rate = (fwd_flops + bwd_flops) * iters / cpu_s / 1e9;
  state.counters["cpu_GFLOP_per_s"] = cpu_rate;
  state.counters["gemm_cpu_GFLOP_per_s"] = limit.cpu;
  state.counters["cpu_pct_of_gemm"] = 100 * cpu_rate / limit.cpu;
  std::string docs;
  for (int64_t n : lengths) absl::StrAppend(&docs, docs.empty() ? "" : "+", n);
  state.SetLabel(absl::StrCat(model::internal::SelectedAttentionKernels().isa, " docs ", docs));
}
BENCHMARK(BM_Attention)
    ->ArgNames({"T", "kv_heads", "threads"})
    ->ArgsProduct({{1024, 4096}, {8, 2}, {1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

void BM_BlockProduct(benchmark::State& state) {
  const int variant = static_cast<int>(state.range(0));
  const int64_t n = model::internal::kAttentionBlock;
  const std::vector<float> a = RandomFloats(n * n, 5), b = RandomFloats(n * n, 6);
  std::vector<float> c(n * n);
  const model::internal::AttentionKernels& kernels = model::internal::SelectedAttentionKernels();
  for (auto _ : state) {
    absl::Status s;
    switch (variant) {
      case 0:
        s = Sgemm(Trans::kNo, Trans::kNo, n, n, n, 1.0f, a, n, b, n, 0.0f, absl::MakeSpan(c), n);
        break;
      case 1:
        s = Sgemm(Trans::kNo, Trans::kYes, n, n, n, 1.0f, a, n, b, n, 0.0f, absl::MakeSpan(c), n);
        break;
      case 2:
        s = Sgemm(Trans::kYes, Trans::kNo, n, n, n, 1.0f, a, n, b, n, 0.0f, absl::MakeSpan(c), n);
        break;
      default:
        kernels.product(n, n, n, a.data(), n, b.data(), n, c.data(), n);
    }
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP_per_s"] = benchmark::Counter(
      2.0 * n * n * n * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
  const char* names[] = {"BLAS a b", "BLAS a b^T", "BLAS a^T b", ""};
  state.SetLabel(variant < 3 ? std::string(names[variant])
                             : absl::StrCat("micro-kernel ", kernels.isa));
}
BENCHMARK(BM_BlockProduct)->Arg(0)->Arg(1)->Arg(2)->Arg(3);

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
