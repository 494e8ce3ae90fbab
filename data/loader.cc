#include "data/loader.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "data/streams.h"

namespace gradsum::data {

int64_t MicroBatch::valid_tokens() const {
  return std::count_if(labels.begin(), labels.end(), [](int32_t y) { return y != kIgnoreIndex; });
}

int64_t MicroBatch::routed_tokens() const { return std::count(mask.begin(), mask.end(), 1); }

absl::StatusOr<RankDataLoader> RankDataLoader::Create(std::shared_ptr<const DocumentSource> corpus,
                                                      const train::DataConfig& config, int rank,
                                                      int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank=", rank, ": must be in [0, world=", world, ")"));
  }
  DataPlace place;
  place.data_rank = rank;
  place.data_ranks = world;
  if (config.seq_len() >= 1) {
    GRADSUM_ASSIGN_OR_RETURN(place.shard, SequenceShard::Create(config.seq_len(), 1, 0, 1, 0));
  }
  return Create(std::move(corpus), config, place);
}

absl::StatusOr<RankDataLoader> RankDataLoader::Create(std::shared_ptr<const DocumentSource> corpus,
                                                      const train::DataConfig& config,
                                                      const DataPlace& place) {
  if (place.data_ranks < 1 || place.data_rank < 0 || place.data_rank >= place.data_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("data rank ", place.data_rank, ": must be in [0, ", place.data_ranks, ")"));
  }
  if (config.seq_len() < 2 || config.micro_batch() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("data.seq_len=", config.seq_len(),
                                                   ", data.micro_batch=", config.micro_batch(),
                                                   ": need seq_len >= 2 and micro_batch >= 1"));
  }
  GRADSUM_ASSIGN_OR_RETURN(SequencePacker packer,
                           SequencePacker::Create(std::move(corpus), config.seq_len()));
  if (place.shard.seq_len() != config.seq_len()) {
    return absl::InvalidArgumentError(absl::StrCat("data.seq_len=", config.seq_len(),
                                                   ": the rank's shard is of sequences of ",
                                                   place.shard.seq_len(), " tokens"));
  }
  RankDataLoader loader(std::move(packer), place.shard);
  loader.rank_ = place.data_rank;
  loader.world_ = place.data_ranks;
  loader.micro_batch_ = config.micro_batch();
  return loader;
}

absl::Status RankDataLoader::Seek(const DataPosition& position) { return packer_.Seek(position); }

absl::Status RankDataLoader::SetLabelStreams(int streams) {
  if (streams < 1) {
    return absl::InvalidArgumentError(absl::StrCat("label streams ", streams, ": must be >= 1"));
  }
  streams_ = streams;
  return absl::OkStatus();
}

MicroBatch RankDataLoader::EmptyMicroBatch() const {
  MicroBatch mb;
  mb.batch = micro_batch_;
  mb.seq_len = static_cast<int>(shard_.seq_len());
  mb.local_seq_len = static_cast<int>(shard_.local_len());
  const size_t n = static_cast<size_t>(micro_batch_) * mb.local_seq_len;
  mb.tokens.assign(n, 0);
  mb.labels.assign(n, kIgnoreIndex);
  mb.mask.assign(n, 0);
  mb.sample_ids.assign(n, -1);
  mb.sample_valid.assign(n, 0);
  mb.positions.assign(n, 0);
  mb.doc_start.assign(static_cast<size_t>(micro_batch_) * mb.seq_len, -1);
  mb.sequence_ids.assign(micro_batch_, -1);
  mb.doc_ids.assign(micro_batch_, {});
  mb.extra_streams.assign(streams_ - 1,
                          {std::vector<int32_t>(n, 0), std::vector<int32_t>(n, kIgnoreIndex),
                           std::vector<int64_t>(n, 0)});
  return mb;
}

void RankDataLoader::FillRow(const std::vector<int64_t>& docs, int j, int64_t& sample,
                             MicroBatch& mb) const {
  const size_t local = static_cast<size_t>(mb.local_seq_len);
  int64_t pos = 0;  // in the whole sequence
  for (int64_t id : docs) {
    const std::vector<int32_t> doc = packer_.corpus().Document(id);
    const int64_t length = static_cast<int64_t>(doc.size());
    ++sample;
    const int64_t start = pos;
    for (size_t t = 0; t < doc.size(); ++t, ++pos) {
      mb.doc_start[static_cast<size_t>(j) * mb.seq_len + pos] = static_cast<int32_t>(start);
      const int64_t held = shard_.LocalIndex(pos);
      if (held < 0) continue;  // another rank of the SP / CP group holds it
      const size_t at = static_cast<size_t>(j) * local + held;
      mb.mask[at] = 1;
      mb.sample_ids[at] = sample;
      mb.positions[at] = static_cast<int32_t>(t);
      // Stream 0 (the main one), then streams 1 .. S - 1.
      mb.tokens[at] = StreamInput(doc, 0, t);
      mb.labels[at] = StreamLabel(doc, 0, t);
      mb.sample_valid[at] = StreamValidTokens(length, 0);
      for (int s = 1; s < streams_; ++s) {
        MicroBatch::Stream& stream = mb.extra_streams[s - 1];
        stream.tokens[at] = StreamInput(doc, s, t);
        stream.labels[at] = StreamLabel(doc, s, t);
        stream.sample_valid[at] = StreamValidTokens(length, s);
      }
    }
  }
}

std::vector<MicroBatch> RankDataLoader::NextStep(int grad_acc) {
  std::vector<MicroBatch> step(grad_acc);
  for (MicroBatch& mb : step) mb = EmptyMicroBatch();
  // The step's global sequences k = (m world + r) micro_batch + j, in order: this rank's
  // rows come in (m, j) order, so sample ids count its documents in packing order.
  int64_t sample = -1;  // index of the current document among those packed into the step
  const int per_micro = world_ * micro_batch_;
  for (int64_t k = 0; k < int64_t{grad_acc} * per_micro; ++k) {
    const int64_t index = packer_.position().sequences;
    std::vector<int64_t> docs = packer_.NextSequence();
    const int m = static_cast<int>(k / per_micro);
    const int r = static_cast<int>(k % per_micro) / micro_batch_;
    const int j = static_cast<int>(k % micro_batch_);
    if (r != rank_) continue;
    MicroBatch& mb = step[m];
    mb.sequence_ids[j] = index;
    FillRow(docs, j, sample, mb);
    mb.doc_ids[j] = std::move(docs);
  }
  return step;
}

void RankDataLoader::SkipSteps(int64_t steps, int grad_acc) {
  packer_.Skip(steps * grad_acc * world_ * micro_batch_);
}

}  // namespace gradsum::data
