#include "collectives/mesh.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/self_communicator.h"
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
          !absl::StrContains(m.status().message(), absl::StrCat("ep ", ep, " must")) ||
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
      {&mesh->group(MeshAxis::kDpShard), &want_shard},
      {&mesh->group(MeshAxis::kDpReplicate), &want_replica},
      {&mesh->group(MeshAxis::kEdpShard), &want_xshard},
      {&mesh->group(MeshAxis::kEdpReplicate), &want_xreplica}};
  for (const auto& [group, want] : groups) {
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
          !absl::StrContains(m.status().message(), absl::StrCat("shard_group ", n))) {
        return absl::InternalError(absl::StrCat("shard_size ", n, ": ", m.status().ToString()));
      }
    }
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> none, Mesh::Create(&world, 4));
    // Without HSDP a dense unit is reduced over the world, an expert unit over its EDP
    // group, and nothing is replicated.
    if (none->shard_size() != 0 || none->hsdp() ||
        &none->group(MeshAxis::kDpShard) != &none->world() ||
        &none->group(MeshAxis::kEdpShard) != &none->edp_group() ||
        none->size(MeshAxis::kDpReplicate) != 1 || none->size(MeshAxis::kEdpReplicate) != 1) {
      return absl::InternalError("a mesh without shard_size has HSDP groups");
    }
    return CheckHsdpMesh(world, 4, 8);
  });
  EXPECT_TRUE(s.ok()) << s;
}

// SP and CP groups (SEMANTICS.md §12, §16), straight from the definitions: SP = the S
// consecutive ranks of my block of S; with C > 1, blocks of S C consecutive ranks, the CP
// group being the rank at my place in each SP group of my block. Axes that are off are
// groups of one, never null.
absl::Status CheckSequenceAxes(Communicator& world, int sp, int cp) {
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh,
                           Mesh::Create(&world, MeshShape{.sp = sp, .cp = cp}));
  const int rank = world.rank(), block = rank / (sp * cp) * (sp * cp);
  std::vector<int32_t> want_sp, want_cp;
  for (int i = 0; i < sp; ++i) want_sp.push_back(rank / sp * sp + i);
  for (int j = 0; j < cp; ++j) want_cp.push_back(block + j * sp + rank % sp);
  const std::string what = absl::StrCat("W=", world.size(), " S=", sp, " C=", cp, " rank ", rank);
  GRADSUM_ASSIGN_OR_RETURN(std::vector<int32_t> got_sp, Members(mesh->group(MeshAxis::kSp), rank));
  GRADSUM_ASSIGN_OR_RETURN(std::vector<int32_t> got_cp, Members(mesh->group(MeshAxis::kCp), rank));
  if (got_sp != want_sp || got_cp != want_cp) {
    return absl::InternalError(absl::StrCat(what, ": sp {", absl::StrJoin(got_sp, ","), "} cp {",
                                            absl::StrJoin(got_cp, ","), "}"));
  }
  for (MeshAxis off : {MeshAxis::kPp, MeshAxis::kDpReplicate, MeshAxis::kEdpReplicate}) {
    if (mesh->size(off) != 1 || mesh->rank(off) != 0) {
      return absl::InternalError(absl::StrCat(what, ": axis ", MeshAxisName(off), " is not off"));
    }
  }
  return absl::OkStatus();
}

TEST(MeshTest, SequenceAndContextAxesOfEveryShapeOfWorldSizesOneToEight) {
  for (int w = 1; w <= 8; ++w) {
    for (int sp = 1; sp <= w; ++sp) {
      for (int cp = 1; sp * cp <= w; ++cp) {
        if (w % (sp * cp) != 0) continue;
        absl::Status s =
            RunRanks(w, [sp, cp](Communicator& world) { return CheckSequenceAxes(world, sp, cp); });
        EXPECT_TRUE(s.ok()) << s;
      }
    }
  }
}

TEST(MeshTest, SequenceShapesThatDoNotFitAreNamed) {
  absl::Status s = RunRanks(4, [](Communicator& world) -> absl::Status {
    for (MeshShape bad : {MeshShape{.sp = 3}, MeshShape{.sp = 2, .cp = 4}, MeshShape{.cp = 0}}) {
      absl::StatusOr<std::unique_ptr<Mesh>> m = Mesh::Create(&world, bad);
      if (m.status().code() != absl::StatusCode::kInvalidArgument ||
          !absl::StrContains(m.status().message(),
                             absl::StrCat("sp ", bad.sp, " x cp ", bad.cp, " must"))) {
        return absl::InternalError(m.status().ToString());
      }
    }
    return CheckSequenceAxes(world, 2, 2);
  });
  EXPECT_TRUE(s.ok()) << s;
}

