#ifndef GRADSUM_TRAIN_CONFIG_AGREEMENT_H_
#define GRADSUM_TRAIN_CONFIG_AGREEMENT_H_

// Ranks launched separately (MPI) must train with the same settings on the same data;
// Trainer::Create checks that first.
//
//   GRADSUM_RETURN_IF_ERROR(CheckRanksAgree(config, *world));

#include "absl/status/status.h"
#include "collectives/communicator.h"
#include "train/config.pb.h"

namespace gradsum::train {

// Start-up check that every rank runs the same effective config on the same data: each
// rank fingerprints every config field (ConfigFields: flags, file and defaults alike) and
// the --data file (streamed, at most kMaxDataFileBytes), and the ranks compare. A
// difference is InvalidArgument on every rank naming each differing field, this rank's
// value and which ranks agree with which; a --data file a rank cannot read fails every
// rank with that rank's message. Collective over `world`.
absl::Status CheckRanksAgree(const TrainConfig& config, Communicator& world);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_CONFIG_AGREEMENT_H_
