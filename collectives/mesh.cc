#include "collectives/mesh.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum {

Mesh::Mesh(Communicator* world, int ep_size, std::unique_ptr<Communicator> ep_group,
           std::unique_ptr<Communicator> edp_group)
    : world_(world),
      ep_size_(ep_size),
      edp_size_(world->size() / ep_size),
      ep_group_(std::move(ep_group)),
      edp_group_(std::move(edp_group)) {}

absl::StatusOr<std::unique_ptr<Mesh>> Mesh::Create(Communicator* world, int ep_size,
                                                   int shard_size) {
  if (world == nullptr) return absl::InvalidArgumentError("Mesh::Create: world is null");
  const int w = world->size();
  if (ep_size < 1 || w % ep_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Mesh::Create: ep_size ", ep_size,
                                                   " must be >= 1 and divide the world size ", w));
  }
  if (shard_size < 0 || (shard_size > 0 && (w % shard_size != 0 || shard_size % ep_size != 0))) {
    return absl::InvalidArgumentError(absl::StrCat("Mesh::Create: shard_size ", shard_size,
                                                   " must be 0, or divide the world size ", w,
                                                   " and be a multiple of ep_size ", ep_size));
  }
  const int f = world->rank() / ep_size;
  const int p = world->rank() % ep_size;
  // SEMANTICS.md §1: EP group = same f (ordered by p), EDP group = same p (ordered by f).
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> ep_group, world->Split(f, p));
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> edp_group, world->Split(p, f));
  if (ep_group == nullptr || edp_group == nullptr || ep_group->size() != ep_size ||
      edp_group->size() != w / ep_size || ep_group->rank() != p || edp_group->rank() != f) {
    return absl::InternalError(absl::StrCat("Mesh::Create: ", world->backend(),
                                            " Split returned an inconsistent group on rank ",
                                            world->rank()));
  }
  std::unique_ptr<Mesh> mesh(new Mesh(world, ep_size, std::move(ep_group), std::move(edp_group)));
  if (shard_size > 0) {
    // SEMANTICS.md §7 (HSDP): rank w = r * N + q; the EDP group's k = N / P ranks in shard
    // group r are f = r * k .. r * k + k - 1.
    const int N = shard_size, r = world->rank() / N, q = world->rank() % N, k = N / ep_size;
    mesh->shard_size_ = N;
    GRADSUM_ASSIGN_OR_RETURN(mesh->dense_shard_, world->Split(r, q));
    GRADSUM_ASSIGN_OR_RETURN(mesh->dense_replica_, world->Split(q, r));
    GRADSUM_ASSIGN_OR_RETURN(mesh->expert_shard_, world->Split(r * ep_size + p, f % k));
    GRADSUM_ASSIGN_OR_RETURN(mesh->expert_replica_, world->Split(p * k + f % k, r));
    if (mesh->dense_shard_->size() != N || mesh->dense_replica_->size() != w / N ||
        mesh->expert_shard_->size() != k || mesh->expert_replica_->size() != w / N ||
        mesh->expert_shard_->rank() != f % k || mesh->dense_replica_->rank() != r) {
      return absl::InternalError(absl::StrCat("Mesh::Create: ", world->backend(),
                                              " Split returned an inconsistent HSDP group on "
                                              "rank ",
                                              world->rank()));
    }
  }
  return mesh;
}

absl::Status HierarchicalReduceScatter(Mesh& mesh, const void* send, void* shard,
                                       size_t shard_count, DType dtype) {
  GRADSUM_RETURN_IF_ERROR(
      Annotate(mesh.ep_group().ReduceScatter(send, shard, shard_count, dtype, ReduceOp::kSum),
               "hierarchical reduce-scatter, within the shard group"));
  return Annotate(mesh.edp_group().AllReduce(shard, shard, shard_count, dtype, ReduceOp::kSum),
                  "hierarchical reduce-scatter, across the replica groups");
}

}  // namespace gradsum
