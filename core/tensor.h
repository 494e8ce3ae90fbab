#ifndef GRADSUM_CORE_TENSOR_H_
#define GRADSUM_CORE_TENSOR_H_

// TensorView: a non-owning view of a dense, row-major tensor: pointer, dtype, shape,
// device. It never allocates or frees. Construction is checked: a null pointer with
// elements, a negative dimension, or an element count that overflows is InvalidArgument.
//
//   std::vector<float> buf(6);
//   absl::StatusOr<TensorView> t = TensorView::Create(buf.data(), DType::kF32, {2, 3});
//   float* p = t->data<float>();
//
// Views are cheap to copy; the owner of the memory must outlive them.

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace gradsum {

enum class Device : uint8_t { kCpu = 0, kCuda = 1 };

// "cpu" or "cuda".
const char* DeviceName(Device d);

// Where a tensor's memory lives. `index` is the CUDA ordinal (0 for the CPU).
struct DeviceRef {
  Device type = Device::kCpu;
  int index = 0;
  bool operator==(const DeviceRef& o) const { return type == o.type && index == o.index; }
};

class TensorView {
 public:
  // An empty view: no data, shape {0}.
  TensorView() = default;

  // Checked construction. `data` may be null only if the shape has zero elements.
  static absl::StatusOr<TensorView> Create(void* data, DType dtype, absl::Span<const int64_t> shape,
                                           DeviceRef device = {});
  static absl::StatusOr<TensorView> Create(void* data, DType dtype,
                                           std::initializer_list<int64_t> shape,
                                           DeviceRef device = {}) {
    return Create(data, dtype, absl::Span<const int64_t>(shape.begin(), shape.size()), device);
  }

  void* raw() const { return data_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  DeviceRef device() const { return device_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * DTypeSize(dtype_); }

  // A view of rows [begin, end) along dimension 0. Out-of-range is InvalidArgument.
  absl::StatusOr<TensorView> Rows(int64_t begin, int64_t end) const;

  // The same memory with another shape of equal element count.
  absl::StatusOr<TensorView> Reshape(absl::Span<const int64_t> shape) const;

  // e.g. "f32[2,3]@cpu".
  std::string DebugString() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_ = {0};
  int64_t numel_ = 0;
  DeviceRef device_;
};

// Number of elements of `shape`, or InvalidArgument on a negative dimension or overflow.
absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape);

}  // namespace gradsum

#endif  // GRADSUM_CORE_TENSOR_H_
