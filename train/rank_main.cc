#include "train/rank_main.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "train/data.h"
#include "train/moe_lm.h"

namespace gradsum::train {

absl::StatusOr<RankMesh> MakeRankMesh(Communicator* world, int ep) {
  if (world == nullptr) return absl::InvalidArgumentError("null world communicator");
  RankMesh mesh;
  mesh.timer = std::make_shared<CommTimer>();
  mesh.world = std::make_unique<TimedCommunicator>(world, mesh.timer);
  GRADSUM_ASSIGN_OR_RETURN(mesh.mesh, Mesh::Create(mesh.world.get(), ep));
  return mesh;
}

absl::Status RunRank(const TrainConfig& config, Communicator* world, std::ostream* log) {
  GRADSUM_ASSIGN_OR_RETURN(RankMesh mesh, MakeRankMesh(world, config.ep()));
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(config, mesh.comms()));
  return trainer->Run(log).status();
}

void PrintBanner(const TrainConfig& config, std::ostream& out) {
  const ModelConfig& m = config.model();
  int64_t params = 0;
  for (const auto& [name, shape] : MoeLmParamShapes(m)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    params += n;
  }
  out << absl::StrFormat(
      "moe_lm: %d steps; AdamW lr %g (warmup %d), clip %g; compute %s, reduce %s; "
      "CE weights %s; alpha_b %g, alpha_z %g; seed %d\n",
      config.steps(), config.optim().lr(), config.optim().warmup_steps(),
      config.optim().grad_clip(), config.compute_dtype(), config.reduce_dtype(), config.ce_mode(),
      config.alpha_b(), config.alpha_z(), config.seed());
  out << absl::StrFormat(
      "model: V=%d D=%d L=%d E=%d K=%d H=%d, %d parameters; mesh F=%d x P=%d, G=%d, %s, "
      "backend %s\n",
      m.vocab(), m.dim(), m.layers(), m.experts(), m.top_k(), m.expert_dim(), params,
      config.world() / config.ep(), config.ep(), config.grad_acc(), config.sharding(),
      config.backend());
  out << absl::StrFormat(
      "data: %d x %d tokens per rank and micro-batch, %s\n", config.data().micro_batch(),
      config.data().seq_len(),
      config.data().path().empty() ? "embedded Markov corpus" : config.data().path());
  if (config.data().path().empty()) {
    MarkovCorpus corpus(config.data());
    out << absl::StrFormat(
        "entropy floor: %.4f nats/token (the Markov chain's conditional entropy; "
        "the best CE this per-token model can reach)\n",
        corpus.EntropyFloorNats());
  }
  out << std::flush;
}

}  // namespace gradsum::train
