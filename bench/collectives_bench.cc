// Collectives benchmarks: thread-backend all-reduce, world size 2, against BM_Memcpy (the
// physical limit) in the same run.
//
//   ./bazelw run -c opt //bench:collectives_bench [-- --benchmark_format=json]
//
// Counters: bytes_per_second is the algorithm bandwidth (bytes of one rank's buffer per
// second); busbw = algbw * 2 (W - 1) / W is the bus bandwidth, the NCCL-tests convention
// that makes all-reduce comparable with a point-to-point copy (for W = 2 the two agree).
//
// Rank 0 runs in the benchmark's own thread; rank 1 runs the same operation in a peer
// thread until told to stop, then both drain to the same operation count.

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/memcpy_bench.h"
#include "bench/transformer_grads.h"
#include "collectives/bucketer.h"
#include "collectives/communicator.h"
#include "collectives/thread_backend.h"

namespace gradsum::bench {
namespace {

constexpr int kWorld = 2;

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::abort();
  }
}

// Runs `op(rank 1)` repeatedly in a thread, in lock-step with rank 0's calls through the
// collectives themselves. Stop() makes the counts equal again (rank 1 is at most one
// operation ahead, since each operation needs both ranks).
class PeerLoop {
 public:
  explicit PeerLoop(std::function<void()> op) : op_(std::move(op)) {
    thread_ = std::thread([this] {
      for (;;) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (stop_) return;
          ++started_;
        }
        op_();
      }
    });
  }
  // `rank0_done` operations were run by rank 0; `rank0_op` runs one more on rank 0.
  void Stop(int64_t rank0_done, const std::function<void()>& rank0_op) {
    int64_t started;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      started = started_;
    }
    for (int64_t i = rank0_done; i < started; ++i) rank0_op();
    thread_.join();
  }

 private:
  std::function<void()> op_;
  std::mutex mu_;
  bool stop_ = false;
  int64_t started_ = 0;
  std::thread thread_;
};

std::vector<std::unique_ptr<Communicator>> MakeComms() {
  auto comms = CreateThreadCommunicators(kWorld);
  Check(comms.status(), "CreateThreadCommunicators");
  return std::move(*comms);
}

void SetBandwidth(benchmark::State& state, int64_t bytes_per_iter) {
  state.SetBytesProcessed(state.iterations() * bytes_per_iter);
  state.counters["busbw"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * bytes_per_iter * 2.0 * (kWorld - 1) / kWorld,
      benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}

// Runs `make_op(rank)()` once per iteration on rank 0 (timed) and continuously on rank 1.
void RunLockStep(benchmark::State& state, std::vector<std::unique_ptr<Communicator>>& comms,
                 const std::function<std::function<void()>(int)>& make_op, int64_t bytes_per_iter) {
  std::function<void()> op0 = make_op(0);
  PeerLoop peer(make_op(1));
  int64_t done = 0;
  for (auto _ : state) {
    op0();
    ++done;
  }
  peer.Stop(done, op0);
  SetBandwidth(state, bytes_per_iter);
}

// ---- One contiguous buffer. ----

// In place (send == recv), or out of place, where the results go to buffers that are not
// in cache (each store first reads its line: 6 buffer passes per element pair, not 4).
void AllReduceOneBuffer(benchmark::State& state, bool in_place) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / sizeof(float);
  auto comms = MakeComms();
  std::vector<std::vector<float>> send(kWorld, std::vector<float>(count, 0.0f));
  std::vector<std::vector<float>> recv(in_place ? 0 : kWorld, std::vector<float>(count, 0.0f));
  RunLockStep(
      state, comms,
      [&](int r) -> std::function<void()> {
        return [&, r] {
          float* out = in_place ? send[r].data() : recv[r].data();
          Check(comms[r]->AllReduce(send[r].data(), out, count, DType::kF32), "all_reduce");
        };
      },
      static_cast<int64_t>(bytes));
}

void BM_AllReduceContiguous(benchmark::State& state) { AllReduceOneBuffer(state, true); }

// The same in-place all-reduce issued async and waited for at once: the path of a small
// collective that a caller overlaps (the MoE expert counts, a loss statistic), handle and
// queue included.
void BM_AllReduceLatencyAsync(benchmark::State& state) {
  const size_t count = static_cast<size_t>(state.range(0)) / sizeof(float);
  auto comms = MakeComms();
  std::vector<std::vector<float>> buf(kWorld, std::vector<float>(count, 0.0f));
  RunLockStep(
      state, comms,
      [&](int r) -> std::function<void()> {
        return [&, r] {
          auto w = comms[r]->AllReduceAsync(buf[r].data(), buf[r].data(), count, DType::kF32,
                                            ReduceOp::kSum);
          Check(w.status(), "issue");
          Check((*w)->Wait(), "wait");
        };
      },
      static_cast<int64_t>(count * sizeof(float)));
}
void BM_AllReduceOutOfPlace(benchmark::State& state) { AllReduceOneBuffer(state, false); }

// ---- A small transformer's gradient set (bench/transformer_grads.h). ----

