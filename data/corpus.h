#ifndef GRADSUM_DATA_CORPUS_H_
#define GRADSUM_DATA_CORPUS_H_

// The corpus a config names: the first stage of corpus -> packer (data/packer.h) -> shard
// (data/shard.h). A corpus is a DocumentSource (data/document_source.h): the embedded Markov
// corpora (data/markov.h), a byte text file (data/text_corpus.h) or a token file
// (data/token_files.h); a new reader implements that interface and is picked here.
//
//   GRADSUM_ASSIGN_OR_RETURN(std::shared_ptr<const DocumentSource> corpus,
//                            MakeCorpus(config.data()));

#include <memory>

#include "absl/status/statusor.h"
#include "data/document_source.h"
#include "train/config.pb.h"

namespace gradsum::data {

// The corpus `config` names: the file `path`, or when it is empty the embedded corpus
// `corpus` (markov1: MarkovCorpus, markov2: SecondOrderMarkovCorpus). A path that
// IsTokenFilePath accepts (a Megatron prefix or its .idx / .bin, an llm.c .bin, .u16, .u32:
// data/token_files.h) is a TokenFileCorpus: documents split at `eod_token` where the format
// has no index, cut at seq_len tokens, headerless .u32 files uint32 and other headerless
// files uint16; any other path is a byte text file (TextFileCorpus), read exactly as before
// token files existed. InvalidArgument naming both fields if `path` is set and `corpus`
// names another embedded corpus than the default; the file's errors as in
// TextFileCorpus::Load / TokenFileCorpus::Open. With `data_path` (--data_path): the train
// part of the blend it names (data/blend.h), documents cut at seq_len, shuffled from
// corpus_seed.
absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeCorpus(const train::DataConfig& config);

// Whether a model of `vocab` tokens can train on `corpus`: a token file's (or a blend's)
// largest token id must be below it; byte corpora (embedded, text) need exactly 256.
// InvalidArgument naming model.vocab, the corpus and the bound otherwise.
absl::Status CheckCorpusVocab(const DocumentSource& corpus, int64_t vocab);

// Documents no training step reads, for the held-out evaluation: for the embedded corpora,
// the same chain's documents corpus_documents .. 2 corpus_documents - 1 (document i of the
// result is the corpus's document corpus_documents + i, generated as every other from its
// index); for a `path` run, the file `eval_path` (InvalidArgument naming it when empty); for
// a `data_path` run, the validation part of its blend (data/blend.h).
absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeHeldOutCorpus(
    const train::DataConfig& config);

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_CORPUS_H_
