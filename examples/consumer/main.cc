// A consumer of gradsum's core targets: parses a dtype, makes a checked tensor view,
// rounds a value to bf16, and reports a bad shape as a status.
#include <cstdio>
#include <vector>

#include "core/dtype.h"
#include "core/half.h"
#include "core/tensor.h"

int main() {
  absl::StatusOr<gradsum::DType> dt = gradsum::ParseDType("bf16");
  if (!dt.ok()) return 1;
  std::vector<uint16_t> storage(8);
  absl::StatusOr<gradsum::TensorView> t = gradsum::TensorView::Create(storage.data(), *dt, {2, 4});
  if (!t.ok()) return 1;
  storage[0] = gradsum::BF16::FromFloat(3.14159f).bits;
  std::printf("%s holds %zu bytes; bf16(3.14159) = %g\n", t->DebugString().c_str(), t->nbytes(),
              gradsum::BF16::FromBits(storage[0]).ToFloat());
  absl::Status bad = gradsum::TensorView::Create(storage.data(), *dt, {2, -4}).status();
  std::printf("bad shape: %s\n", bad.ToString().c_str());
  return bad.ok() ? 1 : 0;
}
