#include "data/packer.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace gradsum::data {

int64_t GlobalSequenceIndex(int64_t step, int m, int rank, int j, int world, int grad_acc,
                            int micro_batch) {
  const int64_t per_step = int64_t{world} * grad_acc * micro_batch;
  return step * per_step + (int64_t{m} * world + rank) * micro_batch + j;
}

absl::StatusOr<SequencePacker> SequencePacker::Create(std::shared_ptr<const DocumentSource> corpus,
                                                      int seq_len) {
  const int64_t n = corpus->num_documents();
  const std::string where = corpus->Describe();
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat(where, ": has no document"));
  if (corpus->MaxDocumentLength() > seq_len) {
    for (int64_t i = 0; i < n; ++i) {
      if (corpus->DocumentLength(i) > seq_len) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": document ", i, " has length ",
                                                       corpus->DocumentLength(i),
                                                       " > data.seq_len=", seq_len));
      }
    }
  }
  // A document needs 2 tokens for one labelled pair (SEMANTICS.md §1).
  bool trainable = corpus->MinDocumentLength() >= 2;
  for (int64_t i = 0; !trainable && i < n; ++i) trainable = corpus->DocumentLength(i) >= 2;
  if (!trainable) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": no trainable token in its ", n,
                     " documents (every document, i.e. line, has "
                     "fewer than 2 bytes, so no token has a next token to predict)"));
  }
  SequencePacker packer;
  packer.corpus_ = std::move(corpus);
  packer.seq_len_ = seq_len;
  return packer;
}

absl::Status SequencePacker::Seek(const DataPosition& position) {
  if (position.next_document < 0 || position.next_document >= corpus_->num_documents() ||
      position.sequences < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data position: next_document=", position.next_document,
                     ", sequences=", position.sequences, " is not a position in ",
                     corpus_->Describe(), " (", corpus_->num_documents(), " documents)"));
  }
  cursor_ = position.next_document;
  sequences_ = position.sequences;
  return absl::OkStatus();
}

std::vector<int64_t> SequencePacker::NextSequence() {
  std::vector<int64_t> docs;
  int64_t used = 0;
  const int64_t n = corpus_->num_documents();
  while (true) {
    const int64_t len = corpus_->DocumentLength(cursor_);
    if (used + len > seq_len_) break;  // every document fits an empty sequence
    docs.push_back(cursor_);
    used += len;
    if (++cursor_ == n) cursor_ = 0;  // next epoch
  }
  ++sequences_;
  return docs;
}

void SequencePacker::Skip(int64_t sequences) {
  for (int64_t s = 0; s < sequences; ++s) NextSequence();
}

}  // namespace gradsum::data
