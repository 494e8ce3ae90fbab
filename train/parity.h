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
// The report and its errors are train/parity_report.h's. This is the only part of train/
// that links the reference: the binary `moe_lm_parity` (and the tests) pass RunParityCheck
// to the trainer; `moe_lm` hands a --parity_check run to `moe_lm_parity` (train/main.cc).

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/document_source.h"
#include "data/loader.h"
#include "testing/reference_moe_lm.h"
#include "train/config.pb.h"
#include "train/moe_lm.h"
#include "train/parity_report.h"

namespace gradsum::train {

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

// The parity check of step 1 (the trainer's ParityCheckFn): rank 0 runs the reference on
// step 1's global batch with `weights` and compares `grads` and `record`'s losses, within
// debug.parity_tolerance (at least 3e-2 when a dtype is bf16, which rounds to 8 bits of
// mantissa), the reference routing with `expert_bias` (step 1's, §5.1). Every rank
// returns the verdict (rank 0 the whole report; the others `ok` only), or the same error.
// Collective over `world`.
absl::StatusOr<ParityReport> RunParityCheck(const TrainConfig& config, Communicator& world,
                                            const NamedParams& weights, const NamedParams& grads,
                                            const StepMetrics& record,
                                            const model::ExpertBias& expert_bias = {});

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_PARITY_H_
