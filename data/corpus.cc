#include "data/corpus.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "data/blend.h"
#include "data/blend_spec.h"
#include "data/markov.h"
#include "data/text_corpus.h"
#include "data/token_files.h"

namespace gradsum::data {

namespace {

// Documents offset .. offset + n - 1 of `source` as documents 0 .. n - 1.
class OffsetDocuments : public DocumentSource {
 public:
  OffsetDocuments(std::shared_ptr<const DocumentSource> source, int64_t offset)
      : source_(std::move(source)), offset_(offset) {}
  int64_t num_documents() const override { return source_->num_documents(); }
  int64_t DocumentLength(int64_t i) const override { return source_->DocumentLength(offset_ + i); }
  std::vector<int32_t> Document(int64_t i) const override { return source_->Document(offset_ + i); }
  double EntropyFloorNats() const override { return source_->EntropyFloorNats(); }
  double ContextFloorNats() const override { return source_->ContextFloorNats(); }
  int64_t MinDocumentLength() const override { return source_->MinDocumentLength(); }
  int64_t MaxDocumentLength() const override { return source_->MaxDocumentLength(); }
  std::string Describe() const override {
    return absl::StrCat(source_->Describe(), "'s held-out documents");
  }

 private:
  std::shared_ptr<const DocumentSource> source_;
  int64_t offset_;
};

// The blend --data_path names, part `part` of --split.
absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeBlend(const train::DataConfig& config,
                                                                SplitPart part) {
  if (config.has_corpus() && config.corpus() != train::DataConfig::markov1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.corpus=", train::DataConfig::Corpus_Name(config.corpus()),
                     " names an embedded corpus, but data.data_path=", config.data_path(),
                     " trains on files: give one or the other"));
  }
  BlendOptions options;
  options.describe = absl::StrCat("--data_path=", config.data_path());
  GRADSUM_ASSIGN_OR_RETURN(options.entries, ParseDataPath(config.data_path(), "--data_path"));
  GRADSUM_ASSIGN_OR_RETURN(options.split, ParseSplit(config.split(), "--split"));
  options.part = part;
  options.seed = config.corpus_seed();
  options.token_options.eod_token = config.eod_token();
  options.token_options.max_len = config.seq_len();
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<BlendedCorpus> blend, BlendedCorpus::Open(options));
  return std::shared_ptr<const DocumentSource>(std::move(blend));
}

}  // namespace

absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeHeldOutCorpus(
    const train::DataConfig& config) {
  if (!config.data_path().empty()) return MakeBlend(config, SplitPart::kValid);
  if (config.path().empty()) {
    absl::StatusOr<std::shared_ptr<const DocumentSource>> corpus = MakeCorpus(config);
    if (!corpus.ok()) return corpus.status();
    const int64_t n = (*corpus)->num_documents();
    return std::shared_ptr<const DocumentSource>(
        std::make_shared<const OffsetDocuments>(std::move(*corpus), n));
  }
  if (config.eval_path().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("log.eval_every > 0 with data.path=", config.path(),
                     " needs data.eval_path (--eval_data): a file of held-out documents"));
  }
  train::DataConfig held_out = config;
  held_out.set_path(config.eval_path());
  return MakeCorpus(held_out);
}

absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeCorpus(const train::DataConfig& config) {
  if (!config.data_path().empty()) {
    if (!config.path().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("data.data_path=", config.data_path(),
                                                     " and data.path=", config.path(),
                                                     " both name the data; give one of them"));
    }
    return MakeBlend(config, SplitPart::kTrain);
  }
  if (config.path().empty()) {
    switch (config.corpus()) {
      case train::DataConfig::markov1:
        return std::make_shared<const MarkovCorpus>(config);
      case train::DataConfig::markov2:
        return std::make_shared<const SecondOrderMarkovCorpus>(config);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("data.corpus=", static_cast<int>(config.corpus()), ": unknown corpus"));
  }
  // A resolved config with a file carries markov1 (ResolvedConfig); any other corpus set
  // beside a file is a contradiction.
  if (config.has_corpus() && config.corpus() != train::DataConfig::markov1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.corpus=", train::DataConfig::Corpus_Name(config.corpus()),
                     " names an embedded corpus, "
                     "but data.path=",
                     config.path(), " trains on a file: give one or the other"));
  }
  if (IsTokenFilePath(config.path())) {
    TokenFileOptions options;
    options.eod_token = config.eod_token();
    options.max_len = config.seq_len();
    options.flat_dtype = FlatDTypeOfPath(config.path());
    absl::StatusOr<std::unique_ptr<TokenFileCorpus>> tokens =
        TokenFileCorpus::Open(config.path(), options);
    if (!tokens.ok()) return Annotate(tokens.status(), "--data");
    return std::shared_ptr<const DocumentSource>(std::move(*tokens));
  }
  // The thread ranks of a process share one copy of the file.
  absl::StatusOr<std::shared_ptr<const TextFileCorpus>> file =
      TextFileCorpus::LoadShared(config.path(), config.seq_len());
  if (!file.ok()) return file.status();
  return std::shared_ptr<const DocumentSource>(std::move(*file));
}

absl::Status CheckCorpusVocab(const DocumentSource& corpus, int64_t vocab) {
  if (const auto* blend = dynamic_cast<const BlendedCorpus*>(&corpus); blend != nullptr) {
    if (blend->MaxToken() < vocab) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("model.vocab=", vocab, ": ", corpus.Describe(), " holds token id ",
                     blend->MaxToken(), ", so vocab must be at least ", blend->MaxToken() + 1));
  }
  const auto* tokens = dynamic_cast<const TokenFileCorpus*>(&corpus);
  if (tokens == nullptr) {
    if (vocab == 256) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("model.vocab=", vocab, ": ", corpus.Describe(),
                                                   " is byte-level, so vocab must be 256"));
  }
  if (tokens->MaxToken() < vocab) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("model.vocab=", vocab, ": ", corpus.Describe(), " holds token id ",
                   tokens->MaxToken(), ", so vocab must be at least ", tokens->MaxToken() + 1));
}

}  // namespace gradsum::data
