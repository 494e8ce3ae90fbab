// MoE benchmarks (moe/dispatch.h, moe/experts.h).
//
// BM_DispatchCombine/<tokens>/<D>/<EP>: one forward + backward of the dropless dispatch over
//   an EP group of EP thread-backend ranks (each with <tokens> tokens, K = 2, E = 4 * EP,
//   uniform random routing, expert width H = 1), end to end: the experts' compute is timed
//   too. bytes_per_second counts the all-to-all payload (4 exchanges of every routed copy's
//   row, summed over the ranks); vs_memcpy is one thread's memcpy time for those same bytes,
//   measured at the end of the same run, over this benchmark's time per iteration.
// BM_DispatchMove/<tokens>/<D>/<EP>: the same with no-op experts, so only the dispatch's own
//   work (sort, count exchange, pack, the exchanges, combine, d w, scale, d_a sum) is timed.
//   Per routed row that is 2 copies each way (8 per forward + backward, of which the 4
//   exchanges are the counted payload); rows for a rank's own experts skip the exchanges.
// BM_Experts/<tokens>/<D>/<H>/<E>: grouped SwiGLU forward over <tokens> rows split evenly over
//   E local experts; BM_ExpertsBackward likewise. GFLOP/s counts the GEMMs (6 N D H forward,
//   12 N D H backward). BM_Gemm/<M>/<K>/<N> is one large Eigen GEMM; BM_Gemm/<tokens>/<D>/<3H>
//   has exactly the forward's FLOPs.
#include <Eigen/Dense>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "bench/memcpy_bench.h"
#include "benchmark/benchmark.h"
#include "collectives/communicator.h"
#include "collectives/thread_backend.h"
#include "moe/dispatch.h"
#include "moe/experts.h"

