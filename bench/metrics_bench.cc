// The per-step cost of a run's observability (issue 49) at the README shape: counting the
// step's FLOPs over the global batch's documents (train/run_metrics.h, a replay of the
// packing), filling the record, the --metrics JSONL line, and the TensorBoard event
// (train/tfevents.h; buffered, flushed to a file every 10 steps as --log_every's default
// does). Compare with the README step's time (docs/BENCHMARKS.md; the target is < 0.5%).
//
//   ./bazelw run -c opt //bench:metrics_bench
#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "data/corpus.h"
#include "data/packer.h"
#include "train/config.pb.h"
#include "train/metrics.pb.h"
#include "train/run_metrics.h"
#include "train/step_log.h"
#include "train/tfevents.h"

namespace gradsum::bench {
namespace {

// A record with the README run's repeated fields: 2 layers' maxvio, 2 x 8 expert counts.
train::StepMetrics ReadmeRecord() {
  train::StepMetrics r;
  const google::protobuf::Descriptor* d = r.GetDescriptor();
  const google::protobuf::Reflection* refl = r.GetReflection();
  for (int k = 0; k < d->field_count(); ++k) {
    const google::protobuf::FieldDescriptor* f = d->field(k);
    if (f->is_repeated() || f->name() == "z_out" || f->name() == "eval_ce") continue;
    switch (f->cpp_type()) {
      case google::protobuf::FieldDescriptor::CPPTYPE_INT32:
        refl->SetInt32(&r, f, 7);
        break;
      case google::protobuf::FieldDescriptor::CPPTYPE_INT64:
        refl->SetInt64(&r, f, 3082);
        break;
      default:
        refl->SetDouble(&r, f, 1.2345678);
    }
  }
  for (int l = 0; l < 2; ++l) r.add_maxvio(0.9 + l);
  for (int i = 0; i < 16; ++i) r.add_tokens_per_expert(700 + i);
  return r;
}

void BM_StepObservability(benchmark::State& state) {
  const bool tensorboard = state.range(0) != 0;
  train::TrainConfig config;  // the README job's defaults
  auto corpus = data::MakeCorpus(config.data());
  auto meters = train::RunMeters::Create(*corpus, config);
  auto packer = data::SequencePacker::Create(*corpus, config.data().seq_len());
  if (!corpus.ok() || !meters.ok() || !packer.ok()) {
    state.SkipWithError("setup failed");
    return;
  }
  const std::string dir = absl::StrCat("/tmp/metrics_bench_", getpid());
  train::TfEventsWriter tb;
  if (tensorboard) {
    auto opened = train::TfEventsWriter::Open(dir, /*append=*/false);
    if (!opened.ok()) {
      state.SkipWithError(opened.status().ToString().c_str());
      return;
    }
    tb = std::move(*opened);
  }
  (*meters)->SetPeakFlopsPerSecond(1e11);
  const int64_t per_step = 2 * 2 * 8;  // world 2 x grad_acc 2 x micro_batch 8
  train::StepMetrics record = ReadmeRecord();
  int64_t step = 0;
  size_t bytes = 0;
  for (auto _ : state) {
    (*meters)->BeginStep(packer->position());
    packer->Skip(per_step);  // the stream moves on as the loader's does (timed: an upper bound)
    record.set_step(static_cast<int32_t>(++step));
    (*meters)->Fill(&record);
    auto line = train::StepJsonLine(record);
    bytes += line->size();
    if (tensorboard) {
      tb.AddStep(record, 1.7e9 + step);
      if (step % 10 == 0) (void)tb.Flush();
    }
  }
  benchmark::DoNotOptimize(bytes);
  if (tensorboard) {
    (void)tb.Close();
    std::remove(tb.path().c_str());
    ::rmdir(dir.c_str());
  }
}
BENCHMARK(BM_StepObservability)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
