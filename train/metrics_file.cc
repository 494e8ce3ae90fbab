#include "train/metrics_file.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "io/atomic_file.h"
#include "io/path_checks.h"

namespace gradsum::train {

MetricsFile::MetricsFile(MetricsFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

MetricsFile& MetricsFile::operator=(MetricsFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

MetricsFile::~MetricsFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<MetricsFile> MetricsFile::Open(const std::string& path, bool append) {
  const std::string name = absl::StrCat("--metrics=", path);
  const bool null_device = IsNullDevice(path);
  if (!null_device) {
    absl::StatusOr<FileKind> kind = StatFileKind(path);
    if (!kind.ok()) return Annotate(kind.status(), name);
    if (*kind != FileKind::kMissing && *kind != FileKind::kRegular) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": is ", FileKindName(*kind), "; --metrics takes a regular file or /dev/null"));
    }
  }
  // O_NONBLOCK: if the path became a FIFO since the check, the open fails (ENXIO) instead of
  // waiting for a reader; the descriptor is checked below and made blocking again.
  MetricsFile f;
  f.fd_ = ::open(
      path.c_str(),
      O_WRONLY | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOCTTY | (append ? O_APPEND : O_TRUNC), 0644);
  if (f.fd_ < 0) return ErrnoStatus(errno, absl::StrCat(name, ": cannot open"));
  f.path_ = path;
  struct stat st;
  if (::fstat(f.fd_, &st) != 0) return ErrnoStatus(errno, absl::StrCat(name, ": cannot stat"));
  if (!S_ISREG(st.st_mode) && !(null_device && S_ISCHR(st.st_mode))) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": is ", FileKindName(FileKindOfMode(st.st_mode)),
                     "; --metrics takes a regular file or /dev/null"));
  }
  const int flags = ::fcntl(f.fd_, F_GETFL);
  if (flags < 0 || ::fcntl(f.fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return ErrnoStatus(errno, absl::StrCat(name, ": fcntl"));
  }
  return f;
}

absl::Status MetricsFile::WriteLine(absl::string_view line) {
  const std::string name = absl::StrCat("--metrics=", path_);
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(name, ": not open"));
  const std::string text = absl::StrCat(line, "\n");
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat(name, ": write failed"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status MetricsFile::Close() {
  if (fd_ < 0) return absl::OkStatus();
  const int rc = ::close(std::exchange(fd_, -1));
  if (rc != 0) return ErrnoStatus(errno, absl::StrCat("--metrics=", path_, ": close failed"));
  return absl::OkStatus();
}

}  // namespace gradsum::train
