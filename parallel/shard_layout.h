#ifndef GRADSUM_PARALLEL_SHARD_LAYOUT_H_
#define GRADSUM_PARALLEL_SHARD_LAYOUT_H_

// How a flat buffer of parameters is spread over a group of ranks (SEMANTICS.md §7): the
// sharding mode and the one rule for where each rank's shard lies. FlatParam
// (parallel/flat_param.h), its gradient side (parallel/unit_grad.h), the checkpoint reader
// and the resharding loader all use it.

#include <algorithm>
#include <cstdint>

namespace gradsum {

// kSharded (FSDP / ZeRO-3): each rank keeps its shard; kReplicated (DDP): every rank keeps
// everything.
enum class ShardingMode { kSharded = 0, kReplicated = 1 };

// "sharded" or "replicated".
inline const char* ShardingModeName(ShardingMode mode) {
  switch (mode) {
    case ShardingMode::kSharded:
      return "sharded";
    case ShardingMode::kReplicated:
      return "replicated";
  }
  return "invalid";
}

// Where group rank `group_rank` of `group_size` stands in a flat buffer of `numel`
// elements: the buffer is padded with zeros to a multiple of the group size, and rank q
// owns [q * shard_numel, q * shard_numel + local_numel), its shard without the padding.
struct ShardLayout {
  int64_t padded_numel;  // numel rounded up to a multiple of group_size
  int64_t shard_numel;   // padded_numel / group_size
  int64_t shard_offset;  // group_rank * shard_numel
  int64_t local_numel;   // the shard's elements before the padding
};
inline ShardLayout ComputeShardLayout(int64_t numel, int64_t group_size, int64_t group_rank) {
  ShardLayout l;
  l.padded_numel = (numel + group_size - 1) / group_size * group_size;
  l.shard_numel = l.padded_numel / group_size;
  l.shard_offset = group_rank * l.shard_numel;
  l.local_numel = std::clamp<int64_t>(numel - l.shard_offset, 0, l.shard_numel);
  return l;
}

}  // namespace gradsum

#endif  // GRADSUM_PARALLEL_SHARD_LAYOUT_H_
