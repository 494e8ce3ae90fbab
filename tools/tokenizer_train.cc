// Trains a sentencepiece tokenizer (BPE or unigram) on a text file: writes P.model, the
// file //tools:prepare_data and the trainer's --tokenizer users read, and P.vocab. One thread
// by default, so the same input gives the same model bytes. Training longer than 2 s prints
// how long it has run every 2 s (core/progress.h): sentencepiece's own progress sits in its
// INFO log among ~300 lines of settings and byte pieces, so that log stays silenced.
//
//   bazel run //tools:tokenizer_train -- --input=corpus.txt --vocab_size=8000
//       --model_prefix=/tmp/tok [--model_type=bpe|unigram]

#include <sys/stat.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "core/progress.h"
#include "tools/sentencepiece.h"

ABSL_FLAG(std::string, input, "", "text file to train on, one sentence (document) per line");
ABSL_FLAG(int, vocab_size, 8000,
          "vocabulary size (including <unk>, <s>, </s> and 256 byte pieces)");
ABSL_FLAG(std::string, model_prefix, "", "writes PREFIX.model and PREFIX.vocab");
ABSL_FLAG(std::string, model_type, "bpe", "bpe | unigram");
ABSL_FLAG(int, threads, 1, "training threads (1: deterministic model bytes)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "tokenizer_train --input=TEXT --vocab_size=N --model_prefix=P [--model_type=bpe|unigram]");
  absl::ParseCommandLine(argc, argv);
  gradsum::tools::SentencePieceTrainOptions options;
  options.input = absl::GetFlag(FLAGS_input);
  options.model_prefix = absl::GetFlag(FLAGS_model_prefix);
  options.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  options.model_type = absl::GetFlag(FLAGS_model_type);
  options.num_threads = absl::GetFlag(FLAGS_threads);
  if (options.input.empty() || options.model_prefix.empty()) {
    std::fprintf(stderr, "tokenizer_train: --input and --model_prefix are required\n");
    return 2;
  }
  if (options.vocab_size < 1) {
    std::fprintf(stderr, "tokenizer_train: --vocab_size=%d: must be positive\n",
                 options.vocab_size);
    return 2;
  }
  if (options.num_threads < 1) {
    std::fprintf(stderr, "tokenizer_train: --threads=%d: must be positive\n", options.num_threads);
    return 2;
  }
  // sentencepiece reports nothing while it trains (minutes on a large text): a line every 2 s
  // says the tool is at work, from a thread that wakes each 0.2 s to look at the clock.
  struct stat st;
  const std::string size =
      stat(options.input.c_str(), &st) == 0
          ? absl::StrCat(" (", gradsum::ProgressReporter::Count(st.st_size), " bytes)")
          : "";
  std::mutex mu;
  std::condition_variable cv;
  bool trained = false;
  std::thread ticker([&] {
    gradsum::ProgressReporter progress(
        absl::StrCat("tokenizer_train: training a ", options.vocab_size, "-piece ",
                     options.model_type, " tokenizer on ", options.input, size),
        0, "");
    std::unique_lock<std::mutex> lock(mu);
    while (!cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return trained; })) {
      progress.Update(0);
    }
    progress.Finish();
  });
  const std::string error = gradsum::tools::TrainSentencePiece(options);
  {
    std::lock_guard<std::mutex> lock(mu);
    trained = true;
  }
  cv.notify_one();
  ticker.join();
  if (!error.empty()) {
    std::fprintf(stderr, "tokenizer_train: %s\n", error.c_str());
    return 1;
  }
  std::printf("tokenizer_train: wrote %s.model (%s, %d pieces)\n", options.model_prefix.c_str(),
              options.model_type.c_str(), options.vocab_size);
  return 0;
}
