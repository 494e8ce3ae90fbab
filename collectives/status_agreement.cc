#include "collectives/status_agreement.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace gradsum {
namespace {

constexpr absl::string_view kAgreedPayload = "gradsum/agreed-failure";
// Each rank's message travels in a fixed record of int32 words: code, length, then up to
// kMaxMessageBytes bytes (longer messages are cut, marked with "...").
constexpr int kMaxMessageBytes = 2000;
constexpr int kRecordWords = 2 + kMaxMessageBytes / 4;

}  // namespace

absl::Status MarkAgreed(absl::Status s) {
  if (!s.ok()) s.SetPayload(kAgreedPayload, absl::Cord("1"));
  return s;
}

bool IsAgreedFailure(const absl::Status& s) {
  return !s.ok() && s.GetPayload(kAgreedPayload).has_value();
}

absl::Status AgreeOnStatus(Communicator& world, const absl::Status& local, absl::string_view what) {
  if (IsAgreedFailure(local)) return local;
  int32_t failed = local.ok() ? 0 : 1;
  int32_t total = 0;
  absl::Status s = world.AllReduce(&failed, &total, 1, DType::kI32, ReduceOp::kSum);
  if (!s.ok()) return local.ok() ? Annotate(s, what) : local;
  if (total == 0) return absl::OkStatus();

  std::vector<int32_t> mine(kRecordWords, 0);
  if (!local.ok()) {
    std::string message(local.message());
    if (message.size() > kMaxMessageBytes) {
      message.resize(kMaxMessageBytes - 3);
      message += "...";
    }
    mine[0] = static_cast<int32_t>(local.code());
    mine[1] = static_cast<int32_t>(message.size());
    std::memcpy(&mine[2], message.data(), message.size());
  }
  std::vector<int32_t> all(static_cast<size_t>(kRecordWords) * world.size());
  s = world.AllGather(mine.data(), all.data(), kRecordWords, DType::kI32);
  if (!s.ok()) {
    if (!local.ok()) return local;
    return absl::FailedPreconditionError(
        absl::StrCat(what, " failed on ", total,
                     " other rank(s) (their messages could not be collected: ", s.message(), ")"));
  }
  // Group identical (code, message) pairs so that an error every rank hit reads once.
  std::vector<std::pair<std::pair<int, std::string>, std::vector<int>>> groups;
  std::vector<int> failing;
  for (int r = 0; r < world.size(); ++r) {
    const int32_t* rec = &all[static_cast<size_t>(r) * kRecordWords];
    if (rec[0] == 0) continue;
    const int len = std::min(std::max(rec[1], 0), kMaxMessageBytes);
    std::pair<int, std::string> key{rec[0],
                                    std::string(reinterpret_cast<const char*>(&rec[2]), len)};
    failing.push_back(r);
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
    if (it == groups.end()) {
      groups.push_back({std::move(key), {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (failing.empty()) {  // a failing rank sent code 0: cannot happen for a non-OK status
    return MarkAgreed(absl::InternalError(absl::StrCat(what, ": a rank failed without a code")));
  }
  std::string message = absl::StrCat(what, " failed on rank", failing.size() > 1 ? "s " : " ",
                                     absl::StrJoin(failing, ", "), " of ", world.size());
  for (const auto& [key, ranks] : groups) {
    if (groups.size() > 1 || failing.size() > 1) {
      absl::StrAppend(&message, "; rank", ranks.size() > 1 ? "s " : " ",
                      absl::StrJoin(ranks, ", "));
    }
    absl::StrAppend(&message, ": ",
                    absl::StatusCodeToString(static_cast<absl::StatusCode>(key.first)), ": ",
                    key.second);
  }
  return MarkAgreed(
      absl::Status(static_cast<absl::StatusCode>(groups.front().first.first), message));
}

}  // namespace gradsum
