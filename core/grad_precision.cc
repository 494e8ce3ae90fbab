#include "core/grad_precision.h"

namespace gradsum {

const char* GradPrecisionName(GradPrecision p) {
  switch (p) {
    case GradPrecision::kF32:
      return "f32";
    case GradPrecision::kBF16Wire:
      return "bf16_wire";
    case GradPrecision::kExact:
      return "exact";
  }
  return "invalid";
}

bool IsValidGradPrecision(GradPrecision p) {
  switch (p) {
    case GradPrecision::kF32:
    case GradPrecision::kBF16Wire:
    case GradPrecision::kExact:
      return true;
  }
  return false;
}

DType GradWireDType(GradPrecision p) {
  switch (p) {
    case GradPrecision::kF32:
      return DType::kF32;
    case GradPrecision::kBF16Wire:
      return DType::kBF16;
    case GradPrecision::kExact:
      return DType::kI64;
  }
  return DType::kF32;
}

}  // namespace gradsum
