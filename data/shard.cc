#include "data/shard.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum::data {

absl::StatusOr<SequenceShard> SequenceShard::Create(int64_t seq_len, int sp, int sp_rank, int cp,
                                                    int cp_rank) {
  if (seq_len < 1) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len=", seq_len, ": must be positive"));
  }
  if (sp < 1 || sp_rank < 0 || sp_rank >= sp) {
    return absl::InvalidArgumentError(
        absl::StrCat("sp_rank=", sp_rank, ": must be in [0, sp=", sp, ")"));
  }
  if (cp < 1 || cp_rank < 0 || cp_rank >= cp) {
    return absl::InvalidArgumentError(
        absl::StrCat("cp_rank=", cp_rank, ": must be in [0, cp=", cp, ")"));
  }
  if (cp > 1 && seq_len % (2 * cp) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cp=", cp, ": 2 cp must divide seq_len=", seq_len, " (two chunks per CP rank)"));
  }
  if ((seq_len / cp) % sp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sp=", sp, ": must divide seq_len / cp = ", seq_len / cp));
  }
  SequenceShard shard;
  shard.seq_len_ = seq_len;
  shard.sp_ = sp;
  shard.sp_rank_ = sp_rank;
  shard.cp_ = cp;
  shard.cp_rank_ = cp_rank;
  return shard;
}

int64_t SequenceShard::Position(int64_t u) const {
  // Local token u is token sp_rank local + u of the CP rank's two chunks put together.
  const int64_t v = sp_rank_ * local_len() + u;
  return cp_ == 1 ? v : ZigzagIndex(cp_, cp_rank_, seq_len_ / (2 * cp_), v);
}

int64_t SequenceShard::LocalIndex(int64_t pos) const {
  // pos's index in the CP rank's two chunks put together, or -1 if another CP rank has it.
  int64_t v = pos;
  if (cp_ > 1) {
    const int64_t chunk = seq_len_ / (2 * cp_);
    const int64_t c = pos / chunk;
    if (c == ZigzagChunk(cp_, cp_rank_, 0)) {
      v = pos - c * chunk;
    } else if (c == ZigzagChunk(cp_, cp_rank_, 1)) {
      v = chunk + pos - c * chunk;
    } else {
      return -1;
    }
  }
  const int64_t first = sp_rank_ * local_len();
  return v >= first && v < first + local_len() ? v - first : -1;
}

int64_t ContiguousPiece(int64_t seq_len, int sp, int cp) {
  if (cp <= 1) return seq_len / sp;
  return std::gcd(seq_len / (2 * int64_t{cp}), seq_len / (int64_t{cp} * sp));
}

absl::StatusOr<DataPlace> DataPlaceOf(const train::ParallelismConfig& parallelism, int64_t seq_len,
                                      int rank) {
  const int world = parallelism.world(), sp = parallelism.sp(), cp = parallelism.cp();
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank=", rank, ": must be in [0, world=", world, ")"));
  }
  if (sp < 1 || cp < 1 || world % (int64_t{sp} * cp) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("parallelism.sp=", sp, " x parallelism.cp=", cp,
                                                   ": must divide world=", world));
  }
  DataPlace place;
  place.data_rank = rank / (sp * cp);
  place.data_ranks = world / (sp * cp);
  // Ranks of a data rank's group: SP innermost, then CP.
  GRADSUM_ASSIGN_OR_RETURN(
      place.shard, SequenceShard::Create(seq_len, sp, rank % sp, cp, (rank % (sp * cp)) / sp));
  return place;
}

}  // namespace gradsum::data
