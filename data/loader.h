#ifndef GRADSUM_DATA_LOADER_H_
#define GRADSUM_DATA_LOADER_H_

// One rank's micro-batches of the global packed-sequence stream: corpus
// (data/corpus.h) -> packer (data/packer.h, which documents fill global sequence i) ->
// shard (data/shard.h, which positions of a sequence this rank holds under SP and CP),
// each position carrying every label stream (data/streams.h: the main one and the others).
//
// Step s consumes the global sequences [s B, (s + 1) B), B = data ranks x grad_acc x
// micro_batch (DataPlace::data_ranks), sequence GlobalSequenceIndex(s, m, r, j, ...) being row j of
// micro-batch m on data rank r. Every rank runs the packer over the whole step (document
// lengths only, cheap) and builds the tokens of its own rows. Inside a sequence, label[t] =
// token[t+1] of the same document; the last token of each document is ignored (label
// kIgnoreIndex); the tail is padding (mask 0, label kIgnoreIndex, token 0). So valid-token
// counts differ across ranks and micro-batches.
//
//   GRADSUM_ASSIGN_OR_RETURN(auto corpus, MakeCorpus(config.data()));
//   GRADSUM_ASSIGN_OR_RETURN(RankDataLoader loader,
//       RankDataLoader::Create(corpus, config.data(), rank, world));
//   std::vector<MicroBatch> step = loader.NextStep(grad_acc);  // G micro-batches

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "data/document_source.h"
#include "data/packer.h"
#include "data/shard.h"
#include "train/config.pb.h"

namespace gradsum::data {

// One micro-batch of one rank: `batch` packed sequences of `seq_len` tokens, row-major.
struct MicroBatch {
  int batch = 0;
  int seq_len = 0;  // tokens of a whole sequence
  // Tokens of each sequence this rank holds: its shard's (data/shard.h; seq_len when the
  // rank holds whole sequences). The per-token vectors below hold batch * local_seq_len
  // entries, sequence after sequence, in the shard's order.
  int local_seq_len = 0;
  std::vector<int32_t> tokens;  // [batch * local_seq_len]; padding 0
  std::vector<int32_t> labels;  // next token or kIgnoreIndex
  std::vector<int32_t> mask;    // 1 routed (a document token), 0 padding
  // Which packed document (sample, SEMANTICS.md §3) each token belongs to: unique within the
  // rank's step (a running count of the documents packed into it), -1 for padding.
  std::vector<int64_t> sample_ids;
  // The valid (labelled) tokens of each token's whole document, n_s of §3 even where the
  // document spans the ranks of an SP group; 0 for padding.
  std::vector<int64_t> sample_valid;
  // Attention's layout: each token's position in its document (RoPE), and for every
  // token of the WHOLE sequences [batch * seq_len] the index within its sequence of its
  // document's first token (-1 for padding).
  std::vector<int32_t> positions;
  std::vector<int32_t> doc_start;
  // The global index of each sequence (row) in the stream (see RankDataLoader).
  std::vector<int64_t> sequence_ids;
  // The documents packed into each sequence, in order (for tests and dumps).
  std::vector<std::vector<int64_t>> doc_ids;
  // Label streams 1 .. S - 1 (data/streams.h), at index s - 1, when the loader gives S > 1
  // (SetLabelStreams); tokens, labels and sample_valid above are stream 0. For each local
  // token t, rolled on the WHOLE sequence so that no rank of an SP or CP group needs
  // another's tokens: the input token x_s[t] = token[t + s] when t + s is in t's document,
  // else 0; the label y_s[t] = label[t + s] under the same condition, else kIgnoreIndex; and
  // n_s of stream s (the valid stream-s labels of t's whole document, doc length - 1 - s, at
  // least 0; 0 for padding).
  struct Stream {
    std::vector<int32_t> tokens;
    std::vector<int32_t> labels;
    std::vector<int64_t> sample_valid;
  };
  std::vector<Stream> extra_streams;

  int64_t valid_tokens() const;   // labels != kIgnoreIndex
  int64_t routed_tokens() const;  // mask == 1
};

// Packs the global sequence stream and hands rank `rank` its rows of every step.
class RankDataLoader {
 public:
  // The rows of data rank `place.data_rank` of `place.data_ranks`, of each of which this
  // rank holds the positions of `place.shard` (data/shard.h: DataPlaceOf gives a world
  // rank's place; the shard says which positions, whatever parallelism made it).
  // InvalidArgument if the data rank is outside [0, data_ranks), the shard is of sequences
  // of another length than data.seq_len, the corpus has no document, no document has a
  // trainable token (all shorter than 2 tokens) or a document is longer than data.seq_len;
  // the message names the corpus (Describe).
  static absl::StatusOr<RankDataLoader> Create(std::shared_ptr<const DocumentSource> corpus,
                                               const train::DataConfig& config,
                                               const DataPlace& place);
  // Data rank `rank` of `world`, holding whole sequences.
  static absl::StatusOr<RankDataLoader> Create(std::shared_ptr<const DocumentSource> corpus,
                                               const train::DataConfig& config, int rank,
                                               int world);

  // The next `grad_acc` micro-batches of this rank (one optimizer step).
  std::vector<MicroBatch> NextStep(int grad_acc);
  // Advances as if NextStep(grad_acc) had been called `steps` times, without generating
  // tokens (packs document lengths only).
  void SkipSteps(int64_t steps, int grad_acc);

  // The stream's position after the steps so far; Seek(position()) on a loader of any
  // rank and world continues the same stream. InvalidArgument naming the value if
  // next_document is outside [0, num_documents) or sequences is negative.
  DataPosition position() const { return packer_.position(); }
  absl::Status Seek(const DataPosition& position);

  // The label streams NextStep gives each micro-batch: stream 0 and S - 1 more, each with its
  // rolled inputs and labels (MicroBatch::extra_streams). 1 (the default): stream 0 only.
  // InvalidArgument for S < 1.
  absl::Status SetLabelStreams(int streams);

 private:
  RankDataLoader(SequencePacker packer, SequenceShard shard)
      : packer_(std::move(packer)), shard_(shard) {}
  // A micro-batch of empty rows: padding everywhere.
  MicroBatch EmptyMicroBatch() const;
  // Lays the documents `docs` of a packed sequence out as row j of `mb`: the shard's
  // positions of every stream; `sample` counts the step's documents so far.
  void FillRow(const std::vector<int64_t>& docs, int j, int64_t& sample, MicroBatch& mb) const;

  SequencePacker packer_;     // the global stream
  SequenceShard shard_;       // this rank's positions of each sequence
  int rank_ = 0, world_ = 1;  // the data rank and the number of them (DataPlace)
  int micro_batch_ = 0;
  int streams_ = 1;
};

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_LOADER_H_
