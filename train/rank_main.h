#ifndef GRADSUM_TRAIN_RANK_MAIN_H_
#define GRADSUM_TRAIN_RANK_MAIN_H_

// What one rank of the moe_lm binary does, whatever the backend: wrap the world
// communicator in a timer, split it into the (F, P) mesh's EP and EDP groups
// (SEMANTICS.md §1), build the Trainer and run it. Shared by main.cc, the tests and the
// step benchmark.
//
//   absl::Status s = RunRank(config, world_comm, rank == 0 ? &std::cout : nullptr);

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "collectives/communicator.h"
#include "collectives/mesh.h"
#include "collectives/timed_communicator.h"
#include "train/build_model.h"
#include "train/config.pb.h"
#include "train/trainer.h"

namespace gradsum::train {

// A rank's communicators: the timed world and the one mesh over it (collectives/mesh.h),
// whose every group is timed too (SP's all-to-alls as CommKind::kSpAllToAll, CP's ring as
// kCpRing).
struct RankMesh {
  std::shared_ptr<CommTimer> timer;
  std::unique_ptr<TimedCommunicator> world;
  std::unique_ptr<Mesh> mesh;  // over `world`
  // The host model (make_model empty); callers set make_model for another.
  RankComms comms() const { return {mesh.get(), timer, /*make_model=*/{}}; }
};

// Wraps `world` (not owned; must outlive the result) in a timer and builds the mesh of
// `parallelism` over it: EP size parallelism.ep, SP parallelism.sp, CP parallelism.cp,
// HSDP's shard groups (ResolveShardGroup). The one place where the config's group sizes
// meet the communicators: InvalidArgument naming both when the backend's world size is
// not parallelism.world (an MPI job launched with another -np); sizes that do not divide
// the world are ValidateConfig's to refuse first (Mesh::Create refuses them too).
// Collective.
absl::StatusOr<RankMesh> MakeRankMesh(Communicator* world, const ParallelismConfig& parallelism);

// The mesh shape of `parallelism` with HSDP's resolved shard group (0 without HSDP).
MeshShape MeshShapeOf(const ParallelismConfig& parallelism, int shard_group);

// How the timed world `timed` (not owned) splits into a mesh's groups: SP's and CP's with
// their own CommKind (TimedCommunicator::SplitAs), the others plainly.
MeshSplitFn TimedMeshSplit(TimedCommunicator* timed);

// sharding=hsdp: the shard group size N of `parallelism` (SEMANTICS.md §7): shard_group, or
// for 0 the ranks of one host (OMPI_COMM_WORLD_LOCAL_SIZE on the mpi backend, which every
// rank must see the same; the world on the thread backend). InvalidArgument naming the
// value when N does not divide the world or is not a multiple of parallelism.ep, or when
// hosts run different numbers of ranks. Collective (one all-reduce).
absl::StatusOr<int> ResolveShardGroup(Communicator& world, const ParallelismConfig& parallelism);

// Builds the mesh and the Trainer and runs optim.steps steps. Collective over `world`.
// `parity_check`: step 1's check for a --parity_check run (train/parity.h RunParityCheck;
// empty, such a run is refused).
absl::Status RunRank(const TrainConfig& config, Communicator* world, std::ostream* log,
                     const ParityCheckFn& parity_check = {});

// The start-up lines rank 0 prints: config, sizes, the corpus's entropy floor.
void PrintBanner(const TrainConfig& config, std::ostream& out);

// Runs `f`; an exception that escapes it becomes a status instead of std::terminate's
// abort: std::bad_alloc ResourceExhausted; a std::system_error for a thread the system
// would not start (EAGAIN) ResourceExhausted naming the limits on threads (ThreadLimits);
// anything else Internal, with what() in the message.
absl::Status CatchExceptions(const std::function<absl::Status()>& f);

// The threads a thread-backend run of `config` starts: per rank, its own thread and the
// worker thread of each of its communicators (the world, the EP group, the EDP group, and
// the SP group when parallelism.sp > 1, the CP group when parallelism.cp > 1).
int64_t ThreadBackendThreads(const TrainConfig& config);

// Starts `count` threads that only wait, then ends them, so that a run finds out before any
// rank starts whether the system lets it have its threads (a rank that cannot start leaves
// its peers waiting). ResourceExhausted when the system refuses one: "could not start
// <what>: the system refused thread k of count (Resource temporarily unavailable)" and the
// limits (ThreadLimits). A few milliseconds per thousand threads.
absl::Status CheckThreadsCanStart(int64_t count, absl::string_view what);

// The limits on this process's threads, for messages, each with what it counts now:
// RLIMIT_NPROC (ulimit -u; it binds a user other than root, and counts every process and
// thread of that user), kernel.threads-max and kernel.pid_max (the system's threads), and
// the pids cgroup's pids.max. Those that `more` further threads would exceed come first,
// marked "reached"; when none is, the text says which other limits may have refused.
std::string ThreadLimits(int64_t more);

// What one rank holds, estimated from the config before anything is allocated (bytes):
// parameters (the rank's dense parameters and its E/P experts' share: an initial copy, the
// compute copy and gradients, the master, exp_avg and exp_avg_sq slices), the activations of
// one micro-batch and the step's batch. An upper estimate, not an exact count.
struct ResourceEstimate {
  long double params = 0;  // parameters of the whole model
  long double parameter_bytes = 0, activation_bytes = 0, batch_bytes = 0;
  long double process_bytes = 0;  // per process: x world for the thread backend
};
// InvalidArgument naming the fields whose product overflows what the kernels index (more
// than 2^31 - 1 tokens per micro-batch, more than 2^62 parameters).
absl::StatusOr<ResourceEstimate> EstimateResources(const TrainConfig& config);

// Fails before any allocation when the estimate exceeds `memory_bytes`: ResourceExhausted
// naming the estimate, its parts and the sizes they come from. Errors of EstimateResources.
absl::Status CheckResourceBounds(const TrainConfig& config, uint64_t memory_bytes);

// The machine's physical memory in bytes.
uint64_t MachineMemoryBytes();

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_RANK_MAIN_H_
