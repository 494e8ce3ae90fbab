#ifndef GRADSUM_TRAIN_PARITY_REPORT_H_
#define GRADSUM_TRAIN_PARITY_REPORT_H_

// What the parity check of SEMANTICS.md §2 reports (train/parity.h runs it), and the hook
// through which a binary gives the trainer that check. The trainer and the production
// binary `moe_lm` depend on this header only, never on the fp64 reference (testing/): the
// check itself is linked into `moe_lm_parity` (and the tests), which pass
// train/parity.h's RunParityCheck as the hook.
//
// Errors are measured per parameter, scale-free:
//   norm_ratio  = ||g|| / ||g_ref||            (1 when both are 0)
//   max_rel_err = max_i |g_i - g_ref_i| / max_i |g_ref_i|
// and per loss term |v - v_ref| / |v_ref|. `ok` when every |norm_ratio - 1|, every
// max_rel_err and every loss error is <= tolerance.

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "train/config.pb.h"
#include "train/metrics.pb.h"
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

// The parity check of step 1 as the trainer calls it (train/parity.h RunParityCheck):
// step 1's full `weights`, reduced `grads`, step record and routing `expert_bias`, on every
// rank; every rank returns the verdict or the same error. Collective over `world`.
using ParityCheckFn = std::function<absl::StatusOr<ParityReport>(
    const TrainConfig& config, Communicator& world, const NamedParams& weights,
    const NamedParams& grads, const StepMetrics& record, const model::ExpertBias& expert_bias)>;

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_PARITY_REPORT_H_
