#ifndef GRADSUM_COLLECTIVES_MESH_H_
#define GRADSUM_COLLECTIVES_MESH_H_

// Mesh: the (F, P) device mesh over the world and its three groups (SEMANTICS.md §1).
//
// Row-major: rank = f * P + p.
// - ep_group(): the P ranks with my f (contiguous ranks; they hold different experts),
//   ordered by p, so ep_group().rank() == p_index().
// - edp_group(): the F ranks with my p (stride P; they hold the same experts), ordered by
//   f, so edp_group().rank() == f_index().
// - world(): all W = F * P ranks.
//
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh, Mesh::Create(&world, /*ep_size=*/2));
//   // dense grads: mesh->world(); expert grads of my slot: mesh->edp_group() (§7).
//   GRADSUM_RETURN_IF_ERROR(mesh->edp_group().AllReduce(g, g, n, DType::kF32));

#include <memory>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"

namespace gradsum {

class Mesh {
 public:
  // world: not owned, must outlive the Mesh. ep_size = P; F = world->size() / P.
  // P < 1, or a world size not divisible by P, is InvalidArgument naming both; a null
  // world is InvalidArgument. Collective over `world` (two Splits): every rank calls it
  // with the same ep_size.
  //
  // shard_size > 0 also builds HSDP's groups (SEMANTICS.md §7): shard groups of shard_size
  // consecutive ranks, replicated across world / shard_size groups. shard_size must divide
  // the world and be a multiple of ep_size (each EP group inside one shard group), else
  // InvalidArgument naming it. 0: none (the accessors below return null).
  static absl::StatusOr<std::unique_ptr<Mesh>> Create(Communicator* world, int ep_size,
                                                      int shard_size = 0);

  int world_size() const { return world_->size(); }
  int ep_size() const { return ep_size_; }    // P
  int edp_size() const { return edp_size_; }  // F
  int f_index() const { return world_->rank() / ep_size_; }
  int p_index() const { return world_->rank() % ep_size_; }

  Communicator& world() { return *world_; }
  Communicator& ep_group() { return *ep_group_; }
  Communicator& edp_group() { return *edp_group_; }

  // HSDP (Create's shard_size > 0), else 0 and null. With N = shard_size, R = W / N and
  // rank w = r * N + q:
  // - dense_shard_group(): the N ranks of shard group r (ordered by q): dense units' shards;
  // - dense_replica_group(): the R ranks with shard rank q (ordered by r);
  // - expert_shard_group(): the N / P ranks of this rank's EDP group inside its shard group
  //   (ordered by f): expert units' shards;
  // - expert_replica_group(): the R ranks of the EDP group at the same place in the other
  //   shard groups (ordered by r).
  int shard_size() const { return shard_size_; }
  Communicator* dense_shard_group() { return dense_shard_.get(); }
  Communicator* dense_replica_group() { return dense_replica_.get(); }
  Communicator* expert_shard_group() { return expert_shard_.get(); }
  Communicator* expert_replica_group() { return expert_replica_.get(); }

 private:
  Mesh(Communicator* world, int ep_size, std::unique_ptr<Communicator> ep_group,
       std::unique_ptr<Communicator> edp_group);

  Communicator* world_;
  int ep_size_;
  int edp_size_;
  std::unique_ptr<Communicator> ep_group_;
  std::unique_ptr<Communicator> edp_group_;
  int shard_size_ = 0;
  std::unique_ptr<Communicator> dense_shard_, dense_replica_, expert_shard_, expert_replica_;
};

// Two-level (HSDP-style) SUM reduce-scatter over the mesh: the shard group is ep_group()
// (P contiguous ranks), the replica group edp_group() (F ranks with the same p). `send`
// holds this rank's full buffer, P * shard_count elements; on return `shard` holds block
// p_index() of the SUM of `send` over all W ranks: first a reduce-scatter within the shard
// group (each rank gets the partial sum of its block over its P peers), then an
// all-reduce of that block across the replica group. Traffic per rank is that of one
// reduce-scatter of the full buffer plus one all-reduce of 1/P of it, instead of a flat
// all-reduce of the full buffer over W ranks.
// `shard` must not overlap `send` except as the reduce-scatter in-place layout
// (shard == send + p_index() * shard_count). Integer SUMs and f32/f64 values that sum
// exactly equal the flat SUM bit for bit; floating sums in general differ from the flat
// order by rounding (and bf16/f16 round after each level). Collective over the whole mesh.
absl::Status HierarchicalReduceScatter(Mesh& mesh, const void* send, void* shard,
                                       size_t shard_count, DType dtype);

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_MESH_H_
