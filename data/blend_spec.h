#ifndef GRADSUM_DATA_BLEND_SPEC_H_
#define GRADSUM_DATA_BLEND_SPEC_H_

// The text of --data_path and --split (Megatron-LM's syntax), parsed and checked without
// opening a file, so that config validation (train/config.cc) can refuse bad values before
// anything is read. data/blend.h builds the blended corpus they describe.
//
//   --data_path="0.7 web 0.3 /data/code"   weights and Megatron prefixes (or token files)
//   --data_path=web                        one dataset, weight 1
//   --split=969,30,1                       train, validation (held out), test parts

#include <array>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsum::data {

struct BlendEntry {
  double weight = 1;
  std::string prefix;
};

// `text`: one path (weight 1), or pairs "WEIGHT PATH ..." separated by whitespace (Megatron's
// --data-path). Each weight a finite number > 0; weights need not sum to 1 (they are
// normalised). InvalidArgument naming `flag` and the value: an empty list, an odd number of
// words, a weight that is not a number or not positive, a path given twice.
absl::StatusOr<std::vector<BlendEntry>> ParseDataPath(absl::string_view text,
                                                      absl::string_view flag = "data.data_path");

// The parts of each dataset's documents: train, validation (the held-out evaluation, log.
// eval_every) and test (held out, never read here), as Megatron's --split: 1 to 3
// non-negative numbers separated by commas (missing parts are 0), normalised by their sum.
// InvalidArgument naming `flag` and the value: not numbers, a negative part, more than 3
// parts, a sum of 0, or a train part of 0.
absl::StatusOr<std::array<double, 3>> ParseSplit(absl::string_view text,
                                                 absl::string_view flag = "data.split");

enum class SplitPart { kTrain = 0, kValid = 1, kTest = 2 };

// The documents [begin, end) of `part` among a dataset's `n`: with the parts' fractions f
// (normalised) and cumulative sums c_0 = 0, c_k = f_0 + ... + f_(k-1), part k is
// [round(n c_k), round(n c_(k+1))), rounding half up; a part with no later non-empty part
// ends at n.
std::array<int64_t, 2> SplitRange(int64_t n, const std::array<double, 3>& split, SplitPart part);

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_BLEND_SPEC_H_
