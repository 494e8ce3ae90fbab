#include "collectives/mesh.h"

#include <cstdint>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
  if (m.world_size() != w || m.ep_size() != ep_size || m.edp_size() != f_size ||
      m.f_index() != f || m.p_index() != p || &m.world() != &world ||
      m.ep_group().rank() != p || m.edp_group().rank() != f) {
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

}  // namespace
}  // namespace gradsum
