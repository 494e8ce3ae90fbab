// The one translation unit that includes sentencepiece's headers: no abseil header may be
// included here (see sentencepiece.h).
#include "tools/sentencepiece.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace gradsum::tools {

std::string TrainSentencePiece(const SentencePieceTrainOptions& options) {
  if (options.model_type != "bpe" && options.model_type != "unigram") {
    return "--model_type=" + options.model_type + ": must be bpe or unigram";
  }
  // Given as a map, so no value is parsed out of a command line (paths may hold spaces).
  std::unordered_map<std::string, std::string> args = {
      {"input", options.input},
      {"model_prefix", options.model_prefix},
      {"vocab_size", std::to_string(options.vocab_size)},
      {"model_type", options.model_type},
      {"num_threads", std::to_string(options.num_threads)},
      {"max_sentence_length", std::to_string(options.max_sentence_length)},
      // Every byte is representable: an unseen character becomes its UTF-8 bytes, not <unk>.
      {"byte_fallback", "true"},
      {"character_coverage", "1.0"},
      {"minloglevel", "2"},
  };
  const sentencepiece::util::Status status = sentencepiece::SentencePieceTrainer::Train(args);
  if (!status.ok()) return status.ToString();
  return "";
}

struct SentencePieceTokenizer::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

SentencePieceTokenizer::SentencePieceTokenizer() : impl_(new Impl) {}
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::string SentencePieceTokenizer::Load(const std::string& path) {
  const sentencepiece::util::Status status = impl_->processor.Load(path);
  if (!status.ok()) return status.ToString();
  return "";
}

std::string SentencePieceTokenizer::Encode(const std::string& text, std::vector<int>* ids) const {
  const sentencepiece::util::Status status = impl_->processor.Encode(text, ids);
  if (!status.ok()) return status.ToString();
  return "";
}

std::string SentencePieceTokenizer::Decode(const std::vector<int>& ids) const {
  std::string text;
  impl_->processor.Decode(ids, &text).IgnoreError();
  return text;
}

int SentencePieceTokenizer::vocab_size() const { return impl_->processor.GetPieceSize(); }
int SentencePieceTokenizer::eos_id() const { return impl_->processor.eos_id(); }
int SentencePieceTokenizer::unk_id() const { return impl_->processor.unk_id(); }

}  // namespace gradsum::tools
