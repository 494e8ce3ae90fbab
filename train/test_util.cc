#include "train/test_util.h"

#include "core/status.h"
#include "testing/run_ranks.h"
#include "train/config.h"
#include "train/parity.h"
#include "train/rank_main.h"

namespace gradsum::train {

TrainConfig TinyConfig(int world, int ep, int grad_acc, TrainConfig::Sharding sharding) {
  TrainConfig c;
  c.mutable_parallelism()->set_world(world);
  c.mutable_parallelism()->set_ep(ep);
  c.mutable_parallelism()->set_grad_acc(grad_acc);
  c.mutable_parallelism()->set_sharding(sharding);
  c.mutable_optim()->set_steps(1);
  c.mutable_loss()->set_alpha_b(0.01);
  c.mutable_loss()->set_alpha_z(0.01);
  c.mutable_comm()->set_timeout_s(60);
  ModelConfig* m = c.mutable_model();
  // The per-token model on the first-order corpus, which these tests were written for (the
  // defaults before attention); the attention block has its own cases, which set causal.
  m->set_attention(ModelConfig::none);
  c.mutable_data()->set_corpus(DataConfig::markov1);
  m->set_dim(8);
  m->set_layers(2);
  m->set_experts(4);
  m->set_top_k(2);
  m->set_expert_dim(8);
  m->set_init_std(0.5);
  DataConfig* d = c.mutable_data();
  d->set_seq_len(16);
  d->set_micro_batch(2);
  d->set_min_doc_len(2);
  d->set_max_doc_len(12);
  d->set_corpus_documents(4096);
  return c;
}

absl::StatusOr<std::vector<RankOutcome>> RunInProcess(const TrainConfig& unresolved) {
  // Every default set before the rank threads share it (train/config.h ResolvedConfig).
  const TrainConfig config = ResolvedConfig(unresolved);
  std::vector<RankOutcome> outcomes(config.parallelism().world());
  ThreadBackendOptions options;
  options.timeout = absl::Seconds(config.comm().timeout_s());
  GRADSUM_ASSIGN_OR_RETURN(std::vector<absl::Status> status,
                           testing::RunRanksPerRank(
                               config.parallelism().world(),
                               [&](Communicator& world) -> absl::Status {
                                 RankOutcome& out = outcomes[world.rank()];
                                 GRADSUM_ASSIGN_OR_RETURN(
                                     RankMesh mesh, MakeRankMesh(&world, config.parallelism()));
                                 RankComms comms = mesh.comms();
                                 comms.parity_check = RunParityCheck;  // as moe_lm_parity's
                                 GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                                                          Trainer::Create(config, comms));
                                 absl::Status s = trainer->Run(nullptr).status();
                                 out.history = trainer->history();
                                 out.first_step_grads = trainer->first_step_grads();
                                 out.parity = trainer->parity();
                                 return s;
                               },
                               options));
  for (size_t r = 0; r < status.size(); ++r) outcomes[r].status = status[r];
  return outcomes;
}

}  // namespace gradsum::train