// The split hook sees every axis that is on, once, and what it returns is the axis's group.
TEST(MeshTest, SplitHookMakesEveryAxisThatIsOn) {
  absl::Status s = RunRanks(8, [](Communicator& world) -> absl::Status {
    std::vector<std::string> seen;
    MeshSplitFn split = [&seen](Communicator& w, MeshAxis axis, int color, int key) {
      seen.push_back(MeshAxisName(axis));
      return w.Split(color, key);
    };
    GRADSUM_ASSIGN_OR_RETURN(
        std::unique_ptr<Mesh> mesh,
        Mesh::Create(&world, MeshShape{.ep = 2, .sp = 2, .cp = 2, .shard_group = 4}, split));
    const std::string got = absl::StrJoin(seen, ",");
    if (got != "ep,edp,dp_shard,dp_replicate,edp_shard,edp_replicate,sp,cp") {
      return absl::InternalError(got);
    }
    return CheckHsdpMesh(world, 2, 4);
  });
  EXPECT_TRUE(s.ok()) << s;
}

// A device view: the same groups over a second world of the same ranks; without one the
// device groups are the host's.
TEST(MeshTest, DeviceViewHasTheHostGroupsShape) {
  absl::Status s = RunRanks(4, [](Communicator& world) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Mesh> mesh,
                             Mesh::Create(&world, MeshShape{.ep = 2, .sp = 2}));
    for (int a = 0; a < kNumMeshAxes; ++a) {
      if (&mesh->device_group(static_cast<MeshAxis>(a)) != &mesh->group(static_cast<MeshAxis>(a))) {
        return absl::InternalError("without a device view the device groups are not the host's");
      }
    }
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> second, world.Split(0, world.rank()));
    GRADSUM_RETURN_IF_ERROR(mesh->AttachDeviceView(std::move(second)));
    for (MeshAxis axis : {MeshAxis::kWorld, MeshAxis::kEp, MeshAxis::kEdp, MeshAxis::kSp}) {
      Communicator& d = mesh->device_group(axis);
      if (&d == &mesh->group(axis)) return absl::InternalError("the device group is the host's");
      GRADSUM_ASSIGN_OR_RETURN(std::vector<int32_t> host, Members(mesh->group(axis), world.rank()));
      GRADSUM_ASSIGN_OR_RETURN(std::vector<int32_t> dev, Members(d, world.rank()));
      if (host != dev) return absl::InternalError(MeshAxisName(axis));
    }
    // A device world of other ranks is refused by name.
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> half,
                             world.Split(world.rank() / 2, world.rank()));
    absl::Status bad = mesh->AttachDeviceView(std::move(half));
    if (bad.code() != absl::StatusCode::kInvalidArgument ||
        !absl::StrContains(bad.message(), "but the host world is rank")) {
      return absl::InternalError(bad.ToString());
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(SelfCommunicatorTest, EveryCollectiveOfOneRankIsTheIdentity) {
  SelfCommunicator self;
  EXPECT_EQ(self.size(), 1);
  EXPECT_EQ(self.rank(), 0);
  std::vector<float> a = {1, 2, 3}, b(3, 0);
  ASSERT_TRUE(self.AllReduce(a.data(), b.data(), 3, DType::kF32).ok());
  EXPECT_EQ(b, a);
  ASSERT_TRUE(self.AllReduce(a.data(), a.data(), 3, DType::kF32, ReduceOp::kMax).ok());
  EXPECT_EQ(a, (std::vector<float>{1, 2, 3}));
  std::vector<float> c(2, 0);
  ASSERT_TRUE(self.ReduceScatter(a.data(), c.data(), 2, DType::kF32).ok());
  EXPECT_EQ(c, (std::vector<float>{1, 2}));
  ASSERT_TRUE(self.AllGather(a.data() + 1, c.data(), 2, DType::kF32).ok());
  EXPECT_EQ(c, (std::vector<float>{2, 3}));
  const size_t send_counts[] = {2}, send_offsets[] = {1}, recv_counts[] = {2}, recv_offsets[] = {0};
  std::vector<float> d(2, 0);
  ASSERT_TRUE(self.AllToAllV(a.data(), send_counts, send_offsets, d.data(), recv_counts,
                             recv_offsets, DType::kF32)
                  .ok());
  EXPECT_EQ(d, (std::vector<float>{2, 3}));
  EXPECT_TRUE(self.Broadcast(a.data(), 3, DType::kF32, 0).ok());
  EXPECT_TRUE(self.Barrier().ok());
  absl::StatusOr<std::unique_ptr<Communicator>> split = self.Split(5, 0);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ((*split)->size(), 1);
  EXPECT_EQ(*self.Split(-1, 0), nullptr);
}

TEST(SelfCommunicatorTest, BadArgumentsAreRefusedAsOnEveryBackend) {
  SelfCommunicator self;
  std::vector<float> a(4, 1);
  EXPECT_EQ(self.AllReduce(nullptr, a.data(), 4, DType::kF32).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(self.Broadcast(a.data(), 4, DType::kF32, 1).code(), absl::StatusCode::kInvalidArgument);
  const size_t two[] = {2}, three[] = {3}, zero[] = {0};
  std::vector<float> r(4, 0);
  absl::Status s = self.AllToAllV(a.data(), two, zero, r.data(), three, zero, DType::kF32);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "sends 2 elements to itself but expects 3")) << s;
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
