#include "core/tensor.h"

#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gradsum {

const char* DeviceName(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }

absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t d = shape[i];
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dimension ", i, " is negative (", d, ") in shape [", absl::StrJoin(shape, ","), "]"));
    }
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("element count of shape [", absl::StrJoin(shape, ","), "] overflows int64"));
    }
    n *= d;
  }
  return n;
}

absl::StatusOr<TensorView> TensorView::Create(void* data, DType dtype,
                                              absl::Span<const int64_t> shape, DeviceRef device) {
  if (!IsValidDType(static_cast<int>(dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid dtype value ", static_cast<int>(dtype)));
  }
  absl::StatusOr<int64_t> n = NumElements(shape);
  if (!n.ok()) return n.status();
  if (*n > std::numeric_limits<int64_t>::max() / static_cast<int64_t>(DTypeSize(dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte size of shape [", absl::StrJoin(shape, ","), "] overflows int64"));
  }
  if (data == nullptr && *n > 0) {
    return absl::InvalidArgumentError(absl::StrCat("null data for a tensor of ", *n, " elements"));
  }
  if (device.index < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative device index ", device.index));
  }
  TensorView v;
  v.data_ = data;
  v.dtype_ = dtype;
  v.shape_.assign(shape.begin(), shape.end());
  v.numel_ = *n;
  v.device_ = device;
  return v;
}

absl::StatusOr<TensorView> TensorView::Rows(int64_t begin, int64_t end) const {
  if (shape_.empty()) return absl::InvalidArgumentError("Rows() of a 0-d tensor");
  if (begin < 0 || end < begin || end > shape_[0]) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows [", begin, ", ", end, ") out of range for ", DebugString()));
  }
  const int64_t row_elems = shape_[0] == 0 ? 0 : numel_ / shape_[0];
  std::vector<int64_t> s = shape_;
  s[0] = end - begin;
  char* base = static_cast<char*>(data_);
  void* p = base == nullptr ? nullptr : base + begin * row_elems * DTypeSize(dtype_);
  return Create(p, dtype_, s, device_);
}

absl::StatusOr<TensorView> TensorView::Reshape(absl::Span<const int64_t> shape) const {
  absl::StatusOr<int64_t> n = NumElements(shape);
  if (!n.ok()) return n.status();
  if (*n != numel_) {
    return absl::InvalidArgumentError(absl::StrCat("cannot reshape ", DebugString(), " to [",
                                                   absl::StrJoin(shape, ","), "]: ", *n,
                                                   " elements vs ", numel_));
  }
  return Create(data_, dtype_, shape, device_);
}

std::string TensorView::DebugString() const {
  return absl::StrCat(DTypeName(dtype_), "[", absl::StrJoin(shape_, ","), "]@",
                      DeviceName(device_.type),
                      device_.type == Device::kCuda ? absl::StrCat(":", device_.index) : "");
}

}  // namespace gradsum
