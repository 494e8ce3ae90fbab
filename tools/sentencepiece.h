#ifndef GRADSUM_TOOLS_SENTENCEPIECE_H_
#define GRADSUM_TOOLS_SENTENCEPIECE_H_

// A small std-only interface to Debian's libsentencepiece (0.1.97): training a model and
// encoding text with one. sentencepiece's header declares `namespace absl { using
// std::string_view; }`, which clashes with Debian's abseil (shared/spec/ENVIRONMENT.md), so
// it is included by sentencepiece.cc alone, which includes no abseil header; this header and
// its callers see std types only. Errors come back as a message ("" = success).
//
//   std::string error = TrainSentencePiece(options);
//   SentencePieceTokenizer tokenizer;
//   error = tokenizer.Load("p.model");
//   std::vector<int> ids = tokenizer.Encode("some text");

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace gradsum::tools {

struct SentencePieceTrainOptions {
  std::string input;         // a text file, one sentence (document) per line
  std::string model_prefix;  // writes model_prefix.model and model_prefix.vocab
  int vocab_size = 8000;
  std::string model_type = "bpe";  // bpe | unigram
  // One thread: the same model bytes from the same input (shared/spec/ENVIRONMENT.md).
  int num_threads = 1;
  // Lines longer than this many bytes are skipped by sentencepiece's trainer.
  int max_sentence_length = 16384;
};

// Trains a model (sentencepiece's own messages are silenced). Returns "" or the error.
std::string TrainSentencePiece(const SentencePieceTrainOptions& options);

class SentencePieceTokenizer {
 public:
  SentencePieceTokenizer();
  ~SentencePieceTokenizer();
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  // Loads `path` (a .model file). Returns "" or the error.
  std::string Load(const std::string& path);
  // The ids of `text` (no BOS / EOS added). Thread-safe once loaded.
  std::string Encode(const std::string& text, std::vector<int>* ids) const;
  std::string Decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  // The end-of-sentence id (-1 if the model has none) and the unknown piece's.
  int eos_id() const;
  int unk_id() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsum::tools

#endif  // GRADSUM_TOOLS_SENTENCEPIECE_H_
