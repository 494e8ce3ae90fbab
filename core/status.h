#ifndef GRADSUM_CORE_STATUS_H_
#define GRADSUM_CORE_STATUS_H_

// Status helpers. Abseil 20220623 (Debian's) ships Status/StatusOr but not the
// RETURN_IF_ERROR / ASSIGN_OR_RETURN macros, so gradsum defines its own here.
//
//   GRADSUM_RETURN_IF_ERROR(comm.AllReduce(...));
//   GRADSUM_ASSIGN_OR_RETURN(DType t, ParseDType(name));

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace gradsum {

// Returns `s` with `context` prepended to its message ("context: message"); OK stays OK.
inline absl::Status Annotate(const absl::Status& s, absl::string_view context) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

namespace status_internal {
inline absl::Status AsStatus(absl::Status s) { return s; }
template <typename T>
absl::Status AsStatus(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace status_internal

}  // namespace gradsum

#define GRADSUM_STATUS_CONCAT_INNER(a, b) a##b
#define GRADSUM_STATUS_CONCAT(a, b) GRADSUM_STATUS_CONCAT_INNER(a, b)

#define GRADSUM_RETURN_IF_ERROR(expr)                                          \
  do {                                                                         \
    absl::Status gradsum_status_ = ::gradsum::status_internal::AsStatus(expr); \
    if (!gradsum_status_.ok()) return gradsum_status_;                         \
  } while (0)

#define GRADSUM_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(*tmp)

#define GRADSUM_ASSIGN_OR_RETURN(lhs, expr) \
  GRADSUM_ASSIGN_OR_RETURN_IMPL(GRADSUM_STATUS_CONCAT(gradsum_statusor_, __LINE__), lhs, expr)

#endif  // GRADSUM_CORE_STATUS_H_
