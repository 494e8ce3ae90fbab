#ifndef GRADSUM_DATA_BLEND_H_
#define GRADSUM_DATA_BLEND_H_

// Several token-file datasets blended into one document stream (--data_path, Megatron's
// "0.7 web 0.3 code"), restricted to one part of a train / validation / test split of each
// dataset's documents (--split), each dataset's documents shuffled afresh every epoch. The
// packer (data/packer.h) walks its documents 0, 1, 2, ... as it walks any corpus's, so the
// global packed-sequence order stays a function of the data, the seed and the global batch
// (SEMANTICS.md §11).
//
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<BlendedCorpus> train,
//                            BlendedCorpus::Open(options));   // options.part = kTrain
//
// The stream (document i = 0, 1, ... of this corpus; exact, so any implementation can
// reproduce it):
//  1. Datasets d = 0 .. D-1 (in --data_path order) with weights w_d normalised to sum 1.
//     Dataset d's documents (as its reader gives them: a Megatron document, or a piece of one
//     cut at seq_len) are split by SplitRange (data/blend_spec.h); this part's range is
//     [b_d, b_d + n_d). A dataset with n_d = 0 is an error for the train part and is left
//     out (the others renormalised) for the validation and test parts.
//  2. Blending, Megatron's greedy rule per document: document i comes from the dataset d that
//     maximises w_d (i + 1) - c_d, where c_d counts the documents taken from d before i
//     (ties: the lowest d); it is d's c_d-th document of its stream, then c_d += 1.
//  3. Dataset d's stream: its k-th document (k = 0, 1, ...) is b_d + P(seed, d, e, k mod n_d)
//     in epoch e = floor(k / n_d), where P(seed, d, e, .) is a permutation of [0, n_d):
//     a 4-round Feistel network on [0, 4^h) (h the least integer >= 1 with 4^h >= n_d) with
//     cycle walking (apply it again until the value is below n_d). With x = (L << h) | R,
//     round r = 0..3 maps (L, R) to (R, L xor (F(R xor K_r) mod 2^h)), F the SplitMix64
//     finaliser and K_r = F(F(F(F(seed) xor d) xor e) xor r).
// The corpus has 2^62 documents (the stream never wraps in practice).

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "data/blend_spec.h"
#include "data/document_source.h"
#include "data/token_files.h"

namespace gradsum::data {

// The number of documents a blended corpus presents.
inline constexpr int64_t kBlendDocuments = int64_t{1} << 62;

// P(seed, d, e, k) of the header comment: position k of dataset d's epoch e, in [0, n).
int64_t EpochPermutation(uint64_t seed, int dataset, int64_t epoch, int64_t k, int64_t n);

struct BlendOptions {
  std::vector<BlendEntry> entries;          // ParseDataPath
  std::array<double, 3> split = {1, 0, 0};  // ParseSplit
  SplitPart part = SplitPart::kTrain;
  uint64_t seed = 0;
  // How each dataset is read (token files): max_len (seq_len) and eod_token.
  TokenFileOptions token_options;
  std::string describe;  // "--data_path=..." for messages
};

class BlendedCorpus : public DocumentSource {
 public:
  // Opens each entry's token file (data/token_files.h; errors name --data_path and the file)
  // and blends them.
  static absl::StatusOr<std::unique_ptr<BlendedCorpus>> Open(const BlendOptions& options);
  // Blends already opened corpora (`sources[d]` for options.entries[d]; their files are not
  // opened). InvalidArgument naming the dataset if a train part is empty, every part of the
  // validation / test kind is, no used document has 2 tokens (nothing to train on), or a
  // document is longer than token_options.max_len.
  static absl::StatusOr<std::unique_ptr<BlendedCorpus>> Create(
      const BlendOptions& options, std::vector<std::shared_ptr<const DocumentSource>> sources);

  int64_t num_documents() const override { return kBlendDocuments; }
  int64_t DocumentLength(int64_t i) const override;
  std::vector<int32_t> Document(int64_t i) const override;
  int64_t MinDocumentLength() const override { return min_len_; }
  int64_t MaxDocumentLength() const override { return max_len_; }
  std::string Describe() const override { return describe_; }
  // XXH3-64 of the weights, the split, the part, the seed and each dataset's document count
  // and ContentFingerprint (for token files, of every byte of the files).
  uint64_t ContentFingerprint() const override { return fingerprint_; }

  // The largest token id of the datasets (TokenFileCorpus::MaxToken), -1 for other sources.
  int64_t MaxToken() const { return max_token_; }
  // Which dataset (its index in --data_path) and which of its documents document i is.
  std::pair<int, int64_t> Source(int64_t i) const;
  // The document range [begin, end) of the u-th dataset in use in this part (the datasets
  // with documents in it, in --data_path order).
  std::array<int64_t, 2> Range(int u) const { return {begin_[u], begin_[u] + count_[u]}; }

 private:
  static constexpr int64_t kChunk = 4096;
  BlendedCorpus() = default;
  // (dataset in use, document) of document i.
  std::pair<int32_t, int64_t> Resolve(int64_t i) const;
  // Decodes chunk c (documents [c kChunk, (c + 1) kChunk)) into chunk_; mu_ held.
  void DecodeChunk(int64_t c) const;

  std::vector<std::shared_ptr<const DocumentSource>> sources_;  // datasets in use
  std::vector<int> dataset_;                                    // their index in --data_path
  std::vector<double> weights_;                                 // normalised
  std::vector<int64_t> begin_, count_;
  uint64_t seed_ = 0;
  int64_t min_len_ = 0, max_len_ = 0, max_token_ = -1;
  std::string describe_;
  uint64_t fingerprint_ = 0;

  // The blend is computed on demand, a chunk at a time: the counts c_d at the start of each
  // chunk decoded so far, and the last decoded chunk (the packer reads forward).
  mutable std::mutex mu_;
  mutable std::vector<std::vector<int64_t>> chunk_counts_;
  mutable int64_t chunk_index_ = -1;
  mutable std::vector<std::pair<int32_t, int64_t>> chunk_;  // (source, document)
};

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_BLEND_H_
