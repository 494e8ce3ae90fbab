#ifndef GRADSUM_MOE_SHAPES_H_
#define GRADSUM_MOE_SHAPES_H_

// Internal helpers shared by the moe/ sources: size checks with messages that name the
// argument and both sizes. Not part of the public API.

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace gradsum::moe::internal {

// InvalidArgument "<what> has <got> elements, expected <want> (<shape>)" unless got == want.
inline absl::Status CheckSize(absl::string_view what, size_t got, int64_t want,
                              absl::string_view shape) {
  if (want < 0 || got != static_cast<size_t>(want)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", got, " elements, expected ", want, " (", shape, ")"));
  }
  return absl::OkStatus();
}

}  // namespace gradsum::moe::internal

#endif  // GRADSUM_MOE_SHAPES_H_
