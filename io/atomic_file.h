#ifndef GRADSUM_IO_ATOMIC_FILE_H_
#define GRADSUM_IO_ATOMIC_FILE_H_

// Whole-file reads and crash-safe whole-file writes, for checkpoints, dumps, exports and
// the files the trainer reads (config, data). Fingerprints are io/fingerprint.h.
//
//   GRADSUM_RETURN_IF_ERROR(WriteFileAtomically("/ckpt/rank-0.manifest.json", text));
//   GRADSUM_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
//
// WriteFileAtomically writes a temporary file in the destination's directory, fsyncs it,
// renames it over `path` and fsyncs the directory, so a reader (or a restart after a crash)
// sees either the old file or the complete new one, never a prefix.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsum {

// absl::ErrnoToStatus(err, message) without absl's StrError: the code from errno and
// "message: <strerror_r text>". Debian's absl StrError is not built with TSan and reports a
// race when rank threads fail at once; strerror_r is thread-safe and seen by TSan.
absl::Status ErrnoStatus(int err, absl::string_view message);

// Errors carry the errno-derived code (NotFound for a missing directory, PermissionDenied,
// ...) and name the path; the temporary file is removed on failure. An existing `path` that
// is not a regular file (a device such as /dev/full, a FIFO, a directory, a symlink) is
// FailedPrecondition and left alone.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes);

// A file opened read-only, closed when the object goes. OpenRegularFile opens `path`
// (O_RDONLY | O_CLOEXEC | O_NONBLOCK, so that a FIFO cannot block the open) and checks that
// it is a regular file: errors carry the errno code and name the path; a directory, device,
// FIFO or socket is FailedPrecondition "not a regular file: '<path>' is a FIFO (named
// pipe)". The one open/stat/check preamble of every reader in io/ (ReadFileToString,
// FingerprintFile, the safetensors readers).
class ReadOnlyFile {
 public:
  ReadOnlyFile() = default;
  ReadOnlyFile(ReadOnlyFile&& other) noexcept : fd_(other.fd_), size_(other.size_) {
    other.fd_ = -1;
  }
  ReadOnlyFile& operator=(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile();

  int fd() const { return fd_; }
  uint64_t size() const { return size_; }  // st_size when opened

 private:
  friend absl::StatusOr<ReadOnlyFile> OpenRegularFile(const std::string& path);
  int fd_ = -1;
  uint64_t size_ = 0;
};
absl::StatusOr<ReadOnlyFile> OpenRegularFile(const std::string& path);

// The directory part of `path` ("." when it has none, "/" for a file at the root).
std::string DirectoryOf(const std::string& path);

// Reads the whole file. A file larger than `max_bytes` is OutOfRange naming its size
// (guards against reading a wrong, huge path into memory). Errors name the path.
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             uint64_t max_bytes = uint64_t{1} << 40);

}  // namespace gradsum

#endif  // GRADSUM_IO_ATOMIC_FILE_H_
