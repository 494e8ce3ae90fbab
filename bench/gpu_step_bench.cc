// The moe_lm training step on one GPU (`--backend=nccl`, train/cuda/cuda_compute.h) beside
// the same step on the CPU (`--backend=thread`, every core), in one run: tokens/s, GFLOP/s
// (StepMetrics.model_flops, model/flops.h: every matmul and attention's products) and the
// step's split into model time (forward, backward and gradient reduction: the GPU's part on
// the nccl backend) and update time (grad norm, clipping, AdamW and the parameter upload:
// the host's part), and the step's comm_s / comm_exposed_s as percentages of it (the nccl
// backend's collectives timed by CUDA events, TimedCommunicator). World 1, so no peer:
// this is the single-device step, not scaling.
//
//   ./bazelw run -c opt --config=cuda //bench:gpu_step_bench
//
// Sizes: the binary's defaults (D = H = 128, 1024 tokens per micro-batch) and a wider model
// (D = 512, H = 1024, 4096 tokens per micro-batch, 25M expert parameters) where the GPU has
// work to do. Each benchmark iteration builds the trainer (untimed), runs 2 warm-up steps
// and times 5; the reported time is per step. Without a usable GPU the binary prints why and
// exits with status 77 (skipped).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "bench/gpu_bench_main.h"
#include "benchmark/benchmark.h"
#include "collectives/nccl_backend.h"
#include "collectives/thread_backend.h"
#include "core/cuda/cuda_status.h"
#include "train/config.pb.h"
#include "train/cuda/cuda_compute.h"
#include "train/cuda/nccl_rank.h"
#include "train/rank_main.h"
#include "train/trainer.h"

namespace gradsum::bench {
namespace {

constexpr int kWarmupSteps = 2;
constexpr int kTimedSteps = 5;

train::TrainConfig StepConfig(bool wide) {
  train::TrainConfig config;  // the binary's defaults
  config.mutable_parallelism()->set_world(1);
  config.mutable_parallelism()->set_ep(1);
  config.mutable_optim()->set_steps(1 << 30);
  if (wide) {
    config.mutable_model()->set_dim(512);
    config.mutable_model()->set_expert_dim(1024);
    config.mutable_data()->set_seq_len(512);
    config.mutable_data()->set_max_doc_len(384);
  }
  return config;
}

void BM_MoeLmStep(benchmark::State& state) {
  const bool gpu = state.range(0) == 1;
  const train::TrainConfig config = StepConfig(state.range(1) == 1);
  double step_s = 0, model_s = 0, update_s = 0, comm_s = 0, exposed_s = 0, tokens = 0, flops = 0;
  for (auto _ : state) {
    auto host = CreateThreadCommunicators(1);
    if (!host.ok()) return state.SkipWithError(host.status().ToString().c_str());
    absl::StatusOr<train::RankMesh> mesh =
        train::MakeRankMesh((*host)[0].get(), config.parallelism());
    if (!mesh.ok()) return state.SkipWithError(mesh.status().ToString().c_str());
    train::RankComms comms = mesh->comms();
    if (gpu) {
      // The NCCL view, timed into the host mesh's CommTimer, as moe_lm's.
      NcclBackendOptions options;
      options.device = 0;
      if (absl::Status s = train::AttachNcclView(*(*host)[0], options, *mesh); !s.ok()) {
        return state.SkipWithError(s.ToString().c_str());
      }
      comms.make_model = train::CreateCudaMoeLm;
    }
    auto trainer = train::Trainer::Create(config, comms);
    if (!trainer.ok()) return state.SkipWithError(trainer.status().ToString().c_str());
    for (int i = 0; i < kWarmupSteps; ++i) {
      if (auto s = (*trainer)->Step(); !s.ok())
        return state.SkipWithError(s.status().ToString().c_str());
    }
    const absl::Time start = absl::Now();
    for (int i = 0; i < kTimedSteps; ++i) {
      auto r = (*trainer)->Step();
      if (!r.ok()) return state.SkipWithError(r.status().ToString().c_str());
      step_s += r->step_s();
      model_s += r->model_s();
      update_s += r->update_s();
      comm_s += r->comm_s();
      exposed_s += r->comm_exposed_s();
      tokens += r->routed_tokens();
      flops += r->model_flops();
    }
    state.SetIterationTime(absl::ToDoubleSeconds(absl::Now() - start) / kTimedSteps);
  }
  state.counters["tokens_per_s"] = tokens / step_s;
  state.counters["GFLOP_per_s"] = flops / step_s / 1e9;
  state.counters["model_pct"] = 100 * model_s / step_s;
  state.counters["update_pct"] = 100 * update_s / step_s;
  state.counters["comm_pct"] = 100 * comm_s / step_s;
  state.counters["comm_exposed_pct"] = 100 * exposed_s / step_s;
}
BENCHMARK(BM_MoeLmStep)
    ->ArgNames({"gpu", "wide"})
    ->Args({0, 0})
    ->Args({1, 0})
    ->Args({0, 1})
    ->Args({1, 1})
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace gradsum::bench

int main(int argc, char** argv) {
  return gradsum::bench::GpuBenchmarkMain("gpu_step_bench", argc, argv);
}
