// Whole training step of moe_lm (//train:moe_lm's Trainer) on the thread backend at the
// binary's default sizes: tokens/s, the model's GFLOP/s (StepMetrics.model_flops: every
// matmul and attention's score and value products over the step's documents, counted by
// model/flops.h as the trainer's MFU counts them), and
// the step time split into compute, exposed communication (time the rank was blocked in
// collectives, including waiting for the peer inside them) and waiting (the end-of-step
// barrier: load imbalance); comm_pct is the collectives' summed durations, overlapped with
// compute or not. Side by side: world 1 (no peer) and world 2 at ep 1 and 2, both sharding
// modes.
//
// The physical limit, measured in the same run: the single-thread BLAS GEMM rate at the
// experts' shape ([2048, D] x [D, H], core/gemm.h) times the cores the ranks use
// (limit_GFLOP_per_s); pct_of_limit = GFLOP_per_s / limit. BM_Gemm reports that rate and
// Eigen's (no -march) next to it. BM_SwiGluBackward: the experts' elementwise SwiGLU
// backward, libm loop against core/vec_math's builds, beside BM_Memcpy.
//
//   ./bazelw run -c opt //bench:step_bench -- --benchmark_min_time=0.1
//
// Each benchmark iteration builds the ranks' trainers (untimed), runs 3 warm-up steps,
// then times `kTimedSteps` steps; the reported time is per step (manual time, measured by
// rank 0 between two barriers).
#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "Eigen/Core"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/memcpy_bench.h"
#include "benchmark/benchmark.h"
#include "collectives/thread_backend.h"
#include "collectives/timed_communicator.h"
#include "core/gemm.h"
#include "core/thread_pool.h"
#include "core/vec_math.h"
#include "train/config.pb.h"
#include "train/metrics.pb.h"
#include "train/rank_main.h"
#include "train/step_log.h"
#include "train/trainer.h"

