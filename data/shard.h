#ifndef GRADSUM_DATA_SHARD_H_
#define GRADSUM_DATA_SHARD_H_

// Which positions of a packed sequence one rank holds under sequence parallelism
// (SEMANTICS.md §12) and context parallelism (§16): the last stage of corpus -> packer ->
// shard. The layout is written here once; the loader (data/loader.h) fills a rank's tokens
// with it and ring attention (model/ring_attention.h) finds the other ranks' rows with it.
//
// The zigzag layout of a CP group of C ranks: each sequence of seq_len tokens is cut into 2C
// chunks of seq_len / 2C tokens, and CP rank i holds chunks i and 2C-1-i, put together in
// that order (so every rank has the same causal attention work). An SP group of S ranks then
// splits those seq_len / C tokens into S consecutive slices: SP rank k holds slice k. Without
// CP (C = 1) the two chunks are the whole sequence, so SP alone slices the sequence.
//
//   GRADSUM_ASSIGN_OR_RETURN(SequenceShard shard, SequenceShard::Create(seq_len, sp, sp_rank,
//                                                                       cp, cp_rank));
//   for (int64_t u = 0; u < shard.local_len(); ++u) local[u] = whole[shard.Position(u)];
//
// A rank's whole place in the data, from the config (DataPlaceOf): which rows it reads and
// its shard of them, a value that the loader, the trainer and the parity reference use
// without knowing which parallelism axes made it.
//
//   GRADSUM_ASSIGN_OR_RETURN(DataPlace place,
//                            DataPlaceOf(config.parallelism(), config.data().seq_len(), rank));
//   GRADSUM_ASSIGN_OR_RETURN(auto loader, RankDataLoader::Create(corpus, config.data(), place));

#include <cstdint>

#include "absl/status/statusor.h"
#include "train/config.pb.h"

namespace gradsum::data {

// The chunk (0 .. 2cp-1) that CP rank `rank` of a group of `cp` holds as its local chunk
// a (0 or 1): chunk `rank` first, chunk 2cp-1-rank second.
inline int64_t ZigzagChunk(int cp, int rank, int a) {
  return a == 0 ? rank : 2 * int64_t{cp} - 1 - rank;
}

// The position within its sequence of local token u (0 <= u < 2 chunk) of CP rank `rank` of
// a group of `cp`, with `chunk` = seq_len / 2cp tokens per chunk.
inline int64_t ZigzagIndex(int cp, int rank, int64_t chunk, int64_t u) {
  return u < chunk ? ZigzagChunk(cp, rank, 0) * chunk + u
                   : ZigzagChunk(cp, rank, 1) * chunk + (u - chunk);
}

// One rank's share of every packed sequence: a value, the same for each sequence.
class SequenceShard {
 public:
  // The share of SP rank `sp_rank` of `sp` and CP rank `cp_rank` of `cp` in sequences of
  // `seq_len` tokens. InvalidArgument naming the value unless seq_len >= 1, sp >= 1 and
  // cp >= 1 with ranks in [0, sp) and [0, cp), 2 cp divides seq_len when cp > 1, and sp
  // divides seq_len / cp.
  static absl::StatusOr<SequenceShard> Create(int64_t seq_len, int sp, int sp_rank, int cp,
                                              int cp_rank);
  // An empty shard (seq_len 0), to be assigned from Create.
  SequenceShard() = default;

  int64_t seq_len() const { return seq_len_; }
  // Tokens of each sequence this rank holds: seq_len / (sp cp).
  int64_t local_len() const { return seq_len_ / (int64_t{sp_} * cp_); }

  // The position in the whole sequence of local token u, 0 <= u < local_len().
  int64_t Position(int64_t u) const;
  // The local index of whole-sequence position `pos`, or -1 if another rank holds it.
  int64_t LocalIndex(int64_t pos) const;

 private:
  int64_t seq_len_ = 0;
  int sp_ = 1, sp_rank_ = 0;
  int cp_ = 1, cp_rank_ = 0;
};

// The tokens of each contiguous piece of a sequence that a rank holds (SEMANTICS.md §12,
// §16): seq_len / sp without CP; with CP, a rank's two zigzag chunks of seq_len / 2cp are
// split into sp slices of seq_len / (cp sp), so a piece is gcd(seq_len / 2cp,
// seq_len / (cp sp)). A row block must divide it to lie at the same global positions at
// every mesh (train/config.cc checks the reproducible block against it).
int64_t ContiguousPiece(int64_t seq_len, int sp, int cp);

// A world rank's place in the data (SEMANTICS.md §12, §16). The ranks that share sequences
// are consecutive, SP innermost, then CP (collectives/mesh.h lays its groups out the same
// way); each such group is one data rank, reading its own rows of the global stream.
struct DataPlace {
  int data_rank = 0;    // whose rows: rank / (sp cp)
  int data_ranks = 1;   // how many read different rows: world / (sp cp)
  SequenceShard shard;  // this rank's positions of each of those sequences
};

// World rank `rank` of parallelism.world() at sequences of `seq_len` tokens. InvalidArgument
// naming the value for a rank outside [0, world), sp or cp below 1, sp cp not dividing the
// world, or SequenceShard::Create's errors.
absl::StatusOr<DataPlace> DataPlaceOf(const train::ParallelismConfig& parallelism, int64_t seq_len,
                                      int rank);

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_SHARD_H_
