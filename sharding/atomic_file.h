#ifndef GRADSUM_SHARDING_ATOMIC_FILE_H_
#define GRADSUM_SHARDING_ATOMIC_FILE_H_

// Whole-file reads and crash-safe whole-file writes, for checkpoints and dumps.
//
//   GRADSUM_RETURN_IF_ERROR(WriteFileAtomically("/ckpt/rank-0.manifest.json", text));
//   GRADSUM_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
//
// WriteFileAtomically writes a temporary file in the destination's directory, fsyncs it,
// renames it over `path` and fsyncs the directory, so a reader (or a restart after a crash)
// sees either the old file or the complete new one, never a prefix.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsum {

// Errors carry the errno-derived code (NotFound for a missing directory, PermissionDenied,
// ...) and name the path; the temporary file is removed on failure.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes);

// Reads the whole file. A file larger than `max_bytes` is OutOfRange naming its size
// (guards against reading a wrong, huge path into memory). Errors name the path.
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             uint64_t max_bytes = uint64_t{1} << 40);

// A 64-bit FNV-1a-style checksum over `bytes` (word-wise, so it runs near memory speed):
// detects flipped bits in a checkpoint file whose structure is still valid. Assumes a
// little-endian host (as safetensors does). Not cryptographic.
uint64_t Fingerprint64(absl::string_view bytes);

}  // namespace gradsum

#endif  // GRADSUM_SHARDING_ATOMIC_FILE_H_