namespace gradsum::bench {
namespace {

constexpr int kWarmupSteps = 3;
constexpr int kTimedSteps = 10;
constexpr int kLimitRows = 2048;  // rows of the limit GEMM

// GFLOP/s of one single-threaded BLAS GEMM [rows, D] x [D, H] (C overwritten), timed over
// at least `seconds`.
double GemmGflops(int rows, double seconds) {
  const train::ModelConfig m;
  const int64_t d = m.dim(), h = m.expert_dim();
  std::vector<float> a(rows * d, 0.5f), b(d * h, 0.25f), c(rows * h);
  int64_t reps = 0;
  const absl::Time start = absl::Now();
  absl::Duration elapsed;
  do {
    for (int i = 0; i < 10; ++i) {
      (void)Sgemm(Trans::kNo, Trans::kNo, rows, h, d, 1.0f, a, d, b, h, 0.0f, absl::MakeSpan(c), h);
    }
    reps += 10;
    elapsed = absl::Now() - start;
  } while (elapsed < absl::Seconds(seconds));
  benchmark::DoNotOptimize(c.data());
  return 2.0 * rows * d * h * reps / absl::ToDoubleSeconds(elapsed) / 1e9;
}

// The single-core GEMM rate, measured once per run (first use).
double SingleCoreGemmGflops() {
  static const double rate = GemmGflops(kLimitRows, 0.5);
  return rate;
}

// Times `config`'s step on the thread backend (see the file comment) and reports the
// counters. `config.parallelism().world()` ranks.
void RunTrainSteps(benchmark::State& state, train::TrainConfig config) {
  const int world = config.parallelism().world();
  config.mutable_optim()->set_steps(1 << 30);
  double step_s = 0, comm_s = 0, exposed_s = 0, wait_s = 0, tokens = 0, flops = 0;
  double exposed_by_kind_s[kNumCommKinds] = {};
  int64_t peak_activation_bytes = 0;
  for (auto _ : state) {
    auto comms = CreateThreadCommunicators(world);
    if (!comms.ok()) {
      state.SkipWithError(comms.status().ToString().c_str());
      return;
    }
    std::vector<absl::Status> status(world);
    std::vector<double> elapsed(world, 0);
    std::vector<train::StepMetrics> records;
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        auto fail = [&](absl::Status s) { status[r] = s; };
        absl::StatusOr<train::RankMesh> mesh =
            train::MakeRankMesh((*comms)[r].get(), config.parallelism());
        if (!mesh.ok()) return fail(mesh.status());
        auto trainer = train::Trainer::Create(config, mesh->comms());
        if (!trainer.ok()) return fail(trainer.status());
        for (int i = 0; i < kWarmupSteps; ++i) {
          if (auto s = (*trainer)->Step(); !s.ok()) return fail(s.status());
        }
        if (auto s = mesh->world->Barrier(); !s.ok()) return fail(s);
        const absl::Time start = absl::Now();
        for (int i = 0; i < kTimedSteps; ++i) {
          auto s = (*trainer)->Step();
          if (!s.ok()) return fail(s.status());
          if (r == 0) records.push_back(*s);
        }
        if (auto s = mesh->world->Barrier(); !s.ok()) return fail(s);
        elapsed[r] = absl::ToDoubleSeconds(absl::Now() - start);
      });
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& s : status) {
      if (!s.ok()) {
        state.SkipWithError(s.ToString().c_str());
        return;
      }
    }
    state.SetIterationTime(elapsed[0] / kTimedSteps);
    for (const train::StepMetrics& rec : records) {
      step_s += rec.step_s();
      comm_s += rec.comm_s();
      exposed_s += rec.comm_exposed_s();
      for (int k = 0; k < kNumCommKinds; ++k) {
        exposed_by_kind_s[k] += train::CommExposedSeconds(rec, static_cast<CommKind>(k));
      }
      wait_s += rec.wait_s();
      tokens += rec.routed_tokens();
      flops += rec.model_flops();
      peak_activation_bytes = std::max<int64_t>(peak_activation_bytes, rec.peak_activation_bytes());
    }
  }
  // The trainer gives each of the world's ranks cores / world threads (thread backend).
  const int cores = AvailableCores();
  const int cores_in_use = std::min(cores, world * std::max(1, cores / world));
  const double limit = SingleCoreGemmGflops() * cores_in_use;
  state.counters["tokens_per_s"] = tokens / step_s;
  state.counters["GFLOP_per_s"] = flops / step_s / 1e9;
  state.counters["limit_GFLOP_per_s"] = limit;
  state.counters["pct_of_limit"] = 100 * flops / step_s / 1e9 / limit;
  state.counters["compute_pct"] = 100 * (step_s - exposed_s - wait_s) / step_s;
  state.counters["comm_pct"] = 100 * comm_s / step_s;
  state.counters["exposed_pct"] = 100 * exposed_s / step_s;
  // exposed_pct split by the kind of collective that blocked (it sums to exposed_pct).
  for (int k = 0; k < kNumCommKinds; ++k) {
    state.counters[absl::StrCat("exposed_", CommKindName(static_cast<CommKind>(k)), "_pct")] =
        100 * exposed_by_kind_s[k] / step_s;
  }
  state.counters["wait_pct"] = 100 * wait_s / step_s;
  // Rank 0's most activation bytes held at once over the timed steps (counted buffers,
  // train/metrics.proto).
  state.counters["peak_activation_bytes"] = static_cast<double>(peak_activation_bytes);
}
void BM_TrainStep(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  train::TrainConfig config;  // the binary's defaults
  if (state.range(3) == 0) {  // the per-token model on the first-order corpus (before issue 29)
    config.mutable_model()->set_attention(train::ModelConfig::none);
    config.mutable_data()->set_corpus(train::DataConfig::markov1);
  }
  config.mutable_parallelism()->set_sp(static_cast<int>(state.range(4)));
  config.mutable_parallelism()->set_world(world);
  config.mutable_parallelism()->set_ep(static_cast<int>(state.range(1)));
  config.mutable_parallelism()->set_sharding(state.range(2) == 0 ? train::TrainConfig::fsdp
                                                                 : train::TrainConfig::replicated);
  if (state.range(5) > 0) config.mutable_model()->set_layers(static_cast<int>(state.range(5)));
  config.mutable_parallelism()->set_recompute(
      static_cast<train::ParallelismConfig::Recompute>(state.range(6)));
  config.mutable_parallelism()->set_cp(static_cast<int>(state.range(7)));
  if (state.range(8) > 0) {  // one long sequence per micro-batch, documents up to its length
    const int seq_len = static_cast<int>(state.range(8));
    config.mutable_data()->set_seq_len(seq_len);
    config.mutable_data()->set_max_doc_len(seq_len);
    config.mutable_data()->set_micro_batch(1);
  }
  RunTrainSteps(state, config);
}

BENCHMARK(BM_TrainStep)
    ->ArgNames({"world", "ep", "replicated", "attention", "sp", "layers", "recompute", "cp",
                "seq_len"})
    ->Args({1, 1, 0, 0, 1, 0, 0, 1, 0})
    ->Args({2, 1, 0, 0, 1, 0, 0, 1, 0})
    ->Args({2, 2, 0, 0, 1, 0, 0, 1, 0})
    ->Args({2, 1, 1, 0, 1, 0, 0, 1, 0})
    ->Args({2, 2, 1, 0, 1, 0, 0, 1, 0})
    ->Args({2, 2, 0, 1, 1, 0, 0, 1, 0})  // the binary's default model
    ->Args({2, 2, 0, 1, 2, 0, 0, 1, 0})
    // Activation recomputation (--recompute, train/config.proto: none 0, full 1,
    // selective 2) at 8 layers: peak_activation_bytes against the step time.
    ->Args({2, 2, 0, 1, 1, 8, 0, 1, 0})
    ->Args({2, 2, 0, 1, 1, 8, 2, 1, 0})
    ->Args({2, 2, 0, 1, 1, 8, 1, 1, 0})
    // Long sequences over two ranks: Ulysses SP 2 against ring CP 2 at the same shape
    // (one 4096-token sequence per micro-batch with documents up to 4096 tokens, world 2:
    // one data-parallel group either way, the same tokens).
    ->Args({2, 2, 0, 1, 2, 0, 0, 1, 4096})
    ->Args({2, 2, 0, 1, 1, 0, 0, 2, 4096})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// --reproducible at the binary's default model (world 2, EP 2): the row block of its
