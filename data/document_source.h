#ifndef GRADSUM_DATA_DOCUMENT_SOURCE_H_
#define GRADSUM_DATA_DOCUMENT_SOURCE_H_

// The corpus interface: a random-access collection of documents of tokens. The packer
// (data/packer.h) reads only lengths, the loader (data/loader.h) the tokens of its own rows,
// so a corpus produces any document on demand. The corpora (data/markov.h,
// data/text_corpus.h) implement it; MakeCorpus (data/corpus.h) picks one from the config.
// It is its own header so that a corpus depends on this interface alone, not on the others.

#include <cstdint>
#include <string>
#include <vector>

namespace gradsum::data {

class DocumentSource {
 public:
  virtual ~DocumentSource() = default;
  virtual int64_t num_documents() const = 0;
  // Length of document i (cheap; used to replay packing when resuming).
  virtual int64_t DocumentLength(int64_t i) const = 0;
  // The tokens of document i (values in [0, 256) for the byte corpora; a token file's ids,
  // data/token_files.h, below its MaxToken() + 1).
  virtual std::vector<int32_t> Document(int64_t i) const = 0;
  // The per-token floor: the lowest expected CE (nats per labelled token, over the
  // documents as generated) of any model that predicts each label from the current token
  // alone, if known (the embedded corpora), else < 0.
  virtual double EntropyFloorNats() const { return -1; }
  // The context floor: the same for a model that sees the whole document up to the current
  // token (the best any model can reach), if known, else < 0. <= EntropyFloorNats().
  virtual double ContextFloorNats() const { return -1; }
  // Bounds on DocumentLength over all documents (so a loader need not scan them).
  virtual int64_t MinDocumentLength() const = 0;
  virtual int64_t MaxDocumentLength() const = 0;
  // What the documents come from, for messages ("the embedded Markov corpus", "--data=x").
  virtual std::string Describe() const = 0;
  // A fingerprint of the content that the config does not already fix (the --data file's
  // bytes), so ranks can check they train on the same data; 0 for generated corpora.
  virtual uint64_t ContentFingerprint() const { return 0; }
};

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_DOCUMENT_SOURCE_H_
