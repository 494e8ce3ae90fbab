#ifndef GRADSUM_CORE_DTYPE_H_
#define GRADSUM_CORE_DTYPE_H_

// Element types that gradsum moves and reduces.
//
//   DType t = DType::kBF16;
//   size_t bytes = n * DTypeSize(t);           // 2 bytes per element
//   absl::StatusOr<DType> p = ParseDType("f32");
//
// Floating types are reduced in fp32 or wider on the CPU backends (SEMANTICS.md §7).

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsum {

enum class DType : uint8_t {
  kF32 = 0,
  kF64 = 1,
  kBF16 = 2,
  kF16 = 3,
  kI32 = 4,
  kI64 = 5,
};

// All dtypes, for tests and parameterised loops.
inline constexpr DType kAllDTypes[] = {DType::kF32, DType::kF64, DType::kBF16,
                                       DType::kF16, DType::kI32, DType::kI64};

// Size of one element in bytes.
constexpr size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF64:
      return 8;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
  }
  return 0;
}

// True for f32, f64, bf16, f16.
constexpr bool IsFloating(DType t) {
  return t == DType::kF32 || t == DType::kF64 || t == DType::kBF16 || t == DType::kF16;
}

// Short lower-case name: "f32", "f64", "bf16", "f16", "i32", "i64".
absl::string_view DTypeName(DType t);

// Inverse of DTypeName; also accepts "fp32", "float32", "bfloat16", ... .
// Unknown names are InvalidArgument naming the input.
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Whether a raw integer is one of the enumerators (for values read from files or wires).
bool IsValidDType(int raw);

}  // namespace gradsum

#endif  // GRADSUM_CORE_DTYPE_H_
