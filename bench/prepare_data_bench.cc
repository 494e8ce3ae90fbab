// prepare_data's tokens per second (issue 47) on 1 and 2 threads: the repository's docs,
// repeated to about 8 MB of text, through a tokenizer of 8000 pieces trained on them, into
// a Megatron dataset in $TMPDIR; beside memcpy in the same run. No protobuf is linked here:
// Debian's libsentencepiece bundles its own (see bench/data_bench.cc).
//
//   ./bazelw run -c opt //bench:prepare_data_bench

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "bench/memcpy_bench.h"
#include "benchmark/benchmark.h"
#include "tools/prepare_data_lib.h"
#include "tools/sentencepiece.h"

namespace gradsum::bench {
namespace {

std::string TmpDir() {
  const char* t = std::getenv("TMPDIR");
  return t != nullptr ? t : "/tmp";
}

// The repository's docs (README.md and docs/*.md, as runfiles), repeated to about 8 MB.
std::string DocsText() {
  std::string text;
  for (const char* base : {"", "bench/prepare_data_bench.runfiles/gradsum/"}) {
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

BENCHMARK(BM_Memcpy)->Arg(8 << 20);

}  // namespace
}  // namespace gradsum::bench

BENCHMARK_MAIN();
