#ifndef GRADSUM_COLLECTIVES_MESH_H_
#define GRADSUM_COLLECTIVES_MESH_H_

// Mesh: one rank's device mesh, every parallelism axis named, built and checked once
// (SEMANTICS.md §1, §7, §12, §16). `group(axis)` is always a communicator: a group of one
// (SelfCommunicator) when the axis is off, never null, so no caller branches on whether a
// parallelism is on beside the group it holds; `size(axis) > 1` says whether it is.
//
// Rank layout (row-major, the same at every backend):
// - kEp: the P ranks with my f (contiguous; they hold different experts), ordered by p, so
//   rank(kEp) == p_index(); kEdp: the F = W / P ranks with my p (stride P; they hold the
//   same experts), ordered by f. World rank w = f P + p (§1).
// - kSp: the S consecutive ranks that share my sequences, each holding 1/S of every
//   sequence's tokens (Ulysses, §12).
// - kCp: with C > 1, blocks of C S consecutive ranks share sequences; the CP group is the C
//   ranks at my place in each SP group of my block (zigzag chunks, §16).
// - HSDP (shape.shard_group = N > 0, §7): w = r N + q. kDpShard: the N ranks of shard group
//   r (a dense unit's shards); kDpReplicate: the W / N ranks with shard rank q; kEdpShard:
//   the N / P ranks of my EDP group inside my shard group (an expert unit's shards);
//   kEdpReplicate: the ranks of the EDP group at my place in the other shard groups.
//   Without HSDP, kDpShard is the world and kEdpShard the EDP group (a unit is reduced over
//   them: reduce-scattered in fsdp, all-reduced when replicated) and both replicate axes
//   are groups of one.
// - kPp: the pipeline axis, reserved; a group of one today.
//
// A device view (AttachDeviceView) adds the same groups over a device backend's world (the
// NCCL communicators of `--backend=nccl`): `device_group(axis)` is where a device's
// collectives run; without a view it is `group(axis)` (host compute: the host groups are
// the device's).
//
//   MeshShape shape{.ep = 2, .sp = 2};
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh, Mesh::Create(&world, shape));
//   // dense grads over mesh->group(MeshAxis::kDpShard); expert grads over kEdpShard (§7)
//   GRADSUM_RETURN_IF_ERROR(mesh->group(MeshAxis::kSp).AllToAllV(...));

#include <array>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"

namespace gradsum {

enum class MeshAxis : int {
  kWorld = 0,
  kEp,
  kEdp,
  kSp,
  kCp,
  kDpShard,
  kDpReplicate,
  kEdpShard,
  kEdpReplicate,
  kPp,
};
inline constexpr int kNumMeshAxes = 10;

// "world", "ep", "edp", "sp", "cp", "dp_shard", "dp_replicate", "edp_shard",
// "edp_replicate", "pp".
const char* MeshAxisName(MeshAxis axis);

// The sizes a mesh is built from (the config's parallelism section).
struct MeshShape {
  int ep = 1;           // P: divides the world
  int sp = 1;           // S
  int cp = 1;           // C: S C divides the world
  int shard_group = 0;  // HSDP's N: 0 none; else divides the world, a multiple of ep
};

// How a mesh makes each axis's group from its world: the default is world->Split(color,
// key). A caller that decorates groups per axis (train/rank_main.cc times SP's all-to-alls
// and CP's ring as their own kinds) passes its own.
using MeshSplitFn = std::function<absl::StatusOr<std::unique_ptr<Communicator>>(
    Communicator& world, MeshAxis axis, int color, int key)>;

class Mesh {
 public:
  // world: not owned, must outlive the Mesh. Checks the shape once, naming the value:
  // InvalidArgument for a null world, a size below 1, ep, sp cp or shard_group not dividing
  // the world, or a shard_group that is not a multiple of ep. Collective over `world`
  // (one Split per axis that is on, EP and EDP always): every rank passes the same shape.
  static absl::StatusOr<std::unique_ptr<Mesh>> Create(Communicator* world, const MeshShape& shape,
                                                      const MeshSplitFn& split = {});
  // The (F, P) mesh with HSDP's groups when shard_size > 0 (Create with {ep, shard_size}).
  static absl::StatusOr<std::unique_ptr<Mesh>> Create(Communicator* world, int ep_size,
                                                      int shard_size = 0);
  ~Mesh();

  // The group of `axis` (host memory); a group of one when the axis is off.
  Communicator& group(MeshAxis axis) const { return *host_[static_cast<int>(axis)]; }
  int size(MeshAxis axis) const { return group(axis).size(); }
  int rank(MeshAxis axis) const { return group(axis).rank(); }
  const MeshShape& shape() const { return shape_; }
  bool hsdp() const { return shape_.shard_group > 0; }

  // Builds the same groups over `device_world` (owned from now on; the same ranks in the
  // same order as the host world, one device each), so that device_group(axis) is the
  // device backend's group of `axis`. Collective over `device_world`. InvalidArgument when
  // its rank or size differs from the host world's, or when a device group's rank or size
  // differs from its host twin's (a backend whose Split disagrees with the host's).
  absl::Status AttachDeviceView(std::unique_ptr<Communicator> device_world,
                                const MeshSplitFn& split = {});
  bool has_device_view() const { return device_world_ != nullptr; }
  Communicator& device_group(MeshAxis axis) const { return *device_[static_cast<int>(axis)]; }

  // Shorthands of the (F, P) mesh (SEMANTICS.md §1).
  int world_size() const { return size(MeshAxis::kWorld); }
  int ep_size() const { return shape_.ep; }                  // P
  int edp_size() const { return world_size() / shape_.ep; }  // F
  int f_index() const { return rank(MeshAxis::kWorld) / shape_.ep; }
  int p_index() const { return rank(MeshAxis::kWorld) % shape_.ep; }
  Communicator& world() const { return group(MeshAxis::kWorld); }
  Communicator& ep_group() const { return group(MeshAxis::kEp); }
  Communicator& edp_group() const { return group(MeshAxis::kEdp); }
  int shard_size() const { return shape_.shard_group; }

 private:
  // Each axis's group over `world` into `groups` (owning the new ones in `owned`).
  struct Groups {
    std::array<Communicator*, kNumMeshAxes> at{};
    std::array<std::unique_ptr<Communicator>, kNumMeshAxes> owned;
  };
  static absl::Status SplitAxes(Communicator& world, const MeshShape& shape,
                                const MeshSplitFn& split, Groups& groups);
  Mesh() = default;

  MeshShape shape_;
  Groups host_groups_;
  std::array<Communicator*, kNumMeshAxes> host_{};
  std::unique_ptr<Communicator> device_world_;
  Groups device_groups_;
  std::array<Communicator*, kNumMeshAxes> device_{};
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
