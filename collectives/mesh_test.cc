#include "collectives/mesh.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

using ::gradsum::testing::RunRanks;

// Gathers the world ranks of `group`'s members, in group rank order.
absl::StatusOr<std::vector<int32_t>> Members(Communicator& group, int32_t world_rank) {
  std::vector<int32_t> out(group.size(), -1);
  absl::Status s = group.AllGather(&world_rank, out.data(), 1, DType::kI32);
  if (!s.ok()) return s;
  return out;
}

absl::Status CheckMesh(Communicator& world, int ep_size) {
  absl::StatusOr<std::unique_ptr<Mesh>> mesh = Mesh::Create(&world, ep_size);
  if (!mesh.ok()) return mesh.status();
  Mesh& m = **mesh;
  const int w = world.size(), r = world.rank(), f_size = w / ep_size;
  // Expected membership straight from SEMANTICS.md §1: rank = f * P + p.
  const int f = r / ep_size, p = r % ep_size;
  std::vector<int32_t> want_ep, want_edp;
  for (int q = 0; q < ep_size; ++q) want_ep.push_back(f * ep_size + q);
  for (int g = 0; g < f_size; ++g) want_edp.push_back(g * ep_size + p);
  const std::string what = absl::StrCat("W=", w, " P=", ep_size, " rank ", r);
  if (m.world_size() != w || m.ep_size() != ep_size || m.edp_size() != f_size || m.f_index() != f ||
      m.p_index() != p || &m.world() != &world || m.ep_group().rank() != p ||
      m.edp_group().rank() != f) {
    return absl::InternalError(absl::StrCat(what, ": wrong shape or indices: f ", m.f_index(),
                                            " p ", m.p_index(), " F ", m.edp_size()));
  }
  absl::StatusOr<std::vector<int32_t>> ep = Members(m.ep_group(), r);
  if (!ep.ok()) return ep.status();
  absl::StatusOr<std::vector<int32_t>> edp = Members(m.edp_group(), r);
  if (!edp.ok()) return edp.status();
  if (*ep != want_ep || *edp != want_edp) {
    return absl::InternalError(absl::StrCat(what, ": ep group {", absl::StrJoin(*ep, ","),
                                            "} edp group {", absl::StrJoin(*edp, ","), "}"));
  }
  return absl::OkStatus();
}

TEST(MeshTest, EveryShapeOfWorldSizesOneToEight) {
  for (int w = 1; w <= 8; ++w) {
    for (int ep = 1; ep <= w; ++ep) {
      if (w % ep != 0) continue;
      absl::Status s = RunRanks(w, [ep](Communicator& world) { return CheckMesh(world, ep); });
      EXPECT_TRUE(s.ok()) << s;
    }
  }
}

