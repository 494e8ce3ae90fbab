#include "train/config_agreement.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/status_agreement.h"
#include "core/status.h"
#include "io/fingerprint.h"
#include "train/config.h"

namespace gradsum::train {

absl::Status CheckRanksAgree(
    const TrainConfig& config,
    const absl::StatusOr<std::shared_ptr<const data::DocumentSource>>& corpus,
    Communicator& world) {
  return CheckRanksAgree(config, corpus, std::shared_ptr<const data::DocumentSource>(), world);
}

absl::Status CheckRanksAgree(
    const TrainConfig& config,
    const absl::StatusOr<std::shared_ptr<const data::DocumentSource>>& corpus,
    const absl::StatusOr<std::shared_ptr<const data::DocumentSource>>& held_out,
    Communicator& world) {
  const std::vector<FieldOverride> fields = ConfigFields(config);
  // The config's fields, then the --data file's fingerprint, then the --eval_data file's (0
  // without one: the embedded corpora's documents follow from the config).
  std::vector<int64_t> mine(fields.size() + 2, 0);
  const size_t data_index = fields.size(), eval_index = fields.size() + 1;
  for (size_t i = 0; i < fields.size(); ++i) {
    mine[i] =
        static_cast<int64_t>(Fingerprint64(absl::StrCat(fields[i].path, "=", fields[i].value)));
  }
  absl::Status local = corpus.status();
  if (local.ok() && *corpus == nullptr) local = absl::InvalidArgumentError("no corpus");
  if (local.ok()) mine[data_index] = static_cast<int64_t>((*corpus)->ContentFingerprint());
  if (local.ok()) local = held_out.status();
  if (local.ok() && *held_out != nullptr) {
    mine[eval_index] = static_cast<int64_t>((*held_out)->ContentFingerprint());
  }
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, local, "start-up (reading the data file)"));
  const size_t n = mine.size();
  std::vector<int64_t> all(n * world.size());
  GRADSUM_RETURN_IF_ERROR(world.AllGather(mine.data(), all.data(), n, DType::kI64));
  std::vector<std::string> differences;
  for (size_t i = 0; i < n; ++i) {
    // Ranks grouped by their fingerprint of field i, in rank order of first appearance.
    std::vector<std::pair<int64_t, std::vector<int>>> groups;
    for (int r = 0; r < world.size(); ++r) {
      const int64_t v = all[r * n + i];
      auto it =
          std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == v; });
      if (it == groups.end()) {
        groups.push_back({v, {r}});
      } else {
        it->second.push_back(r);
      }
    }
    if (groups.size() == 1) continue;
    std::vector<std::string> sets;
    for (const auto& [v, ranks] : groups)
      sets.push_back(absl::StrCat("{", absl::StrJoin(ranks, ","), "}"));
    const std::string what =
        i < data_index
            ? absl::StrCat(fields[i].path, " (", fields[i].value, " on rank ", world.rank(), ")")
        : i == data_index && !config.data().data_path().empty()
            ? absl::StrCat("the content of data.data_path=", config.data().data_path())
        : i == data_index
            ? absl::StrCat("the content of data.path=", config.data().path())
            : absl::StrCat("the content of data.eval_path=", config.data().eval_path(),
                           " (--eval_data)");
    differences.push_back(absl::StrCat(what, " differs: ranks ", absl::StrJoin(sets, " vs ")));
  }
  if (differences.empty()) return absl::OkStatus();
  // Every rank sees the same fingerprints, so every rank fails here: an agreed failure.
  return MarkAgreed(absl::InvalidArgumentError(absl::StrCat(
      "the ranks were started with different configs (give every rank the same flags, config "
      "file and data): ",
      absl::StrJoin(differences, "; "))));
}

}  // namespace gradsum::train
