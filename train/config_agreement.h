#ifndef GRADSUM_TRAIN_CONFIG_AGREEMENT_H_
#define GRADSUM_TRAIN_CONFIG_AGREEMENT_H_

// Ranks launched separately (MPI) must train with the same settings on the same data;
// Trainer::Create checks that first.
//
//   GRADSUM_RETURN_IF_ERROR(CheckRanksAgree(config, *world));

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "data/document_source.h"
#include "train/config.pb.h"

namespace gradsum::train {

// Start-up check that every rank runs the same effective config on the same data: each
// rank fingerprints every config field (ConfigFields: flags, file and defaults alike) and
// takes its loaded corpus's ContentFingerprint (the --data file's bytes, read once), and
// the ranks compare. `corpus` is this rank's MakeCorpus(config.data()) result: a corpus a
// rank could not load (its error) fails every rank with that rank's message. A difference
// is InvalidArgument on every rank naming each differing field, this rank's value and
// which ranks agree with which. Collective over `world`.
//
//   absl::StatusOr<std::shared_ptr<const DocumentSource>> corpus = MakeCorpus(config.data());
//   GRADSUM_RETURN_IF_ERROR(CheckRanksAgree(config, corpus, *world));
absl::Status CheckRanksAgree(
    const TrainConfig& config,
    const absl::StatusOr<std::shared_ptr<const data::DocumentSource>>& corpus, Communicator& world);

// The same, with the held-out documents of --eval_data (data.eval_path) too: `held_out` is
// this rank's loaded file (nullptr when the run has none), its error failing every rank with
// this rank's message like the corpus's, and its ContentFingerprint compared like the
// --data file's, so ranks evaluating on different files are refused by name.
absl::Status CheckRanksAgree(
    const TrainConfig& config,
    const absl::StatusOr<std::shared_ptr<const data::DocumentSource>>& corpus,
    const absl::StatusOr<std::shared_ptr<const data::DocumentSource>>& held_out,
    Communicator& world);

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_CONFIG_AGREEMENT_H_
