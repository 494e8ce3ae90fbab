#ifndef GRADSUM_TRAIN_RANK_MAIN_H_
#define GRADSUM_TRAIN_RANK_MAIN_H_

// What one rank of the moe_lm binary does, whatever the backend: wrap the world
// communicator in a timer, split it into the (F, P) mesh's EP and EDP groups
// (SEMANTICS.md §1), build the Trainer and run it. Shared by main.cc, the tests and the
// step benchmark.
//
//   absl::Status s = RunRank(config, world_comm, rank == 0 ? &std::cout : nullptr);

#include <memory>
#include <ostream>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "collectives/mesh.h"
#include "train/config.pb.h"
#include "collectives/timed_communicator.h"
#include "train/trainer.h"

namespace gradsum::train {

// A rank's communicators: the timed world and its (F, P) mesh (collectives/mesh.h).
struct RankMesh {
  std::unique_ptr<TimedCommunicator> world;
  std::unique_ptr<Mesh> mesh;  // over `world`, so the EP and EDP groups are timed too
  std::shared_ptr<CommTimer> timer;
  // The host model (make_model empty); callers set make_model for another.
  RankComms comms() const {
    return {&mesh->world(), &mesh->ep_group(), &mesh->edp_group(), timer, /*make_model=*/{}};
  }
};

// Wraps `world` (not owned; must outlive the result) in a timer and builds the mesh with
// EP size `ep`. Collective. InvalidArgument unless ep >= 1 divides world->size().
absl::StatusOr<RankMesh> MakeRankMesh(Communicator* world, int ep);

// Builds the mesh and the Trainer and runs config.steps steps. Collective over `world`.
absl::Status RunRank(const TrainConfig& config, Communicator* world, std::ostream* log);

// The start-up lines rank 0 prints: config, sizes, the corpus's entropy floor.
void PrintBanner(const TrainConfig& config, std::ostream& out);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_RANK_MAIN_H_
