// Loss-kernel benchmarks (issue: losses). Run with
//   ./bazelw run -c opt //bench:losses_bench -- --benchmark_min_time=0.1
//
// BM_CrossEntropyFused<T>/N/V    the fused CE forward+backward (losses/cross_entropy.h)
// BM_CrossEntropyNaive<T>/N/V    log-softmax materialised in fp32, then NLL backward: max,
//                                 sum(exp), write logp, read logp to write the gradient (libm exp)
// BM_PolicyLossFused<T>/N/V      the fused RL policy loss forward+backward (losses/policy_loss.h,
//                                 SEMANTICS §13: clip, dual clip, IS weights, k3 KL), the same
//                                 logits and counters as BM_CrossEntropyFused; target (issue 33)
//                                 within 1.3x of CE's time. Side by side:
//   --benchmark_filter='BM_(CrossEntropy|PolicyLoss)Fused<float>/(1024|4096)/32768'
// BM_Memcpy/<bytes>              the bandwidth limit, same bytes as one [N, V] logits buffer
// Counters: `bytes_per_second` counts the 3-pass byte count 3 * N * V * sizeof(T) (read for
// max+sum, read again and write the gradient); `frac_of_memcpy_limit` = (time the 3-pass
// bytes take at the memcpy bandwidth measured inside the same benchmark) / (time taken).
//
// BM_FusedLinearCE/N/D/V          chunked hidden @ head + CE + both gradients
// BM_MatmulThenFusedCE/N/D/V      full [N, V] logits GEMM, fused CE in place, then the two
//                                 gradient GEMMs (same Eigen GEMMs, same threads)
// Counter `peak_extra_bytes`: the peak heap growth during one call, measured by the
// malloc/free interposer below (every allocation of the process, Eigen's included).
//
// BM_VocabParallelVsUnsharded/T/R  (issue 34) per-rank time of the vocab-parallel CE
//                                 (losses/vocab_parallel_ce.h) forward+backward at group
//                                 size 2 (two thread-backend ranks, each with a [T, V/2] f32
//                                 shard, V = 131072) against the unsharded fused CE on the
//                                 full [T, V], alternating in every iteration so both see the
//                                 same machine load. ONE thread per rank and one thread for
//                                 the unsharded kernel (fair per-rank comparison: each rank
//                                 of a TP group gets its own core). R = rows per exchange
//                                 (0 = automatic, T = all rows in one MAX + SUM).
//                                 Counters: medians of the unsharded call, of the slower
//                                 rank's call, and their ratio (target <= 0.6).
#include <malloc.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "Eigen/Core"
#include "bench/memcpy_bench.h"
#include "benchmark/benchmark.h"
#include "collectives/communicator.h"
#include "collectives/thread_backend.h"
#include "core/half.h"
#include "core/tensor.h"
#include "losses/cross_entropy.h"
#include "losses/linear_cross_entropy.h"
#include "losses/parallel.h"
#include "losses/policy_loss.h"
#include "losses/vocab_parallel_ce.h"

// ---- Heap accounting: glibc's allocator behind a counting interposer. ----
extern "C" {
void* __libc_malloc(size_t);
void __libc_free(void*);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
}

namespace {
std::atomic<int64_t> g_heap_bytes{0};
std::atomic<int64_t> g_heap_peak{0};

void* Track(void* p) {
  if (p != nullptr) {
    const int64_t now = g_heap_bytes.fetch_add(static_cast<int64_t>(malloc_usable_size(p))) +
                        static_cast<int64_t>(malloc_usable_size(p));
    int64_t peak = g_heap_peak.load(std::memory_order_relaxed);
    while (now > peak && !g_heap_peak.compare_exchange_weak(peak, now)) {
    }
  }
  return p;
}
void Untrack(void* p) {
  if (p != nullptr) g_heap_bytes.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)));
}

// Peak heap growth above the current level while `fn` runs.
template <typename Fn>
int64_t PeakExtraBytes(const Fn& fn) {
  const int64_t base = g_heap_bytes.load();
  g_heap_peak.store(base);
  fn();
  return g_heap_peak.load() - base;
}
}  // namespace

