#ifndef GRADSUM_DATA_CORPUS_H_
#define GRADSUM_DATA_CORPUS_H_

// The corpus a config names: the first stage of corpus -> packer (data/packer.h) -> shard
// (data/shard.h). A corpus is a DocumentSource (data/document_source.h): the embedded Markov
// corpora (data/markov.h) or a text file (data/text_corpus.h); a new reader implements that
// interface and is picked here.
//
//   GRADSUM_ASSIGN_OR_RETURN(std::shared_ptr<const DocumentSource> corpus,
//                            MakeCorpus(config.data()));

#include <memory>

#include "absl/status/statusor.h"
#include "data/document_source.h"
#include "train/config.pb.h"

namespace gradsum::data {

// The corpus `config` names: the text file `path`, or when it is empty the embedded corpus
// `corpus` (markov1: MarkovCorpus, markov2: SecondOrderMarkovCorpus). InvalidArgument naming
// both fields if `path` is set and `corpus` names another embedded corpus than the
// default; the file's errors as in TextFileCorpus::Load.
absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeCorpus(const train::DataConfig& config);

// Documents no training step reads, for the held-out evaluation: for the embedded corpora,
// the same chain's documents corpus_documents .. 2 corpus_documents - 1 (document i of the
// result is the corpus's document corpus_documents + i, generated as every other from its
// index); for a `path` run, the file `eval_path` (InvalidArgument naming it when empty).
absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeHeldOutCorpus(
    const train::DataConfig& config);

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_CORPUS_H_