namespace gradsum::moe {
namespace {

std::vector<float> RandomFloats(size_t n, float scale, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// One EP rank's inputs and buffers for the dispatch benchmark.
struct DispatchRank {
  std::vector<float> a, cw, y, dy, d_a, d_cw, wg, wu, wd, dwg, dwu, dwd;
  std::vector<int32_t> idx;
  DispatchState state;
};

// Forward + backward of one EP rank; with `move_only` the experts are no-ops (their outputs
// are whatever their buffers held), so only the dispatch's own work is timed.
absl::Status DispatchStep(Communicator& comm, const DispatchConfig& config, DispatchRank& r,
                          bool move_only) {
  const ExpertWeights w{r.wg, r.wu, r.wd};
  if (move_only) {
    absl::Status s = internal::DispatchCombineForwardWith(
        comm, config,
        [](absl::Span<const float>, absl::Span<const int64_t>, absl::Span<float>, ExpertsSaved*) {
          return absl::OkStatus();
        },
        r.a, r.idx, r.cw, absl::MakeSpan(r.y), &r.state);
    if (!s.ok()) return s;
    return internal::DispatchCombineBackwardWith(
        comm, config,
        [](absl::Span<const float>, absl::Span<const int64_t>, const ExpertsSaved&,
           absl::Span<const float>, absl::Span<float>) { return absl::OkStatus(); },
        r.state, r.dy, absl::MakeSpan(r.d_a), absl::MakeSpan(r.d_cw));
  }
  absl::Status s =
      DispatchCombineForward(comm, config, w, r.a, r.idx, r.cw, absl::MakeSpan(r.y), &r.state);
  if (!s.ok()) return s;
  return DispatchCombineBackward(
      comm, config, w, r.state, r.dy, absl::MakeSpan(r.d_a), absl::MakeSpan(r.d_cw),
      {absl::MakeSpan(r.dwg), absl::MakeSpan(r.dwu), absl::MakeSpan(r.dwd)});
}

// Seconds per memcpy of `bytes` bytes on this thread, through a 64 MiB buffer pair (the
// same size as BM_Memcpy/64 MiB, larger than the caches), the best of `repeats`.
double MemcpySeconds(int64_t bytes, int repeats) {
  constexpr size_t kBuffer = size_t{64} << 20;
  std::vector<char> src(kBuffer, 1), dst(kBuffer, 0);
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t done = 0; done < bytes;) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(bytes - done, kBuffer));
      std::memcpy(dst.data(), src.data(), n);
      benchmark::DoNotOptimize(dst.data());
      benchmark::ClobberMemory();
      done += static_cast<int64_t>(n);
    }
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

void RunDispatchBench(benchmark::State& state, bool move_only) {
  const int64_t tokens = state.range(0);
  const int64_t D = state.range(1);
  const int ep = static_cast<int>(state.range(2));
  const DispatchConfig config{.d_model = D, .hidden = 1, .num_experts = 4 * ep, .top_k = 2};
  const int E_local = 4;
  auto comms = CreateThreadCommunicators(ep);
  if (!comms.ok()) {
    state.SkipWithError(std::string(comms.status().message()).c_str());
    return;
  }
  std::vector<DispatchRank> ranks(ep);
  std::mt19937 gen(7);
  for (int p = 0; p < ep; ++p) {
    DispatchRank& r = ranks[p];
    r.a = RandomFloats(tokens * D, 1.0f, 10 * p + 1);
    r.dy = RandomFloats(tokens * D, 1.0f, 10 * p + 2);
    r.cw = RandomFloats(tokens * 2, 1.0f, 10 * p + 3);
    r.y.resize(tokens * D);
    r.d_a.resize(tokens * D);
    r.d_cw.resize(tokens * 2);
    for (auto* w : {&r.wg, &r.wu, &r.wd, &r.dwg, &r.dwu, &r.dwd}) w->assign(E_local * D, 0.01f);
    std::uniform_int_distribution<int32_t> pick(0, config.num_experts - 1);
    for (int64_t t = 0; t < tokens; ++t) {
      const int32_t e0 = pick(gen);
      int32_t e1 = pick(gen);
      while (e1 == e0 && config.num_experts > 1) e1 = pick(gen);
      r.idx.push_back(e0);
      r.idx.push_back(e1);
    }
  }

  // Ranks 1..EP-1 run on worker threads. Rank 0 (this thread) releases each iteration
  // through `gate`; the collectives themselves keep the ranks in step.
  struct Gate {
    absl::Mutex mu;
    int64_t released = 0;
    bool stop = false;
  } gate;
  std::vector<absl::Status> status(ep);
  std::vector<std::thread> workers;
  for (int p = 1; p < ep; ++p) {
    workers.emplace_back([&, p] {
      for (int64_t i = 1;; ++i) {
        {
          absl::MutexLock lock(&gate.mu);
          auto ready = [&gate, i] { return gate.stop || gate.released >= i; };
          gate.mu.Await(absl::Condition(&ready));
          if (gate.released < i) return;  // stopped
        }
        status[p] = DispatchStep(*(*comms)[p], config, ranks[p], move_only);
        if (!status[p].ok()) return;
      }
    });
  }
  auto timed_start = std::chrono::steady_clock::now();
  bool first_iteration = true;
  for (auto _ : state) {
    if (first_iteration) timed_start = std::chrono::steady_clock::now();
    first_iteration = false;
    {
      absl::MutexLock lock(&gate.mu);
      ++gate.released;
    }
    status[0] = DispatchStep(*(*comms)[0], config, ranks[0], move_only);
    if (!status[0].ok()) break;
  }
  {
    absl::MutexLock lock(&gate.mu);
    gate.stop = true;
  }
  for (std::thread& w : workers) w.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
  }
  // All-to-all payload per iteration: 4 exchanges (rows out and back, forward and backward)
  // of every routed copy's D floats, summed over the ranks.
  int64_t copies = 0;
  for (const DispatchRank& r : ranks) copies += r.state.sent_rows();
  const int64_t bytes_per_iteration = 4 * copies * D * static_cast<int64_t>(sizeof(float));
  state.SetBytesProcessed(state.iterations() * bytes_per_iteration);
  state.counters["copies"] = static_cast<double>(copies);
  // The limit in the same run: one thread's memcpy of the same bytes, against this
  // benchmark's mean real time per iteration.
  const double seconds =
      state.iterations() > 0
          ? std::chrono::duration<double>(std::chrono::steady_clock::now() - timed_start).count() /
                static_cast<double>(state.iterations())
          : 0.0;
  const double memcpy_seconds = MemcpySeconds(bytes_per_iteration, 3);
  state.counters["memcpy_ms"] = memcpy_seconds * 1e3;
  state.counters["vs_memcpy"] = seconds > 0 ? memcpy_seconds / seconds : 0.0;
}

void BM_DispatchCombine(benchmark::State& state) { RunDispatchBench(state, false); }
void BM_DispatchMove(benchmark::State& state) { RunDispatchBench(state, true); }

