// The data path's throughput (issue 47): the loader's packed tokens per second from a
// memory-mapped Megatron .bin, plain and blended (--data_path), against the memcpy rate of the
// same run; and prepare_data's tokens per second on 1 and 2 threads.
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
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/memcpy_bench.h"
#include "benchmark/benchmark.h"
#include "data/blend.h"
#include "data/loader.h"
#include "data/megatron_writer.h"
#include "data/token_files.h"
#include "tools/prepare_data_lib.h"
#include "tools/sentencepiece.h"
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

// The repository's docs (README.md and docs/*.md, as runfiles), repeated to about 8 MB.
std::string DocsText() {
  std::string text;
  for (const char* base : {"", "bench/data_bench.runfiles/gradsum/"}) {
    for (const char* f : {"README.md", "docs/ARCHITECTURE.md", "docs/SEMANTICS.md",
                          "docs/BENCHMARKS.md", "docs/CHECKPOINTS.md", "docs/GPU.md"}) {
      std::ifstream in(std::string(base) + f);
      std::stringstream s;
      s << in.rdbuf();
      text += s.str();
    }
    if (!text.empty()) break;
  }
  if (text.empty()) return text;
  const std::string one = text;
  while (text.size() < (size_t{8} << 20)) text += one;
  return text;
}

void BM_PrepareData(benchmark::State& state) {
  static const std::string* model = [] {
    const std::string text_path = TmpDir() + "/gradsum_data_bench_docs.txt";
    const std::string text = DocsText();
    std::ofstream(text_path, std::ios::binary) << text;
    tools::SentencePieceTrainOptions o;
    o.input = text_path;
    o.vocab_size = 8000;
    o.model_prefix = TmpDir() + "/gradsum_data_bench_tok";
    o.max_sentence_length = 1 << 20;
    if (text.empty() || !tools::TrainSentencePiece(o).empty()) return new std::string();
    return new std::string(o.model_prefix + ".model");
  }();
  if (model->empty()) return state.SkipWithError("no docs found (run with bazel run)");
  tools::PrepareOptions o;
  o.inputs = {TmpDir() + "/gradsum_data_bench_docs.txt"};
  o.tokenizer = *model;
  o.output_prefix = TmpDir() + "/gradsum_data_bench_prepared";
  o.threads = static_cast<int>(state.range(0));
  int64_t tokens = 0, bytes = 0;
  for (auto _ : state) {
    auto r = tools::PrepareData(o);
    if (!r.ok()) return state.SkipWithError(std::string(r.status().message()).c_str());
    tokens += r->tokens;
    bytes += r->text_bytes;
  }
  state.SetItemsProcessed(tokens);
  state.SetBytesProcessed(bytes);
  state.counters["tokens_per_s"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_PrepareData)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
