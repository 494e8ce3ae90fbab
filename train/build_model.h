#ifndef GRADSUM_TRAIN_BUILD_MODEL_H_
#define GRADSUM_TRAIN_BUILD_MODEL_H_

// The one place the trainer's model is built from the config: its MoeLmOptions (the one
// converter, ToMoeLmOptions in train/moe_lm.h, plus the rank's thread budget), over the
// rank's mesh, by the host model (MoeLm::Create) or the factory the rank driver passes (the
// nccl backend's GPU model).
//
//   RankComms comms = rank_mesh.comms();   // train/rank_main.h
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<MoeLm> model, BuildModel(config, comms));

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "collectives/mesh.h"
#include "collectives/timed_communicator.h"
#include "train/config.pb.h"
#include "train/moe_lm.h"
#include "train/parity_report.h"

namespace gradsum::train {

// Builds the rank's model from its options and groups; the default is MoeLm::Create (host
// compute). The nccl backend passes train/cuda's CreateCudaMoeLm, which computes on the
// rank's GPU.
using MoeLmFactory =
    std::function<absl::StatusOr<std::unique_ptr<MoeLm>>(const MoeLmOptions&, const Mesh&)>;

// What a rank trains over (not owned).
struct RankComms {
  // The rank's mesh (collectives/mesh.h): every group, and the one source of their sizes.
  Mesh* mesh = nullptr;
  // The CommTimer the mesh's communicators add their time to (may be null).
  std::shared_ptr<CommTimer> timer;
  MoeLmFactory make_model;  // empty: MoeLm::Create
  // Step 1's parity check (train/parity.h RunParityCheck in moe_lm_parity and the tests);
  // empty: a --parity_check run is refused at Trainer::Create (FailedPrecondition).
  ParityCheckFn parity_check;
};

// The model of `config` over `comms.mesh`, with no parameters set yet. Errors are the
// model's (MoeLm::Create, or the factory's).
absl::StatusOr<std::unique_ptr<MoeLm>> BuildModel(const TrainConfig& config,
                                                  const RankComms& comms);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_BUILD_MODEL_H_