// exact contributions, the old default (a rank's share of a sequence, seq_len / sp: passed
// explicitly, repro_block = 128 / sp) against the new one (0: the largest divisor of seq_len
// up to seq_len / 4, 32 here, the same at every SP and CP) and seq_len / 8 (16, what a
// default that also covered CP 4 would cost), at SP 1 and 2; the normal mode beside them
// (repro_block -1).
void BM_ReproducibleStep(benchmark::State& state) {
  train::TrainConfig config;  // the binary's defaults
  config.mutable_parallelism()->set_sp(static_cast<int>(state.range(0)));
  if (state.range(1) >= 0) {
    config.mutable_precision()->set_reproducible(true);
    config.mutable_precision()->set_repro_block(static_cast<int>(state.range(1)));
  }
  RunTrainSteps(state, config);
}
BENCHMARK(BM_ReproducibleStep)
    ->ArgNames({"sp", "repro_block"})
    ->Args({1, -1})
    ->Args({1, 128})
    ->Args({1, 0})
    ->Args({1, 16})
    ->Args({2, -1})
    ->Args({2, 64})
    ->Args({2, 0})
    ->Args({2, 16})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// The compute limit: one single-threaded BLAS GEMM of the experts' up-projection shape,
// [rows, D] x [D, H] (what one core's expert matmuls can reach at best).
void BM_Gemm(benchmark::State& state) {
  const int rows = static_cast<int>(state.range(0));
  double rate = 0;
  for (auto _ : state) rate = GemmGflops(rows, 0.2);
  state.counters["GFLOP_per_s"] = rate;
  state.SetLabel(BlasCoreName());
}
BENCHMARK(BM_Gemm)->Arg(256)->Arg(kLimitRows)->Iterations(1);

// The same product through Eigen (no -march), the GEMM before core/gemm.h.
void BM_EigenGemm(benchmark::State& state) {
  const train::ModelConfig m;  // default sizes
  const int rows = static_cast<int>(state.range(0));
  Eigen::setNbThreads(1);
  Eigen::MatrixXf a = Eigen::MatrixXf::Random(rows, m.dim());
  Eigen::MatrixXf b = Eigen::MatrixXf::Random(m.dim(), m.expert_dim());
  Eigen::MatrixXf c(rows, m.expert_dim());
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOP_per_s"] =
      benchmark::Counter(2.0 * rows * m.dim() * m.expert_dim() * state.iterations() / 1e9,
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_EigenGemm)->Arg(256)->Arg(kLimitRows)->UseRealTime();

// The experts' SwiGLU backward over [kLimitRows, H] (the elementwise work between their
// GEMMs): arg 0 the scalar loop with libm expf that moe/experts.cc ran before core/vec_math,
// 1 vec::SwiGluBackward's generic (SSE2) build, 2 the build this CPU picks. With the copy
// that refreshes d_gate each iteration it reads 16 bytes per element and writes 16, so
// bytes/s is comparable with BM_Memcpy of the same bytes (read once, written once).
void BM_SwiGluBackward(benchmark::State& state) {
  const train::ModelConfig m;
  const int64_t n = int64_t{kLimitRows} * m.expert_dim();
  std::vector<float> g(n), u(n), d(n), dg(n), du(n), a(n);
  for (int64_t i = 0; i < n; ++i) {
    g[i] = static_cast<float>(i % 97) * 0.1f - 4.8f;
    u[i] = static_cast<float>(i % 13) * 0.2f - 1.2f;
    d[i] = static_cast<float>(i % 7) * 0.3f - 0.9f;
  }
  const int variant = static_cast<int>(state.range(0));
  const vec::VecKernels& k =
      variant == 1 ? *vec::VecKernelsFor("generic") : vec::SelectedVecKernels();
  for (auto _ : state) {
    std::copy(d.begin(), d.end(), dg.begin());  // d_gate is in/out
    if (variant == 0) {
      for (int64_t i = 0; i < n; ++i) {
        const float sig = 1.0f / (1.0f + std::exp(-g[i]));
        const float silu = g[i] * sig;
        const float d_act = dg[i];
        a[i] = silu * u[i];
        du[i] = d_act * silu;
        dg[i] = d_act * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
      }
    } else {
      k.swiglu_backward(g.data(), u.data(), dg.data(), du.data(), a.data(), n);
    }
    benchmark::DoNotOptimize(dg.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n * 4 * static_cast<int64_t>(sizeof(float)));
  state.SetLabel(variant == 0 ? "libm expf loop" : k.isa);
}
BENCHMARK(BM_SwiGluBackward)->Arg(0)->Arg(1)->Arg(2);
BENCHMARK(BM_Memcpy)->Arg(int64_t{kLimitRows} * 128 * 16);  // the same bytes, at H = 128

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
