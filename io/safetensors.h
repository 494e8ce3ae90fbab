#ifndef GRADSUM_IO_SAFETENSORS_H_
#define GRADSUM_IO_SAFETENSORS_H_

// Reading and writing the standard .safetensors format, for checkpoints and tensor dumps
// that other tools (Python `safetensors`, `transformers`) read.
//
// File layout: 8-byte little-endian header length N, then N bytes of JSON
//   {"__metadata__": {"k": "v"}, "name": {"dtype": "F32", "shape": [2, 3],
//    "data_offsets": [begin, end]}, ...}
// then the data buffer; offsets are relative to the buffer's start, tensors are
// row-major little-endian and together cover the buffer with no hole and no overlap.
//
//   SafetensorsWriter w;
//   GRADSUM_RETURN_IF_ERROR(w.Add("layer0.weight", weight_view));   // not copied yet
//   GRADSUM_RETURN_IF_ERROR(w.AddMetadata("step", "100"));
//   GRADSUM_RETURN_IF_ERROR(w.WriteFile("/dump/step100.safetensors"));  // atomic
//
//   GRADSUM_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Read(path));
//   GRADSUM_ASSIGN_OR_RETURN(TensorView t, f.Get("layer0.weight"));  // owned by f
//
// Supported dtypes: F32, F64, BF16, F16, I32, I64 (gradsum's DType). Reading validates
// everything and never trusts the file: a truncated file, a header length beyond the file,
// malformed JSON, a missing or ill-typed field, an unknown dtype, offsets out of range,
// overlapping or leaving holes, or a byte size that disagrees with the shape are all
// DataLoss naming the file and the problem. Valid safetensors dtypes that gradsum does
// not use (BOOL, U8, I8, F8_E4M3, ...) are Unimplemented. Host must be little-endian.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace gradsum {

class ReadOnlyFile;  // io/atomic_file.h

// "F32", "F64", "BF16", "F16", "I32", "I64".
absl::string_view SafetensorsDTypeName(DType dtype);

// Collects tensors (by view: nothing is copied until Serialize/WriteFile) and writes them
// as one file, tensors ordered by name.
class SafetensorsWriter {
 public:
  // Adds a CPU tensor. The view's memory must stay valid until the file is written.
  // InvalidArgument: empty name, the reserved name "__metadata__", a duplicate name, a name
  // that is not UTF-8, or a view that is not on the CPU.
  absl::Status Add(absl::string_view name, const TensorView& tensor);

  // Adds a string entry to "__metadata__". InvalidArgument on a duplicate key, or a key or
  // value that is not UTF-8.
  absl::Status AddMetadata(absl::string_view key, absl::string_view value);

  // The complete file contents. The header is padded with spaces to a multiple of 8
  // bytes, so the data buffer starts 8-byte aligned.
  std::string Serialize() const;

  // Serialize() written with WriteFileAtomically (temp file in the same directory, fsync,
  // rename, fsync of the directory). File-system errors name the path.
  absl::Status WriteFile(const std::string& path) const;

  int num_tensors() const { return static_cast<int>(tensors_.size()); }

 private:
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Where one tensor's bytes are: [begin, end) relative to the data buffer.
struct SafetensorsTensorRange {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

// A safetensors file on disk read by its header only: the tensors' dtypes, shapes and byte
// ranges (validated as SafetensorsFile::Parse validates them, against the file's size),
// and reads of byte ranges of one tensor (pread), so that a reader needing part of a large
// file never holds the whole of it.
//
//   GRADSUM_ASSIGN_OR_RETURN(SafetensorsHeader h, SafetensorsHeader::Read(path));
//   std::vector<float> part(n);
//   GRADSUM_RETURN_IF_ERROR(h.ReadTensorBytes("emb/master", 4 * first, 4 * n, part.data()));
class SafetensorsHeader {
 public:
  // Opens `path` (kept open while a copy lives) and reads its header. Errors as Read's.
  static absl::StatusOr<SafetensorsHeader> Read(const std::string& path);
  // NotFound naming the tensor and the file.
  absl::StatusOr<const SafetensorsTensorRange*> Find(absl::string_view name) const;
  // Bytes [offset, offset + n) of tensor `name`'s data into `out`. OutOfRange beyond the
  // tensor; DataLoss if the file ends early.
  absl::Status ReadTensorBytes(absl::string_view name, uint64_t offset, uint64_t n,
                               void* out) const;
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t file_bytes() const { return file_bytes_; }
  const std::string& path() const { return path_; }

 private:
  absl::Status ReadAt(uint64_t offset, uint64_t n, void* out) const;
  std::string path_;
  std::shared_ptr<ReadOnlyFile> file_;  // shared: the header is copyable
  uint64_t file_bytes_ = 0, data_begin_ = 0;
  std::map<std::string, SafetensorsTensorRange, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A parsed, validated safetensors file that owns its tensors' memory (each tensor is
// copied into its own 8-byte aligned storage, so views are aligned for their dtype).
class SafetensorsFile {
 public:
  // Reads and validates `path`. Missing file: NotFound (from the OS); content errors:
  // DataLoss naming `path`.
  static absl::StatusOr<SafetensorsFile> Read(const std::string& path);

  // Validates in-memory file contents; `source` names them in error messages.
  static absl::StatusOr<SafetensorsFile> Parse(absl::string_view bytes,
                                               absl::string_view source = "<memory>");

  // Tensor names in ascending order.
  std::vector<std::string> names() const;
  int num_tensors() const { return static_cast<int>(tensors_.size()); }
  bool Contains(absl::string_view name) const;

  // A view of the named tensor, valid while this object lives. The memory belongs to the
  // file object: treat the view as read-only. NotFound naming the tensor and the file.
  absl::StatusOr<TensorView> Get(absl::string_view name) const;

  // The "__metadata__" entries (empty if the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Where the file came from (the path, or Parse's `source`).
  const std::string& source() const { return source_; }

 private:
  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    std::shared_ptr<std::vector<uint64_t>> storage;  // 8-byte aligned bytes
  };
  std::string source_;
  std::map<std::string, Entry, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace gradsum

#endif  // GRADSUM_IO_SAFETENSORS_H_
