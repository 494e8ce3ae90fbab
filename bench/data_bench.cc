// The loader's throughput (issue 47): packed tokens per second from a memory-mapped Megatron
// .bin, plain and blended (--data_path), against the memcpy rate of the same run.
// prepare_data's rate is bench/prepare_data_bench.cc (a separate binary: Debian's
// libsentencepiece bundles its own protobuf, which must not meet libprotobuf, which the
// loader's train::DataConfig links, in one process).
//
//   ./bazelw run -c opt //bench:data_bench
//
// The loader rows build a step of the README shape (rank 0 of world 2: 2 micro-batches of 8
// sequences x 128 tokens, the step's 32 sequences packed by every rank) and report
// tokens_per_s = the rank's tokens per second (items/s) and bytes/s of int32 tokens
// written; BM_Memcpy copies the same 4 bytes per token. The dataset is 64 Mi uint16 tokens in
// documents of 16 to 1000 tokens, written to $TMPDIR once.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/memcpy_bench.h"
#include "benchmark/benchmark.h"
#include "data/blend.h"
#include "data/loader.h"
#include "data/megatron_writer.h"
#include "data/token_files.h"
#include "train/config.pb.h"

namespace gradsum::bench {
namespace {

std::string TmpDir() {
  const char* t = std::getenv("TMPDIR");
  return t != nullptr ? t : "/tmp";
}

// The dataset's prefix, written on first use.
const std::string& Dataset(const std::string& name, uint64_t seed) {
  static auto* made = new std::map<std::string, std::string>();
  auto it = made->find(name);
  if (it != made->end()) return it->second;
  const std::string prefix = TmpDir() + "/gradsum_data_bench_" + name;
  auto writer = data::MegatronWriter::Create(prefix, data::TokenDType::kUint16);
  if (!writer.ok()) std::abort();
  std::mt19937_64 rng(seed);
  std::vector<int32_t> doc;
  while (writer->tokens() < (int64_t{64} << 20)) {
    doc.resize(16 + rng() % 985);
    for (int32_t& t : doc) t = static_cast<int32_t>(rng() % 32000);
    if (!writer->AddDocument(doc).ok()) std::abort();
  }
  if (!writer->Finish().ok()) std::abort();
  return (*made)[name] = prefix;
}

train::DataConfig ReadmeShape() {
  train::DataConfig config;
  config.set_seq_len(128);
  config.set_micro_batch(8);
  return config;
}

void RunLoader(benchmark::State& state, std::shared_ptr<const data::DocumentSource> corpus) {
  auto loader = data::RankDataLoader::Create(std::move(corpus), ReadmeShape(), 0, 2);
  if (!loader.ok()) {
    state.SkipWithError(std::string(loader.status().message()).c_str());
    return;
  }
  int64_t tokens = 0;
  for (auto _ : state) {
    std::vector<data::MicroBatch> step = loader->NextStep(2);
    for (const data::MicroBatch& mb : step) tokens += static_cast<int64_t>(mb.tokens.size());
    benchmark::DoNotOptimize(step.data());
  }
  state.SetItemsProcessed(tokens);
  state.SetBytesProcessed(tokens * 4);
  state.counters["tokens_per_s"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
}

void BM_LoaderMegatron(benchmark::State& state) {
  data::TokenFileOptions options;
  options.max_len = 128;
  auto corpus = data::TokenFileCorpus::Open(Dataset("web", 1), options);
  if (!corpus.ok()) return state.SkipWithError("open");
  RunLoader(state, std::shared_ptr<const data::DocumentSource>(std::move(*corpus)));
}
BENCHMARK(BM_LoaderMegatron)->Unit(benchmark::kMicrosecond);

void BM_LoaderBlend(benchmark::State& state) {
  data::BlendOptions options;
  options.entries = {{0.7, Dataset("web", 1)}, {0.3, Dataset("code", 2)}};
  options.split = {0.969, 0.03, 0.001};
  options.seed = 1;
  options.token_options.max_len = 128;
  options.describe = "bench";
  auto corpus = data::BlendedCorpus::Open(options);
  if (!corpus.ok()) return state.SkipWithError(std::string(corpus.status().message()).c_str());
  RunLoader(state, std::shared_ptr<const data::DocumentSource>(std::move(*corpus)));
}
BENCHMARK(BM_LoaderBlend)->Unit(benchmark::kMicrosecond);

// A step's int32 tokens of one rank (2 x 8 x 128 x 4 bytes = 32 KiB) and a larger copy.
BENCHMARK(BM_Memcpy)->Arg(32 << 10)->Arg(64 << 20);

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
