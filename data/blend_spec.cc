#include "data/blend_spec.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace gradsum::data {

namespace {

absl::Status Bad(absl::string_view flag, absl::string_view value, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(flag, "=", value, ": ", why));
}

}  // namespace

absl::StatusOr<std::vector<BlendEntry>> ParseDataPath(absl::string_view text,
                                                      absl::string_view flag) {
  const std::vector<std::string> words =
      absl::StrSplit(text, absl::ByAnyChar(" \t\n"), absl::SkipEmpty());
  if (words.empty()) return Bad(flag, text, "names no dataset");
  if (words.size() == 1) return std::vector<BlendEntry>{{1.0, words[0]}};
  if (words.size() % 2 != 0) {
    return Bad(flag, text,
               absl::StrCat("has ", words.size(),
                            " words; give one path, or pairs \"WEIGHT PATH WEIGHT PATH ...\""));
  }
  std::vector<BlendEntry> entries;
  for (size_t i = 0; i < words.size(); i += 2) {
    BlendEntry e;
    if (!absl::SimpleAtod(words[i], &e.weight) || !std::isfinite(e.weight)) {
      return Bad(flag, text,
                 absl::StrCat("weight \"", words[i], "\" (word ", i + 1,
                              ") is not a number; give pairs \"WEIGHT PATH ...\""));
    }
    if (!(e.weight > 0)) {
      return Bad(flag, text,
                 absl::StrCat("weight ", words[i], " of ", words[i + 1], " must be positive"));
    }
    e.prefix = words[i + 1];
    for (const BlendEntry& other : entries) {
      if (other.prefix == e.prefix) {
        return Bad(flag, text,
                   absl::StrCat(e.prefix, " is given twice; give it once with the summed weight"));
      }
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

absl::StatusOr<std::array<double, 3>> ParseSplit(absl::string_view text, absl::string_view flag) {
  const std::vector<std::string> words = absl::StrSplit(text, absl::ByAnyChar(",/"));
  if (words.size() > 3) {
    return Bad(flag, text, "has more than 3 parts (train, validation, test)");
  }
  std::array<double, 3> parts = {0, 0, 0};
  double sum = 0;
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string word(absl::StripAsciiWhitespace(words[i]));
    if (!absl::SimpleAtod(word, &parts[i]) || !std::isfinite(parts[i])) {
      return Bad(flag, text, absl::StrCat("part ", i + 1, " \"", word, "\" is not a number"));
    }
    if (parts[i] < 0) {
      return Bad(flag, text, absl::StrCat("part ", i + 1, " (", word, ") is negative"));
    }
    sum += parts[i];
  }
  if (!(sum > 0) || !std::isfinite(sum)) {
    return Bad(flag, text, "the parts sum to 0; give e.g. 969,30,1 (train, validation, test)");
  }
  if (parts[0] == 0) return Bad(flag, text, "the train part (the first) is 0: nothing to train on");
  for (double& p : parts) p /= sum;
  return parts;
}

std::array<int64_t, 2> SplitRange(int64_t n, const std::array<double, 3>& split, SplitPart part) {
  const int k = static_cast<int>(part);
  double begin = 0;
  for (int i = 0; i < k; ++i) begin += split[i];
  const double end = begin + split[k];
  auto at = [n](double c) {
    const int64_t v = static_cast<int64_t>(std::floor(static_cast<double>(n) * c + 0.5));
    return v < 0 ? 0 : (v > n ? n : v);
  };
  bool last = true;  // no later part holds a document
  for (int i = k + 1; i < 3; ++i) last = last && split[i] == 0;
  return {at(begin), last ? n : at(end)};
}

}  // namespace gradsum::data
