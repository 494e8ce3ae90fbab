#ifndef GRADSUM_TRAIN_PARITY_H_
#define GRADSUM_TRAIN_PARITY_H_

// The parity check of SEMANTICS.md §2: the distributed trainer's SUM-reduced gradients
// and global display losses for one step, against the single-process double-precision
// reference (testing/reference_moe_lm.h) run on the whole global batch.
//
//   GRADSUM_ASSIGN_OR_RETURN(auto batch, GlobalBatchForStep(config, /*step_index=*/0));
//   GRADSUM_ASSIGN_OR_RETURN(ParityReport r,
//       CheckParity(config, weights, batch, grads, {ce, z, bal, z_out}, 1e-5));
//   std::cout << r.ToString();  if (!r.ok) ...
//
// Errors are measured per parameter, scale-free:
//   norm_ratio  = ||g|| / ||g_ref||            (1 when both are 0)
//   max_rel_err = max_i |g_i - g_ref_i| / max_i |g_ref_i|
// and per loss term |v - v_ref| / |v_ref|. `ok` when every |norm_ratio - 1|, every
// max_rel_err and every loss error is <= tolerance.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/document_source.h"
#include "data/loader.h"
#include "testing/reference_moe_lm.h"
#include "train/config.pb.h"
#include "train/moe_lm.h"

namespace gradsum::train {

struct ParamParity {
  std::string name;
  double norm_ratio = 1;
  double max_rel_err = 0;
};

struct LossParity {
  std::string name;
  double value = 0, reference = 0, rel_err = 0;
};

struct ParityReport {
  std::vector<ParamParity> params;
  std::vector<LossParity> losses;
  double tolerance = 0;
  double worst = 0;  // the largest error of any kind
  bool ok = false;
  // One line per parameter and loss term, then a verdict line.
  std::string ToString() const;
};

// The global batch of step `step_index` (0-based): batch[m][r] for every data rank r (the
// world's ranks, or its world / sp sequence-parallel groups, each with whole sequences):
// rows of the global sequence stream (data/loader.h), rebuilt from the data config.
// `corpus` null: the config's (MakeCorpus); else that one (MakeHeldOutCorpus's: the held-out
// evaluation's batch, with parallelism.grad_acc set to log.eval_micro_batches).
absl::StatusOr<std::vector<std::vector<data::MicroBatch>>> GlobalBatchForStep(
    const TrainConfig& config, int64_t step_index,
    std::shared_ptr<const data::DocumentSource> corpus = nullptr);

// The fp64 reference model's config for `config` (testing/reference_moe_lm.h), routing
// with `expert_bias`.
testing::ReferenceConfig ReferenceConfigFor(const TrainConfig& config,
                                            const model::ExpertBias& expert_bias = {});

// The display values to compare: the global ce, z and bal of the step, and the output
// z-loss z_out of SEMANTICS.md §3.2 (compared only when loss.alpha_lse > 0).
struct StepLosses {
  double ce = 0, z = 0, bal = 0, z_out = 0;
  std::vector<double> mtp;  // per MTP depth: mtp_<j> (§15.1)
};

// Runs the reference on `global_batch` with `weights` (the step's parameters, full) and
// the `expert_bias` the step routed with (SEMANTICS.md §5.1; empty: none), and compares.
// InvalidArgument if a gradient is missing or mis-sized; the reference's errors.
absl::StatusOr<ParityReport> CheckParity(
    const TrainConfig& config, const NamedParams& weights,
    const std::vector<std::vector<data::MicroBatch>>& global_batch, const NamedParams& grads,
    const StepLosses& losses, double tolerance, const model::ExpertBias& expert_bias = {});

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_PARITY_H_