BENCHMARK(BM_DispatchCombine)
    ->Args({4096, 512, 1})
    ->Args({4096, 512, 2})
    ->Args({4096, 512, 4})
    ->Args({1024, 1024, 4})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DispatchMove)
    ->Args({4096, 512, 1})
    ->Args({4096, 512, 2})
    ->Args({4096, 512, 4})
    ->Args({1024, 128, 1})  // moe_lm's default micro-batch (8 x 128 tokens, D = 128): in cache
    ->Args({1024, 128, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The grouped experts over `tokens` rows split evenly over E experts.
struct ExpertsBench {
  ExpertsConfig config;
  std::vector<float> x, y, dy, dx, wg, wu, wd, dwg, dwu, dwd;
  std::vector<int64_t> groups;
  ExpertsSaved saved;
  ExpertsBench(int64_t tokens, int64_t D, int64_t H, int E)
      : config{.d_model = D, .hidden = H, .num_local_experts = E} {
    x = RandomFloats(tokens * D, 1.0f, 1);
    dy = RandomFloats(tokens * D, 1.0f, 2);
    y.resize(tokens * D);
    dx.resize(tokens * D);
    wg = RandomFloats(E * D * H, 0.05f, 3);
    wu = RandomFloats(E * D * H, 0.05f, 4);
    wd = RandomFloats(E * D * H, 0.05f, 5);
    dwg.assign(E * D * H, 0.0f);
    dwu.assign(E * D * H, 0.0f);
    dwd.assign(E * D * H, 0.0f);
    for (int e = 0; e < E; ++e) groups.push_back(tokens / E + (e < tokens % E ? 1 : 0));
  }
  absl::Status Forward() {
    return ExpertsForward(config, {wg, wu, wd}, x, groups, absl::MakeSpan(y), &saved);
  }
  absl::Status Backward() {
    return ExpertsBackward(config, {wg, wu, wd}, x, groups, saved, dy, absl::MakeSpan(dx),
                           {absl::MakeSpan(dwg), absl::MakeSpan(dwu), absl::MakeSpan(dwd)});
  }
};

void SetFlops(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iteration * 1e-9 * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}

void BM_Experts(benchmark::State& state) {
  ExpertsBench b(state.range(0), state.range(1), state.range(2), static_cast<int>(state.range(3)));
  for (auto _ : state) {
    absl::Status s = b.Forward();
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(b.y.data());
  }
  SetFlops(state, ExpertsForwardFlops(state.range(0), state.range(1), state.range(2)));
}

void BM_ExpertsBackward(benchmark::State& state) {
  ExpertsBench b(state.range(0), state.range(1), state.range(2), static_cast<int>(state.range(3)));
  if (absl::Status s = b.Forward(); !s.ok()) {
    state.SkipWithError(std::string(s.message()).c_str());
    return;
  }
  for (auto _ : state) {
    absl::Status s = b.Backward();
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(b.dx.data());
  }
  SetFlops(state, 2.0 * ExpertsForwardFlops(state.range(0), state.range(1), state.range(2)));
}

// One [M, K] x [K, N] row-major Eigen GEMM: 2 M K N FLOPs.
void BM_Gemm(benchmark::State& state) {
  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const int64_t M = state.range(0), K = state.range(1), N = state.range(2);
  std::vector<float> a = RandomFloats(M * K, 1.0f, 1), b = RandomFloats(K * N, 0.05f, 2);
  std::vector<float> c(M * N);
  for (auto _ : state) {
    Eigen::Map<RowMatrix>(c.data(), M, N).noalias() =
        Eigen::Map<const RowMatrix>(a.data(), M, K) * Eigen::Map<const RowMatrix>(b.data(), K, N);
    benchmark::DoNotOptimize(c.data());
  }
  SetFlops(state, 2.0 * M * K * N);
}

BENCHMARK(BM_Experts)
    ->Args({2048, 256, 512, 1})
    ->Args({2048, 256, 512, 8})
    ->Args({2048, 256, 512, 32})
    ->Args({2048, 256, 512, 128})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ExpertsBackward)
    ->Args({2048, 256, 512, 1})
    ->Args({2048, 256, 512, 8})
    ->Args({2048, 256, 512, 32})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Gemm)->Args({2048, 256, 3 * 512})->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace gradsum::moe

// The physical limit, timed both ways: real time beside the (multi-threaded, real-time)
// dispatch benchmark, CPU time beside the single-threaded ones.
BENCHMARK(gradsum::bench::BM_Memcpy)->Arg(16 << 20)->Arg(64 << 20)->UseRealTime();
BENCHMARK(gradsum::bench::BM_Memcpy)->Arg(16 << 20);

BENCHMARK_MAIN();
