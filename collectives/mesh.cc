#include "collectives/mesh.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/self_communicator.h"
#include "core/status.h"

namespace gradsum {

const char* MeshAxisName(MeshAxis axis) {
  switch (axis) {
    case MeshAxis::kWorld:
      return "world";
    case MeshAxis::kEp:
      return "ep";
    case MeshAxis::kEdp:
      return "edp";
    case MeshAxis::kSp:
      return "sp";
    case MeshAxis::kCp:
      return "cp";
    case MeshAxis::kDpShard:
      return "dp_shard";
    case MeshAxis::kDpReplicate:
      return "dp_replicate";
    case MeshAxis::kEdpShard:
      return "edp_shard";
    case MeshAxis::kEdpReplicate:
      return "edp_replicate";
    case MeshAxis::kPp:
      return "pp";
  }
  return "invalid";
}

namespace {

// The shape's one check (every message names the sizes).
absl::Status CheckShape(int w, const MeshShape& s) {
  if (s.ep < 1 || w % s.ep != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh: ep ", s.ep, " must be >= 1 and divide the world size ", w));
  }
  if (s.sp < 1 || s.cp < 1 || w % (s.sp * s.cp) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("mesh: sp ", s.sp, " x cp ", s.cp,
                                                   " must be >= 1 and divide the world size ", w));
  }
  if (s.shard_group < 0 ||
      (s.shard_group > 0 && (w % s.shard_group != 0 || s.shard_group % s.ep != 0))) {
    return absl::InvalidArgumentError(absl::StrCat("mesh: shard_group ", s.shard_group,
                                                   " must be 0, or divide the world size ", w,
                                                   " and be a multiple of ep ", s.ep));
  }
  return absl::OkStatus();
}

// Where each axis's group puts this rank: its color (which group) and key (its place).
struct Place {
  MeshAxis axis;
  int color, key, size;
};

}  // namespace

absl::Status Mesh::SplitAxes(Communicator& world, const MeshShape& s, const MeshSplitFn& split,
                             Groups& g) {
  const int w = world.size(), me = world.rank(), P = s.ep;
  const int f = me / P, p = me % P;
  std::vector<Place> places = {{MeshAxis::kEp, f, p, P}, {MeshAxis::kEdp, p, f, w / P}};
  if (s.shard_group > 0) {
    // §7 (HSDP): w = r N + q; the EDP group's k = N / P ranks in shard group r are
    // f = r k .. r k + k - 1.
    const int N = s.shard_group, r = me / N, q = me % N, k = N / P;
    places.push_back({MeshAxis::kDpShard, r, q, N});
    places.push_back({MeshAxis::kDpReplicate, q, r, w / N});
    places.push_back({MeshAxis::kEdpShard, r * P + p, f % k, k});
    places.push_back({MeshAxis::kEdpReplicate, p * k + f % k, r, w / N});
  }
  if (s.sp > 1) places.push_back({MeshAxis::kSp, me / s.sp, me % s.sp, s.sp});
  if (s.cp > 1) {
    // §16: sp cp consecutive ranks share sequences; the CP group is the ranks at the same
    // place in each SP group of the block.
    const int shared = s.sp * s.cp;
    places.push_back({MeshAxis::kCp, (me / shared) * s.sp + me % s.sp, (me % shared) / s.sp, s.cp});
  }
  g.at[static_cast<int>(MeshAxis::kWorld)] = &world;
  for (const Place& pl : places) {
    const int a = static_cast<int>(pl.axis);
    GRADSUM_ASSIGN_OR_RETURN(g.owned[a], split ? split(world, pl.axis, pl.color, pl.key)
                                               : world.Split(pl.color, pl.key));
    if (g.owned[a] == nullptr || g.owned[a]->size() != pl.size || g.owned[a]->rank() != pl.key) {
      return absl::InternalError(absl::StrCat("mesh: ", world.backend(),
                                              " Split returned an inconsistent ",
                                              MeshAxisName(pl.axis), " group on rank ", me));
    }
    g.at[a] = g.owned[a].get();
  }
  if (s.shard_group == 0) {
    // Without HSDP a unit is reduced over the world (dense) or the EDP group (experts).
    g.at[static_cast<int>(MeshAxis::kDpShard)] = &world;
    g.at[static_cast<int>(MeshAxis::kEdpShard)] = g.at[static_cast<int>(MeshAxis::kEdp)];
  }
  for (int a = 0; a < kNumMeshAxes; ++a) {
    if (g.at[a] == nullptr) {
      g.owned[a] = std::make_unique<SelfCommunicator>();
      g.at[a] = g.owned[a].get();
    }
  }
  return absl::OkStatus();
}

Mesh::~Mesh() = default;

absl::StatusOr<std::unique_ptr<Mesh>> Mesh::Create(Communicator* world, const MeshShape& shape,
                                                   const MeshSplitFn& split) {
  if (world == nullptr) return absl::InvalidArgumentError("mesh: the world communicator is null");
  GRADSUM_RETURN_IF_ERROR(CheckShape(world->size(), shape));
  std::unique_ptr<Mesh> mesh(new Mesh());
  mesh->shape_ = shape;
  GRADSUM_RETURN_IF_ERROR(SplitAxes(*world, shape, split, mesh->host_groups_));
  mesh->host_ = mesh->host_groups_.at;
  mesh->device_ = mesh->host_;
  return mesh;
}

absl::StatusOr<std::unique_ptr<Mesh>> Mesh::Create(Communicator* world, int ep_size,
                                                   int shard_size) {
  return Create(world, MeshShape{.ep = ep_size, .shard_group = shard_size});
}

absl::Status Mesh::AttachDeviceView(std::unique_ptr<Communicator> device_world,
                                    const MeshSplitFn& split) {
  if (device_world == nullptr) {
    return absl::InvalidArgumentError("mesh: the device world communicator is null");
  }
  const Communicator& host_world = world();
  if (device_world->rank() != host_world.rank() || device_world->size() != host_world.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh: the ", device_world->backend(), " world is rank ", device_world->rank(),
                     " of ", device_world->size(), " but the host world is rank ",
                     host_world.rank(), " of ", host_world.size()));
  }
  Groups groups;
  GRADSUM_RETURN_IF_ERROR(SplitAxes(*device_world, shape_, split, groups));
  device_world_ = std::move(device_world);
  device_groups_ = std::move(groups);
  device_ = device_groups_.at;
  return absl::OkStatus();
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
