#ifndef GRADSUM_DATA_PACKER_H_
#define GRADSUM_DATA_PACKER_H_

// The global packed-sequence stream (SEMANTICS.md §11): which documents fill global sequence
// i, the same at every mesh and independent of any rank. The middle stage of corpus ->
// packer -> shard.
//
// A cursor walks the documents 0, 1, ..., n - 1, 0, 1, ... (epochs) and fills sequences of
// seq_len tokens greedily with whole documents; sequence i (0-based, global) is the i-th
// sequence so packed, the rest of it padding. Only document lengths are read, so every rank
// can run the packer over a whole step cheaply. Step s consumes sequences [s B, (s + 1) B),
// B = world x grad_acc x micro_batch, and sequence GlobalSequenceIndex(s, m, r, j, ...) =
//   s B + (m world + r) micro_batch + j
// is row j of micro-batch m on (data) rank r. So runs whose meshes give the same B train on
// the same sequences in every step, and micro-batch m of the step is the contiguous range
// [s B + m world micro_batch, s B + (m + 1) world micro_batch) whatever the world. The
// stream's position (DataPosition) goes into checkpoints; Seek continues from it.
//
//   GRADSUM_ASSIGN_OR_RETURN(SequencePacker packer, SequencePacker::Create(corpus, seq_len));
//   std::vector<int64_t> docs = packer.NextSequence();  // documents of sequence 0, in order

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "data/document_source.h"

namespace gradsum::data {

// Where the global sequence stream stands: the next document the packer takes and how
// many sequences it has packed.
struct DataPosition {
  int64_t next_document = 0;
  int64_t sequences = 0;
};

// The global index of row j of micro-batch m on rank r in step s (0-based), for a mesh of
// `world` ranks with `grad_acc` micro-batches of `micro_batch` sequences.
int64_t GlobalSequenceIndex(int64_t step, int m, int rank, int j, int world, int grad_acc,
                            int micro_batch);

class SequencePacker {
 public:
  // Packs `corpus` into sequences of `seq_len` tokens. InvalidArgument naming the corpus
  // (Describe) if it has no document, a document is longer than seq_len, or no document has
  // a trainable token (all shorter than 2 tokens).
  static absl::StatusOr<SequencePacker> Create(std::shared_ptr<const DocumentSource> corpus,
                                               int seq_len);

  // The documents of the next global sequence, in order; advances the stream.
  std::vector<int64_t> NextSequence();
  // Advances past `sequences` sequences.
  void Skip(int64_t sequences);

  // The stream's position; Seek(position()) on a packer of the same corpus continues the
  // same stream. InvalidArgument naming the value if next_document is outside
  // [0, num_documents) or sequences is negative.
  DataPosition position() const { return {cursor_, sequences_}; }
  absl::Status Seek(const DataPosition& position);

  const DocumentSource& corpus() const { return *corpus_; }
  int seq_len() const { return seq_len_; }

 private:
  SequencePacker() = default;

  std::shared_ptr<const DocumentSource> corpus_;
  int seq_len_ = 0;
  int64_t cursor_ = 0, sequences_ = 0;
};

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_PACKER_H_
