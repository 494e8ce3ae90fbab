// Context parallelism's attention (model/ring_attention.h) at long sequences: per-rank
// activation memory and the ring's exposed communication against C (issue 32).
//
//   ./bazelw run -c opt //bench:ring_attention_bench
//
// BM_RingAttention/T/cp/schedule/docs/kv_heads: one sequence of T tokens, 2 query heads of
//   64 and kv_heads key/value heads (2: one per query head; 1: GQA, the ring carries the
//   shared head once), forward then
//   backward over a CP group of `cp` thread-backend ranks (each with cores / cp compute
//   threads, at least 1), schedule 0 the ring, 1 gathered (at cp = 1 that is exactly the
//   whole-sequence kernel of model/attention.h, the baseline). docs 1: one document (every
//   pair of the causal triangle), 0: documents of random lengths (fixed seed, mean T / 8).
//   Manual time: rank 0's wall time of forward + backward.
//   attention_s: compute + wait of rank 0; compute_s: its kernels; exposed_s: its waits for
//   the group's exchanges, and exposed_pct_of_attention = exposed_s / attention_s.
//   kept_bytes: what the rank keeps between forward and backward for this attention (its
//   q, out [T / cp, 2, 64], k, v [T / cp, kv_heads, 64] and lse [T / cp, 2], fp32);
//   peak_buffer_bytes: the calls' working buffers at their peak (RingAttentionTimes, counted
//   sizes); activation_bytes = their sum, per rank. sent_bytes: what rank 0 sent. memcpy_GBps: this
//   machine's memcpy bandwidth, measured in the same run (the thread backend's exchanges are
//   copies).
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/memcpy_bench.h"
#include "benchmark/benchmark.h"
#include "collectives/thread_backend.h"
#include "core/random.h"
#include "core/thread_pool.h"
#include "model/ring_attention.h"

namespace gradsum::bench {
namespace {

constexpr int kHeads = 2;
constexpr int64_t kHeadDim = 64;

// doc_start of one sequence of T tokens: one document, or random lengths with mean T / 8.
std::vector<int32_t> DocStarts(int64_t T, bool one_document) {
  std::vector<int32_t> ds(T);
  SplitMix64 rng(7);
  int64_t t = 0;
  while (t < T) {
    const int64_t len =
        one_document ? T : std::min<int64_t>(T - t, 1 + static_cast<int64_t>(rng.Below(T / 4)));
    for (int64_t i = 0; i < len; ++i) ds[t + i] = static_cast<int32_t>(t);
    t += len;
  }
  return ds;
}

void BM_RingAttention(benchmark::State& state) {
  const int64_t T = state.range(0);
  const int cp = static_cast<int>(state.range(1));
  const model::RingSchedule schedule =
      state.range(2) == 0 ? model::RingSchedule::kRing : model::RingSchedule::kGathered;
  const std::vector<int32_t> doc_start = DocStarts(T, state.range(3) == 1);
  model::RingAttentionDims dims;
  dims.num_seqs = 1;
  dims.seq_len = T;
  dims.heads = kHeads;
  dims.kv_heads = static_cast<int>(state.range(4));
  dims.head_dim = kHeadDim;
  const int64_t rows = T / cp, n = rows * kHeads * kHeadDim, nkv = rows * dims.kv_heads * kHeadDim;
  const int threads = std::max(1, AvailableCores() / cp);
  model::RingAttentionTimes times0;
  for (auto _ : state) {
    auto comms = CreateThreadCommunicators(cp);
    if (!comms.ok()) {
      state.SkipWithError(comms.status().ToString().c_str());
      return;
    }
    std::vector<absl::Status> status(cp);
    double elapsed = 0;
    std::vector<std::thread> ranks;
    for (int r = 0; r < cp; ++r) {
      ranks.emplace_back([&, r] {
        ScopedComputeThreads budget(threads);
        Communicator& comm = *(*comms)[r];
        SplitMix64 rng(100 + r);
        std::vector<float> q(n), k(nkv), v(nkv), d_out(n);
        for (std::vector<float>* x : {&q, &k, &v, &d_out}) {
          for (float& f : *x) f = static_cast<float>(rng.Normal());
        }
        std::vector<float> out(n), lse(rows * kHeads), dq(n), dk(nkv), dv(nkv);
        model::RingAttentionTimes times;
        if (absl::Status s = comm.Barrier(); !s.ok()) {
          status[r] = s;
          return;
        }
        const absl::Time start = absl::Now();
        absl::Status s =
            model::RingAttentionForward(comm, dims, schedule, q, k, v, doc_start,
                                        absl::MakeSpan(out), absl::MakeSpan(lse), &times);
        if (s.ok()) {
          s = model::RingAttentionBackward(comm, dims, schedule, q, k, v, doc_start, out, lse,
                                           d_out, absl::MakeSpan(dq), absl::MakeSpan(dk),
                                           absl::MakeSpan(dv), &times);
        }
        if (r == 0) {
          elapsed = absl::ToDoubleSeconds(absl::Now() - start);
          times0 = times;
        }
        benchmark::DoNotOptimize(dv.data());
        status[r] = s;
      });
    }
    for (std::thread& t : ranks) t.join();
    for (const absl::Status& s : status) {
      if (!s.ok()) {
        state.SkipWithError(s.ToString().c_str());
        return;
      }
    }
    state.SetIterationTime(elapsed);
  }
  const double attention_s = times0.compute_s + times0.wait_s;
  const int64_t kept = (2 * n + 2 * nkv + rows * kHeads) * static_cast<int64_t>(sizeof(float));
  state.counters["attention_s"] = attention_s;
  state.counters["compute_s"] = times0.compute_s;
  state.counters["exposed_s"] = times0.wait_s;
  state.counters["exposed_pct_of_attention"] =
      attention_s > 0 ? 100 * times0.wait_s / attention_s : 0;
  state.counters["kept_bytes"] = static_cast<double>(kept);
  state.counters["peak_buffer_bytes"] = static_cast<double>(times0.peak_buffer_bytes);
  state.counters["activation_bytes"] = static_cast<double>(kept + times0.peak_buffer_bytes);
  state.counters["sent_bytes"] = static_cast<double>(times0.bytes_sent);
  state.counters["threads_per_rank"] = threads;
  state.SetLabel(schedule == model::RingSchedule::kRing ? "ring" : "gathered");
}
BENCHMARK(BM_RingAttention)
    ->ArgNames({"T", "cp", "schedule", "one_doc", "kv_heads"})
    ->Args({16384, 1, 1, 1, 2})  // the whole-sequence kernel: the baseline
    ->Args({16384, 1, 0, 1, 2})
    ->Args({16384, 2, 0, 1, 2})
    ->Args({16384, 4, 0, 1, 2})
    ->Args({16384, 2, 1, 1, 2})
    ->Args({16384, 1, 1, 0, 2})
    ->Args({16384, 2, 0, 0, 2})
    ->Args({16384, 2, 0, 1, 1})  // GQA: the shared kv head travels once
    ->Args({16384, 4, 0, 1, 1})
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_Memcpy)->Arg(int64_t{16384} * kHeads * kHeadDim);  // a K, V block's bytes / 2

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
