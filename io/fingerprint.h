#ifndef GRADSUM_IO_FINGERPRINT_H_
#define GRADSUM_IO_FINGERPRINT_H_

// XXH3-64 fingerprints (xxHash, seed 0) of bytes and files: they tell files apart and catch
// flipped bits in a file whose structure is still valid (checkpoint manifests and tensor
// files, the --data corpus, the ranks' config fields). Outside tools compute the same value
// (`xxhsum -H3 FILE`). Not cryptographic.
//
//   const uint64_t fp = Fingerprint64(bytes);
//   GRADSUM_ASSIGN_OR_RETURN(uint64_t file_fp, FingerprintFile(path, max_bytes));

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsum {

// XXH3-64 of `bytes`.
uint64_t Fingerprint64(absl::string_view bytes);

// Fingerprint64 of the file at `path`, read in pieces (never whole into memory). The file
// must be regular (FailedPrecondition otherwise) and at most `max_bytes` long (OutOfRange).
// Errors name the path.
absl::StatusOr<uint64_t> FingerprintFile(const std::string& path, uint64_t max_bytes);

}  // namespace gradsum

#endif  // GRADSUM_IO_FINGERPRINT_H_