using ::gradsum::bench::TransformerGradSizes;

const int64_t kTransformerBytes = ::gradsum::bench::TransformerGradBytes();

void BM_AllReduceBucketed(benchmark::State& state) {
  const std::vector<size_t> sizes = TransformerGradSizes();
  auto comms = MakeComms();
  std::vector<std::unique_ptr<GradBucketer>> bucketers;
  for (int r = 0; r < kWorld; ++r) {
    bucketers.push_back(std::make_unique<GradBucketer>(comms[r].get()));
    for (size_t i = 0; i < sizes.size(); ++i) {
      Check(bucketers[r]
                ->Register(absl::StrCat("g", i), DType::kF32, static_cast<int64_t>(sizes[i]))
                .status(),
            "register");
    }
    Check(bucketers[r]->Finalize(), "finalize");
  }
  state.counters["buckets"] = bucketers[0]->num_buckets();
  RunLockStep(
      state, comms,
      [&](int r) -> std::function<void()> {
        return [&, r] {
          GradBucketer& b = *bucketers[r];
          for (int id = b.num_params() - 1; id >= 0; --id) Check(b.MarkReady(id), "mark");
          Check(b.Finish(), "finish");
        };
      },
      kTransformerBytes);
  bucketers.clear();  // before the communicators
}

// One all-reduce per tensor of the same 300, in backward order (last first). `async`: all
// issued, then all waited, the same overlap the bucketer gets, one collective per tensor
// instead of per bucket (the "per-tensor" row). Sync: one blocking call after the
// other (no queue, worker or Work handle), which isolates the rendezvous' own cost per call.
void PerTensor(benchmark::State& state, bool async) {
  const std::vector<size_t> sizes = TransformerGradSizes();
  auto comms = MakeComms();
  std::vector<std::vector<std::vector<float>>> grads(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    for (size_t n : sizes) grads[r].emplace_back(n, 0.0f);
  }
  RunLockStep(
      state, comms,
      [&](int r) -> std::function<void()> {
        return [&, r] {
          std::vector<std::unique_ptr<Work>> works;
          works.reserve(async ? sizes.size() : 0);
          for (size_t i = sizes.size(); i-- > 0;) {
            float* g = grads[r][i].data();
            if (!async) {
              Check(comms[r]->AllReduce(g, g, sizes[i], DType::kF32, ReduceOp::kSum), "all_reduce");
              continue;
            }
            auto w = comms[r]->AllReduceAsync(g, g, sizes[i], DType::kF32, ReduceOp::kSum);
            Check(w.status(), "issue");
            works.push_back(std::move(*w));
          }
          for (auto& w : works) Check(w->Wait(), "wait");
        };
      },
      kTransformerBytes);
}

void BM_AllReducePerTensor(benchmark::State& state) { PerTensor(state, /*async=*/true); }
void BM_AllReducePerTensorSync(benchmark::State& state) { PerTensor(state, /*async=*/false); }

// ---- Small-message latency, as nccl-tests reports it (8 B .. 64 KiB, doubling). ----

// Time per synchronous f32 SUM all-reduce, in place, world 2 (the peer in its own thread).
// Compare with BM_RawMpiAllreduce at the same sizes in bench/collectives_mpi_bench (two
// processes) and BM_Memcpy here.
void BM_AllReduceLatency(benchmark::State& state) { BM_AllReduceContiguous(state); }

void LatencySizes(benchmark::internal::Benchmark* b) {
  b->RangeMultiplier(2)->Range(8, 64 << 10)->MinTime(0.2)->UseRealTime();
}

BENCHMARK(BM_Memcpy)->Apply(LatencySizes);
BENCHMARK(BM_AllReduceLatency)->Apply(LatencySizes);
BENCHMARK(BM_AllReduceLatencyAsync)->Apply(LatencySizes);

// Buffer sizes for memcpy and the contiguous all-reduce: 4 KiB .. 256 MiB, 64 MiB, and
// the gradient set's exact size (the equal-bytes comparison).
void BufferSizes(benchmark::internal::Benchmark* b) {
  b->RangeMultiplier(16)
      ->Range(4 << 10, 256 << 20)
      ->Arg(64 << 20)
      ->Arg(kTransformerBytes)
      ->MinTime(0.3)
      ->UseRealTime()
      ->MeasureProcessCPUTime();
}

BENCHMARK(BM_Memcpy)->Apply(BufferSizes);
BENCHMARK(BM_AllReduceContiguous)->Apply(BufferSizes);
BENCHMARK(BM_AllReduceOutOfPlace)
    ->Arg(64 << 20)
    ->MinTime(0.3)
    ->UseRealTime()
    ->MeasureProcessCPUTime();
BENCHMARK(BM_AllReduceBucketed)->MinTime(0.5)->UseRealTime()->MeasureProcessCPUTime();
BENCHMARK(BM_AllReducePerTensor)->MinTime(0.5)->UseRealTime()->MeasureProcessCPUTime();
BENCHMARK(BM_AllReducePerTensorSync)->MinTime(0.5)->UseRealTime()->MeasureProcessCPUTime();

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
