#include "io/fingerprint.h"

#include <errno.h>
#include <unistd.h>
#include <xxhash.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "io/atomic_file.h"

namespace gradsum {

uint64_t Fingerprint64(absl::string_view bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

absl::StatusOr<uint64_t> FingerprintFile(const std::string& path, uint64_t max_bytes) {
  absl::StatusOr<ReadOnlyFile> file = OpenRegularFile(path);
  if (!file.ok()) return file.status();
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) return absl::ResourceExhaustedError("XXH3_createState");
  struct Freer {
    XXH3_state_t* s;
    ~Freer() { XXH3_freeState(s); }
  } freer{state};
  XXH3_64bits_reset(state);
  std::string buf(1 << 20, '\0');
  uint64_t total = 0;
  while (true) {
    const ssize_t n = ::read(file->fd(), &buf[0], buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("read '", path, "'"));
    }
    if (n == 0) break;
    total += static_cast<uint64_t>(n);
    if (total > max_bytes) {
      return absl::OutOfRangeError(
          absl::StrCat("file '", path, "' has more than the limit of ", max_bytes, " bytes"));
    }
    XXH3_64bits_update(state, buf.data(), static_cast<size_t>(n));
  }
  return static_cast<uint64_t>(XXH3_64bits_digest(state));
}

}  // namespace gradsum