extern "C" {
void* malloc(size_t n) { return Track(__libc_malloc(n)); }
void free(void* p) {
  Untrack(p);
  __libc_free(p);
}
void* calloc(size_t a, size_t b) { return Track(__libc_calloc(a, b)); }
void* realloc(void* p, size_t n) {
  Untrack(p);
  void* q = __libc_realloc(p, n);
  if (q == nullptr && n != 0) Track(p);  // failed: p still owned
  return Track(q);
}
void* memalign(size_t a, size_t n) { return Track(__libc_memalign(a, n)); }
void* aligned_alloc(size_t a, size_t n) { return Track(__libc_memalign(a, n)); }
int posix_memalign(void** out, size_t a, size_t n) {
  void* p = __libc_memalign(a, n);
  if (p == nullptr) return 12;  // ENOMEM
  *out = Track(p);
  return 0;
}
}

namespace gradsum::bench {
namespace {

using losses::CrossEntropyForwardBackward;

template <typename T>
DType DTypeOf();
template <>
DType DTypeOf<float>() {
  return DType::kF32;
}
template <>
DType DTypeOf<BF16>() {
  return DType::kBF16;
}

template <typename T>
T FromFloat(float x);
template <>
float FromFloat<float>(float x) {
  return x;
}
template <>
BF16 FromFloat<BF16>(float x) {
  return BF16::FromFloat(x);
}
inline float AsFloat(float x) { return x; }
inline float AsFloat(BF16 x) { return x.ToFloat(); }

struct CeProblem {
  int64_t n, v;
  std::vector<int64_t> labels;
};

template <typename T>
std::vector<T> RandomLogits(int64_t n, int64_t v) {
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<T> z(static_cast<size_t>(n * v));
  for (T& e : z) e = FromFloat<T>(dist(rng));
  return z;
}

std::vector<int64_t> RandomLabels(int64_t n, int64_t v) {
  std::mt19937 rng(2);
  std::uniform_int_distribution<int64_t> cls(0, v - 1);
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (int64_t& e : y) e = cls(rng);
  return y;
}

// Wall and process-CPU clocks. This machine is shared (load ~7x its 2 cores), so wall
// time mostly measures the scheduler; process CPU time (all threads) is reported beside it.
struct Clock {
  double wall = 0.0, cpu = 0.0;
  static Clock Now() {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return {
        std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(),
        static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec)};
  }
  Clock operator-(const Clock& o) const { return {wall - o.wall, cpu - o.cpu}; }
  Clock& operator+=(const Clock& o) {
    wall += o.wall;
    cpu += o.cpu;
    return *this;
  }
};

// Memcpy bandwidth (bytes copied per second, by wall and by CPU time) of `bytes`, best of a
// few copies, measured inside the benchmark so the ratio is side by side with the kernel.
Clock MemcpyBytesPerSecond(size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  Clock best{1e30, 1e30};
  for (int i = 0; i < 5; ++i) {
    const Clock t0 = Clock::Now();
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
    const Clock dt = Clock::Now() - t0;
    best.wall = std::min(best.wall, dt.wall);
    best.cpu = std::min(best.cpu, dt.cpu);
  }
  return {static_cast<double>(bytes) / best.wall, static_cast<double>(bytes) / best.cpu};
}

// `spent`: wall and CPU time of the timed calls, measured by the benchmark itself.
void ReportCeCounters(benchmark::State& state, int64_t n, int64_t v, size_t elem,
                      const Clock& spent) {
  const double logits_bytes = static_cast<double>(n * v) * static_cast<double>(elem);
  const double three_pass = 3.0 * logits_bytes;
  const Clock memcpy_rate = MemcpyBytesPerSecond(static_cast<size_t>(logits_bytes));
  // A memcpy of B bytes moves 2B (read + write): the 3-pass count at that bandwidth takes
  // three_pass / (2 * rate) seconds.
  const double iters = static_cast<double>(state.iterations());
  state.counters["frac_limit_wall"] = three_pass / (2.0 * memcpy_rate.wall) * iters / spent.wall;
  state.counters["frac_limit_cpu"] = three_pass / (2.0 * memcpy_rate.cpu) * iters / spent.cpu;
  state.counters["GBps_wall"] = three_pass * iters / spent.wall / 1e9;
  state.counters["GBps_cpu"] = three_pass * iters / spent.cpu / 1e9;
  state.counters["memcpy_GBps_wall"] = memcpy_rate.wall / 1e9;
  state.counters["memcpy_GBps_cpu"] = memcpy_rate.cpu / 1e9;
}

template <typename T>
void BM_CrossEntropyFused(benchmark::State& state) {
  const int64_t n = state.range(0), v = state.range(1);
  std::vector<T> z = RandomLogits<T>(n, v);
  std::vector<T> grad(z.size());
  const std::vector<int64_t> y = RandomLabels(n, v);
  const TensorView zv = *TensorView::Create(z.data(), DTypeOf<T>(), {n, v});
  const TensorView gv = *TensorView::Create(grad.data(), DTypeOf<T>(), {n, v});
  Clock spent;
  for (auto _ : state) {
    const Clock t0 = Clock::Now();
    auto r = CrossEntropyForwardBackward(zv, y, {}, static_cast<double>(n), gv);
    spent += Clock::Now() - t0;
    if (!r.ok()) {
      state.SkipWithError(std::string(r.status().message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(r->local_loss);
    benchmark::ClobberMemory();
  }
  ReportCeCounters(state, n, v, sizeof(T), spent);
}

// The unfused path: log-softmax written out in fp32, loss read from it, then the NLL
// backward reads it again to write the gradient. Same threads and row blocks as the fused.
template <typename T>
void BM_CrossEntropyNaive(benchmark::State& state) {
  const int64_t n = state.range(0), v = state.range(1);
  std::vector<T> z = RandomLogits<T>(n, v);
  std::vector<T> grad(z.size());
  std::vector<float> logp(z.size());
  const std::vector<int64_t> y = RandomLabels(n, v);
  const double d = static_cast<double>(n);
  std::vector<double> row_loss(static_cast<size_t>(n));
  Clock spent;
  for (auto _ : state) {
    const Clock t0 = Clock::Now();
    losses::ParallelFor(2, n, [&](int64_t t) {
      const T* x = z.data() + t * v;
      float* lp = logp.data() + t * v;
      float mx = -INFINITY;
      for (int64_t j = 0; j < v; ++j) mx = std::max(mx, AsFloat(x[j]));
      float s = 0.0f;
      for (int64_t j = 0; j < v; ++j) s += std::exp(AsFloat(x[j]) - mx);
      const float lse = mx + std::log(s);
      for (int64_t j = 0; j < v; ++j) lp[j] = AsFloat(x[j]) - lse;
      row_loss[t] = -lp[y[t]];
    });
    double loss = 0;
    for (double l : row_loss) loss += l;
    loss /= d;
    losses::ParallelFor(2, n, [&](int64_t t) {
      const float* lp = logp.data() + t * v;
      T* g = grad.data() + t * v;
      const float scale = static_cast<float>(1.0 / d);
      for (int64_t j = 0; j < v; ++j) {
        g[j] = FromFloat<T>(scale * (std::exp(lp[j]) - (j == y[t] ? 1.0f : 0.0f)));
      }
    });
    spent += Clock::Now() - t0;
    benchmark::DoNotOptimize(loss);
    benchmark::ClobberMemory();
  }
  ReportCeCounters(state, n, v, sizeof(T), spent);
}

// The policy loss on the CE benchmark's logits and labels. The per-token inputs are set so
// the branches mix as in training: old_logprob = logp + noise (ratios around 1, some clipped),
// advantages of both signs, importance weights around 1, ref_logprob = logp + noise for k3.
template <typename T>
void BM_PolicyLossFused(benchmark::State& state) {
  const int64_t n = state.range(0), v = state.range(1);
  std::vector<T> z = RandomLogits<T>(n, v);
  std::vector<T> grad(z.size());
  const std::vector<int64_t> y = RandomLabels(n, v);
  std::vector<float> logp(static_cast<size_t>(n));
  losses::ParallelFor(2, n, [&](int64_t t) {
    const T* x = z.data() + t * v;
    float mx = -INFINITY;
    for (int64_t j = 0; j < v; ++j) mx = std::max(mx, AsFloat(x[j]));
    double s = 0.0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(static_cast<double>(AsFloat(x[j]) - mx));
    logp[t] = static_cast<float>(AsFloat(x[y[t]]) - mx - std::log(s));
  });
  std::mt19937 rng(4);
  std::normal_distribution<float> noise(0.0f, 0.3f);
  std::vector<float> old(n), adv(n), iw(n), ref(n);
  for (int64_t t = 0; t < n; ++t) {
    old[t] = logp[t] + noise(rng);
    adv[t] = noise(rng) * 3.0f;
    iw[t] = std::exp(noise(rng));
    ref[t] = logp[t] + noise(rng);
  }
  losses::PolicyLossInputs in;
  in.labels = y;
  in.old_logprob = old;
  in.advantages = adv;
  in.is_weights = iw;
  in.ref_logprob = ref;
  losses::PolicyLossNormalizer norm;
  norm.global_valid_tokens = static_cast<double>(n);
  losses::PolicyLossOptions opt;
  opt.kl_coef = 0.001;
  opt.kl_estimator = losses::KlEstimator::kK3;
  const TensorView zv = *TensorView::Create(z.data(), DTypeOf<T>(), {n, v});
  const TensorView gv = *TensorView::Create(grad.data(), DTypeOf<T>(), {n, v});
  Clock spent;
  int64_t clipped = 0;
  for (auto _ : state) {
    const Clock t0 = Clock::Now();
    auto r = losses::PolicyLossForwardBackward(zv, in, norm, gv, opt);
    spent += Clock::Now() - t0;
    if (!r.ok()) {
      state.SkipWithError(std::string(r.status().message()).c_str());
      break;
    }
    clipped = r->clip_count + r->dual_clip_count;
    benchmark::DoNotOptimize(r->local_loss);
    benchmark::ClobberMemory();
  }
  ReportCeCounters(state, n, v, sizeof(T), spent);
  state.counters["clipped_frac"] = static_cast<double>(clipped) / static_cast<double>(n);
}

void PolicySizes(benchmark::internal::Benchmark* b) {
  b->Args({1024, 32768})
      ->Args({4096, 32768})
      ->MeasureProcessCPUTime()
      ->Unit(benchmark::kMillisecond);
}

void CeSizes(benchmark::internal::Benchmark* b) {
  b->Args({512, 8192})
      ->Args({1024, 32768})
      ->Args({4096, 32768})
      ->MeasureProcessCPUTime()
      ->Unit(benchmark::kMillisecond);
}

BENCHMARK_TEMPLATE(BM_CrossEntropyFused, float)->Apply(CeSizes);
BENCHMARK_TEMPLATE(BM_CrossEntropyNaive, float)->Apply(CeSizes);
BENCHMARK_TEMPLATE(BM_CrossEntropyFused, BF16)->Apply(CeSizes);
BENCHMARK_TEMPLATE(BM_CrossEntropyNaive, BF16)->Apply(CeSizes);
BENCHMARK_TEMPLATE(BM_PolicyLossFused, float)->Apply(PolicySizes);
BENCHMARK_TEMPLATE(BM_PolicyLossFused, BF16)->Apply(PolicySizes);
// Same bytes as one logits buffer of the sizes above (f32: 16 MiB, 128 MiB, 512 MiB).
BENCHMARK(BM_Memcpy)
    ->Arg(512 * 8192 * 4)
    ->Arg(1024 * 32768 * 4)
    ->Arg(int64_t{4096} * 32768 * 4)
    ->MeasureProcessCPUTime()
    ->Unit(benchmark::kMillisecond);

// ---- Fused linear CE vs the materialised path. ----

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct LinearProblem {
  int64_t n, dm, v;
  std::vector<float> h, w, gh, gw;
  std::vector<int64_t> y;
};

LinearProblem MakeLinear(const benchmark::State& state) {
  LinearProblem p;
  p.n = state.range(0);
  p.dm = state.range(1);
  p.v = state.range(2);
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  p.h.resize(p.n * p.dm);
  p.w.resize(p.dm * p.v);
  for (float& e : p.h) e = dist(rng);
  for (float& e : p.w) e = dist(rng) * 0.05f;
  p.gh.assign(p.n * p.dm, 0.0f);
  p.gw.assign(p.dm * p.v, 0.0f);
  p.y = RandomLabels(p.n, p.v);
  return p;
}

void BM_FusedLinearCE(benchmark::State& state) {
  LinearProblem p = MakeLinear(state);
  const auto view = [](std::vector<float>& x, int64_t r, int64_t c) {
    return *TensorView::Create(x.data(), DType::kF32, {r, c});
  };
  int64_t peak = 0;
  for (auto _ : state) {
    peak = std::max(peak, PeakExtraBytes([&] {
                      auto r = losses::LinearCrossEntropyForwardBackward(
                          view(p.h, p.n, p.dm), view(p.w, p.dm, p.v), p.y, {},
                          static_cast<double>(p.n), view(p.gh, p.n, p.dm), view(p.gw, p.dm, p.v));
                      if (!r.ok()) state.SkipWithError(std::string(r.status().message()).c_str());
                      benchmark::DoNotOptimize(r);
                    }));
  }
  state.counters["peak_extra_bytes"] = static_cast<double>(peak);
  state.counters["logits_bytes"] = static_cast<double>(p.n * p.v * 4);
  state.counters["peak_over_logits"] = static_cast<double>(peak) / (p.n * p.v * 4.0);
  state.counters["GFLOP/s"] = benchmark::Counter(6.0 * p.n * p.dm * p.v * state.iterations() / 1e9,
                                                 benchmark::Counter::kIsRate);
}

void BM_MatmulThenFusedCE(benchmark::State& state) {
  LinearProblem p = MakeLinear(state);
  const int threads = 2;
  int64_t peak = 0;
  for (auto _ : state) {
    peak = std::max(
        peak, PeakExtraBytes([&] {
          Eigen::Map<const RowMajor> h(p.h.data(), p.n, p.dm), w(p.w.data(), p.dm, p.v);
          Eigen::Map<RowMajor> gh(p.gh.data(), p.n, p.dm), gw(p.gw.data(), p.dm, p.v);
          RowMajor logits(p.n, p.v);
          auto part = [&](int64_t n, int64_t i) {
            return std::pair<int64_t, int64_t>{n * i / threads,
                                               n * (i + 1) / threads - n * i / threads};
          };
          losses::ParallelFor(threads, threads, [&](int64_t i) {
            const auto [c0, cn] = part(p.v, i);
            logits.middleCols(c0, cn).noalias() = h * w.middleCols(c0, cn);
          });
          const TensorView lv = *TensorView::Create(logits.data(), DType::kF32, {p.n, p.v});
          auto r = CrossEntropyForwardBackward(lv, p.y, {}, static_cast<double>(p.n), lv);
          if (!r.ok()) state.SkipWithError(std::string(r.status().message()).c_str());
          losses::ParallelFor(threads, threads, [&](int64_t i) {
            const auto [c0, cn] = part(p.v, i);
            gw.middleCols(c0, cn).noalias() += h.transpose() * logits.middleCols(c0, cn);
          });
          losses::ParallelFor(threads, threads, [&](int64_t i) {
            const auto [r0, rn] = part(p.n, i);
            gh.middleRows(r0, rn).noalias() = logits.middleRows(r0, rn) * w.transpose();
          });
          benchmark::DoNotOptimize(gh.data());
        }));
  }
  state.counters["peak_extra_bytes"] = static_cast<double>(peak);
  state.counters["logits_bytes"] = static_cast<double>(p.n * p.v * 4);
  state.counters["peak_over_logits"] = static_cast<double>(peak) / (p.n * p.v * 4.0);
  state.counters["GFLOP/s"] = benchmark::Counter(6.0 * p.n * p.dm * p.v * state.iterations() / 1e9,
                                                 benchmark::Counter::kIsRate);
}

void LinearSizes(benchmark::internal::Benchmark* b) {
  b->Args({512, 256, 8192})
      ->Args({1024, 256, 16384})
      ->MeasureProcessCPUTime()
      ->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_FusedLinearCE)->Apply(LinearSizes);
BENCHMARK(BM_MatmulThenFusedCE)->Apply(LinearSizes);

// ---- Vocab-parallel CE at group size 2 vs the unsharded CE (issue 34). ----

double Median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.empty() ? 0.0 : x[x.size() / 2];
}

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void BM_VocabParallelVsUnsharded(benchmark::State& state) {
  const int64_t n = state.range(0), rows_per_exchange = state.range(1);
  const int64_t v = 131072, half = v / 2;
  std::vector<float> z = RandomLogits<float>(n, v);
  std::vector<float> grad(z.size(), 0.0f);
  const std::vector<int64_t> y = RandomLabels(n, v);
  const double d = static_cast<double>(n);
  // Each rank's [n, V/2] shard and gradient, in its own buffers (as on separate devices).
  std::vector<float> shard[2], shard_grad[2];
  for (int r = 0; r < 2; ++r) {
    shard[r].resize(static_cast<size_t>(n * half));
    shard_grad[r].assign(shard[r].size(), 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      std::memcpy(shard[r].data() + t * half, z.data() + t * v + r * half, half * sizeof(float));
    }
  }
  auto comms = CreateThreadCommunicators(2);
  if (!comms.ok()) {
    state.SkipWithError(std::string(comms.status().message()).c_str());
    return;
  }
  losses::CrossEntropyOptions full_options;
  full_options.num_threads = 1;
  losses::VocabParallelCrossEntropyOptions vp_options;
  vp_options.num_threads = 1;
  vp_options.rows_per_exchange = rows_per_exchange;
  const TensorView zv = *TensorView::Create(z.data(), DType::kF32, {n, v});
  const TensorView gv = *TensorView::Create(grad.data(), DType::kF32, {n, v});
  // The same per-rank work with no second rank running: a group of one over a [T, V/2]
  // problem (isolates what the two ranks' sharing of the machine costs).
  auto solo = CreateThreadCommunicators(1);
  if (!solo.ok()) {
    state.SkipWithError(std::string(solo.status().message()).c_str());
    return;
  }
  // The memory system alone: one thread copying a gradient-sized [T, V] buffer, and two
  // threads at once each copying half of it (what the two ranks' streams look like).
  std::vector<float> copy_dst(z.size()), half_dst[2];
  for (int r = 0; r < 2; ++r) half_dst[r].resize(shard[r].size());
  std::vector<double> full_s, vp_s, ratio, solo_s, copy1_s, copy2_s;
  int collectives = 0;
  std::string error;
  for (auto _ : state) {
    double t0 = WallSeconds();
    auto full = losses::CrossEntropyForwardBackward(zv, y, {}, d, gv, full_options);
    full_s.push_back(WallSeconds() - t0);
    if (!full.ok()) error = std::string(full.status().message());
    double rank_s[2] = {0.0, 0.0};
    std::string rank_error[2];  // one per rank thread: no shared writes
    auto run_rank = [&](int r) {
      Communicator& comm = *(*comms)[r];
      const TensorView sv = *TensorView::Create(shard[r].data(), DType::kF32, {n, half});
      const TensorView sg = *TensorView::Create(shard_grad[r].data(), DType::kF32, {n, half});
      const double start = WallSeconds();
      auto res = losses::VocabParallelCrossEntropy(comm, sv, y, r * half, v, {}, d, sg, vp_options);
      rank_s[r] = WallSeconds() - start;
      if (!res.ok()) {
        rank_error[r] = std::string(res.status().message());
      } else if (r == 0) {
        collectives = res->collectives;
      }
    };
    std::thread other(run_rank, 1);
    run_rank(0);
    other.join();
    for (const std::string& e : rank_error) {
      if (!e.empty()) error = e;
    }
    vp_s.push_back(std::max(rank_s[0], rank_s[1]));
    ratio.push_back(vp_s.back() / full_s.back());
    {
      const TensorView sv = *TensorView::Create(shard[0].data(), DType::kF32, {n, half});
      const TensorView sg = *TensorView::Create(shard_grad[0].data(), DType::kF32, {n, half});
      std::vector<int64_t> y_half(y);
      for (int64_t& e : y_half) e %= half;
      t0 = WallSeconds();
      auto res = losses::VocabParallelCrossEntropy(*(*solo)[0], sv, y_half, 0, half, {}, d, sg,
                                                   vp_options);
      solo_s.push_back(WallSeconds() - t0);
      if (!res.ok()) error = std::string(res.status().message());
    }
    t0 = WallSeconds();
    std::memcpy(copy_dst.data(), z.data(), z.size() * sizeof(float));
    copy1_s.push_back(WallSeconds() - t0);
    double copy_s[2] = {0.0, 0.0};
    auto copy_half = [&](int r) {
      const double start = WallSeconds();
      std::memcpy(half_dst[r].data(), shard[r].data(), shard[r].size() * sizeof(float));
      copy_s[r] = WallSeconds() - start;
    };
    std::thread copier(copy_half, 1);
    copy_half(0);
    copier.join();
    copy2_s.push_back(std::max(copy_s[0], copy_s[1]));
    benchmark::ClobberMemory();
  }
  if (!error.empty()) state.SkipWithError(error.c_str());
  state.counters["unsharded_ms"] = 1e3 * Median(full_s);
  state.counters["vp_rank_ms"] = 1e3 * Median(vp_s);
  state.counters["ratio_of_medians"] = Median(vp_s) / Median(full_s);
  state.counters["median_ratio"] = Median(ratio);
  state.counters["collectives"] = collectives;
  state.counters["vp_alone_ms"] = 1e3 * Median(solo_s);
  state.counters["alone_ratio"] = Median(solo_s) / Median(full_s);
  state.counters["copy_half_x2_over_full"] = Median(copy2_s) / Median(copy1_s);
}

BENCHMARK(BM_VocabParallelVsUnsharded)
    ->Args({256, 0})
    ->Args({256, 256})
    ->Args({512, 0})
    ->Args({512, 512})
    ->Iterations(9)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