TEST(MeshTest, InvalidShapesNameBothNumbers) {
  absl::Status s = RunRanks(4, [](Communicator& world) -> absl::Status {
    for (int ep : {0, -2, 3, 8}) {
      absl::StatusOr<std::unique_ptr<Mesh>> m = Mesh::Create(&world, ep);
      if (m.status().code() != absl::StatusCode::kInvalidArgument ||
          !absl::StrContains(m.status().message(), absl::StrCat("ep_size ", ep)) ||
          !absl::StrContains(m.status().message(), "world size 4")) {
        return absl::InternalError(absl::StrCat("ep_size ", ep, ": ", m.status().ToString()));
      }
    }
    // Rejections are local and exchange nothing: the world is still in step.
    return CheckMesh(world, 2);
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(Mesh::Create(nullptr, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

// HSDP's groups (SEMANTICS.md §7), straight from the definition: rank w = r N + q; dense
// shard group = the N consecutive ranks of group r, dense replica group = the ranks with
// shard rank q; expert shard group = this rank's EDP ranks (same p) inside group r, ordered
// by f; expert replica group = the EDP rank at the same place in every group.
absl::Status CheckHsdpMesh(Communicator& world, int ep_size, int n) {
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh, Mesh::Create(&world, ep_size, n));
  const int w = world.size(), rank = world.rank(), R = w / n, k = n / ep_size;
  const int r = rank / n, q = rank % n, f = rank / ep_size, p = rank % ep_size;
  std::vector<int32_t> want_shard, want_replica, want_xshard, want_xreplica;
  for (int i = 0; i < n; ++i) want_shard.push_back(r * n + i);
  for (int g = 0; g < R; ++g) want_replica.push_back(g * n + q);
  for (int i = 0; i < k; ++i) want_xshard.push_back((r * k + i) * ep_size + p);
  for (int g = 0; g < R; ++g) want_xreplica.push_back((g * k + f % k) * ep_size + p);
  const std::string what = absl::StrCat("W=", w, " P=", ep_size, " N=", n, " rank ", rank);
  if (mesh->shard_size() != n) return absl::InternalError(absl::StrCat(what, ": shard_size"));
  const std::pair<Communicator*, const std::vector<int32_t>*> groups[] = {
      {mesh->dense_shard_group(), &want_shard},
      {mesh->dense_replica_group(), &want_replica},
      {mesh->expert_shard_group(), &want_xshard},
      {mesh->expert_replica_group(), &want_xreplica}};
  for (const auto& [group, want] : groups) {
    if (group == nullptr) return absl::InternalError(absl::StrCat(what, ": a null group"));
    GRADSUM_ASSIGN_OR_RETURN(std::vector<int32_t> got, Members(*group, rank));
    if (got != *want) {
      return absl::InternalError(absl::StrCat(what, ": group {", absl::StrJoin(got, ","),
                                              "}, want {", absl::StrJoin(*want, ","), "}"));
    }
  }
  return absl::OkStatus();
}

TEST(MeshTest, HsdpGroupsOfEveryShapeOfWorldSizesOneToEight) {
  for (int w = 1; w <= 8; ++w) {
    for (int ep = 1; ep <= w; ++ep) {
      for (int n = ep; n <= w; n += ep) {
        if (w % ep != 0 || w % n != 0) continue;
        absl::Status s =
            RunRanks(w, [ep, n](Communicator& world) { return CheckHsdpMesh(world, ep, n); });
        EXPECT_TRUE(s.ok()) << s;
      }
    }
  }
}

TEST(MeshTest, HsdpShardSizesThatDoNotFitAreNamed) {
  absl::Status s = RunRanks(8, [](Communicator& world) -> absl::Status {
    for (int n : {-1, 3, 6, 2}) {  // 2: not a multiple of ep_size 4
      absl::StatusOr<std::unique_ptr<Mesh>> m = Mesh::Create(&world, 4, n);
      if (m.status().code() != absl::StatusCode::kInvalidArgument ||
          !absl::StrContains(m.status().message(), absl::StrCat("shard_size ", n))) {
        return absl::InternalError(absl::StrCat("shard_size ", n, ": ", m.status().ToString()));
      }
    }
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> none, Mesh::Create(&world, 4));
    if (none->shard_size() != 0 || none->dense_shard_group() != nullptr) {
      return absl::InternalError("a mesh without shard_size has HSDP groups");
    }
    return CheckHsdpMesh(world, 4, 8);
  });
  EXPECT_TRUE(s.ok()) << s;
}

// The two-level SUM equals the flat SUM over the world: against a single-process
// reference and against the world all-reduce, for every mesh shape of 4, 6 and 8 ranks,
// with i64 (exact, wrapping) and f32 small integers (exact in any order).
absl::Status CheckHierarchical(Communicator& world, int ep_size, DType dtype) {
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh, Mesh::Create(&world, ep_size));
  const int w = world.size(), r = world.rank();
  const size_t shard_count = 37;
  const size_t n = shard_count * static_cast<size_t>(ep_size);
  const auto value = [](int rank, size_t i) {
    return static_cast<int64_t>((rank * 131 + static_cast<int64_t>(i) * 7) % 23) - 11;
  };
  // Reference: block p of the sum over all ranks, computed here for every rank.
  std::vector<int64_t> want(shard_count, 0);
  for (int q = 0; q < w; ++q) {
    for (size_t k = 0; k < shard_count; ++k) want[k] += value(q, mesh->p_index() * shard_count + k);
  }
  if (dtype == DType::kI64) {
    std::vector<int64_t> send(n), shard(shard_count, -99), flat(n);
    for (size_t i = 0; i < n; ++i) send[i] = flat[i] = value(r, i);
    GRADSUM_RETURN_IF_ERROR(
        HierarchicalReduceScatter(*mesh, send.data(), shard.data(), shard_count, DType::kI64));
    GRADSUM_RETURN_IF_ERROR(world.AllReduce(flat.data(), flat.data(), n, DType::kI64));
    for (size_t k = 0; k < shard_count; ++k) {
      if (shard[k] != want[k] || shard[k] != flat[mesh->p_index() * shard_count + k]) {
        return absl::InternalError(absl::StrCat("i64 element ", k, ": got ", shard[k],
                                                ", reference ", want[k], ", flat ",
                                                flat[mesh->p_index() * shard_count + k]));
      }
    }
    return absl::OkStatus();
  }
  // f32, in place (shard = my block of send).
  std::vector<float> send(n), flat(n);
  for (size_t i = 0; i < n; ++i) send[i] = flat[i] = static_cast<float>(value(r, i));
  float* shard = send.data() + mesh->p_index() * shard_count;
  GRADSUM_RETURN_IF_ERROR(
      HierarchicalReduceScatter(*mesh, send.data(), shard, shard_count, DType::kF32));
  GRADSUM_RETURN_IF_ERROR(world.AllReduce(flat.data(), flat.data(), n, DType::kF32));
  for (size_t k = 0; k < shard_count; ++k) {
    if (shard[k] != static_cast<float>(want[k]) ||
        shard[k] != flat[mesh->p_index() * shard_count + k]) {
      return absl::InternalError(
          absl::StrCat("f32 element ", k, ": got ", shard[k], ", reference ", want[k]));
    }
  }
  return absl::OkStatus();
}

TEST(HierarchicalReduceScatterTest, EqualsFlatSumOnEveryMeshShape) {
  for (const auto& [world, ep] :
       std::vector<std::pair<int, int>>{{4, 1}, {4, 2}, {4, 4}, {6, 2}, {6, 3}, {8, 2}, {8, 4}}) {
    for (DType t : {DType::kI64, DType::kF32}) {
      SCOPED_TRACE(absl::StrCat("world ", world, " ep ", ep, " ", DTypeName(t)));
      absl::Status s = RunRanks(world, [&, ep = ep, t = t](Communicator& comm) {
        return CheckHierarchical(comm, ep, t);
      });
      EXPECT_TRUE(s.ok()) << s;
    }
  }
}

}  // namespace
}  // namespace gradsum
