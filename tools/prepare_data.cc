// Tokenizes text into a Megatron indexed dataset for --data / --data_path (see
// tools/prepare_data_lib.h for what a document is and how it is written).
//
//   bazel run //tools:prepare_data -- --input=a.txt,b.jsonl --tokenizer=/tmp/tok.model
//       --output_prefix=/tmp/corpus [--text_documents=line|paragraph|file] [--threads=2]
//
// Extra arguments after the flags are inputs too. Progress goes to stderr about once a
// second; the last line on stdout gives the throughput.

#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "tools/prepare_data_lib.h"

ABSL_FLAG(std::vector<std::string>, input, {},
          "input files, comma-separated (text, or JSONL with a \"text\" key)");
ABSL_FLAG(std::string, tokenizer, "", "a sentencepiece model (tokenizer_train's P.model)");
ABSL_FLAG(std::string, output_prefix, "", "writes OUT.bin and OUT.idx (Megatron format)");
ABSL_FLAG(std::string, format, "auto", "auto (.jsonl / .json are JSONL) | text | jsonl");
ABSL_FLAG(std::string, text_documents, "line",
          "a text file's documents: line (each line) | paragraph (blank-line separated) | file");
ABSL_FLAG(int, threads, 2, "encoding threads");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "prepare_data --input=FILE[,FILE...] --tokenizer=P.model --output_prefix=OUT");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  gradsum::tools::PrepareOptions options;
  options.inputs = absl::GetFlag(FLAGS_input);
  for (size_t i = 1; i < rest.size(); ++i) options.inputs.push_back(rest[i]);
  options.tokenizer = absl::GetFlag(FLAGS_tokenizer);
  options.output_prefix = absl::GetFlag(FLAGS_output_prefix);
  options.format = absl::GetFlag(FLAGS_format);
  options.text_documents = absl::GetFlag(FLAGS_text_documents);
  options.threads = absl::GetFlag(FLAGS_threads);
  const bool tty = isatty(STDERR_FILENO) != 0;
  options.progress = [tty](int64_t documents, int64_t tokens, int64_t bytes) {
    std::fprintf(stderr, "%sprepare_data: %lld documents, %lld tokens, %.1f MB of text%s",
                 tty ? "\r" : "", static_cast<long long>(documents), static_cast<long long>(tokens),
                 bytes / 1e6, tty ? "" : "\n");
  };
  absl::StatusOr<gradsum::tools::PrepareResult> result = gradsum::tools::PrepareData(options);
  if (tty) std::fprintf(stderr, "\n");
  if (!result.ok()) {
    std::fprintf(stderr, "prepare_data: %s\n", result.status().ToString().c_str());
    return 1;
  }
  const double s = result->seconds > 0 ? result->seconds : 1e-9;
  std::printf(
      "prepare_data: wrote %s.bin/.idx: %lld documents, %lld tokens (%s, vocab %d, EOD id %d) "
      "in %.2f s: %.0f tokens/s, %.2f MB/s of text on %d threads\n",
      options.output_prefix.c_str(), static_cast<long long>(result->documents),
      static_cast<long long>(result->tokens), result->dtype.c_str(), result->vocab_size,
      result->eod_id, result->seconds, result->tokens / s, result->text_bytes / 1e6 / s,
      options.threads);
  return 0;
}
