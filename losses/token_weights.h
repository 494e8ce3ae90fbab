#ifndef GRADSUM_LOSSES_TOKEN_WEIGHTS_H_
#define GRADSUM_LOSSES_TOKEN_WEIGHTS_H_

// Per-token cross-entropy weights w_t of SEMANTICS.md §3.
//
//   token  (default): w_t = 1 for valid tokens (label != ignore_index), 0 otherwise.
//   sample:           w_t = 1 / n_s for the valid tokens of sample s (n_s its valid count).
//   square:           w_t = 1 / sqrt(n_s).
//
// A sample is identified by its id within one micro-batch, and n_s is counted locally
// unless the caller gives each token's n_s (`sample_sizes`): a sample that spans the ranks
// of a sequence-parallel group (SEMANTICS.md §12) has its whole valid count on every rank.
//
//   absl::StatusOr<std::vector<float>> w =
//       ComputeTokenWeights(labels, sample_ids, CeWeightMode::kSample);
//   // D = sum of w over all ranks and micro-batches: see step_stats.h.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "data/streams.h"

namespace gradsum::losses {

enum class CeWeightMode { kToken = 0, kSample = 1, kSquare = 2 };

// "token", "sample", "square" (for messages; moe_lm reads the mode from its config's
// ce_mode enum, train/config.proto).
const char* CeWeightModeName(CeWeightMode mode);

// Returns w_t for each token (fp32; the kernels and D use exactly these values).
//
// labels:      one per token; ignore_index marks an invalid token (weight 0).
// sample_ids:  one per token (any int64 values; equal ids = same sample). Required for
//              kSample and kSquare; ignored (may be empty) for kToken.
// sample_sizes: empty, or one per token: n_s of the token's sample (used instead of
//              counting by sample_ids; >= 1 for valid tokens).
// Errors: InvalidArgument if sample_ids (or sample_sizes, when given) is required and its
// size differs from labels', a valid token's sample size is below 1, or mode is not a
// known enumerator.
absl::StatusOr<std::vector<float>> ComputeTokenWeights(absl::Span<const int64_t> labels,
                                                       absl::Span<const int64_t> sample_ids,
                                                       CeWeightMode mode,
                                                       int64_t ignore_index = data::kIgnoreIndex,
                                                       absl::Span<const int64_t> sample_sizes = {});

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_TOKEN_WEIGHTS_H_
