#include "io/atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "io/path_checks.h"

namespace gradsum {
namespace {

absl::Status ErrnoError(int err, absl::string_view what, absl::string_view path) {
  return ErrnoStatus(err, absl::StrCat(what, " '", path, "'"));
}

absl::Status WriteAll(int fd, absl::string_view bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "write", path);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "open directory", dir);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoError(err, "fsync directory", dir);
  return absl::OkStatus();
}

}  // namespace

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

absl::Status ErrnoStatus(int err, absl::string_view message) {
  char buf[256];
  // GNU strerror_r: returns the message (in buf or a static string).
  const char* text = ::strerror_r(err, buf, sizeof(buf));
  return absl::Status(absl::ErrnoToStatusCode(err), absl::StrCat(message, ": ", text));
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes) {
  if (path.empty() || path.back() == '/') {
    return absl::InvalidArgumentError(absl::StrCat("not a file path: '", path, "'"));
  }
  // Only a regular file may be replaced: renaming over a device (/dev/full), a FIFO or a
  // directory would swap it for a plain file, hiding the write error the caller must see.
  struct stat existing;
  if (::lstat(path.c_str(), &existing) == 0 && !S_ISREG(existing.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", path, "' exists and is not a regular file; not replacing it"));
  }
  static std::atomic<uint64_t> counter{0};
  // pid + counter keeps concurrent writers (ranks as threads, or processes) apart.
  const std::string tmp =
      absl::StrCat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1, std::memory_order_relaxed));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, "create", tmp);
  absl::Status s = WriteAll(fd, bytes, tmp);
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoError(errno, "fsync", tmp);
  if (::close(fd) != 0 && s.ok()) s = ErrnoError(errno, "close", tmp);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) s = ErrnoError(errno, "rename to", path);
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return FsyncDir(DirectoryOf(path));
}

ReadOnlyFile& ReadOnlyFile::operator=(ReadOnlyFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    size_ = other.size_;
    other.fd_ = -1;
  }
  return *this;
}

ReadOnlyFile::~ReadOnlyFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<ReadOnlyFile> OpenRegularFile(const std::string& path) {
  ReadOnlyFile file;
  // O_NONBLOCK: an open of a FIFO would otherwise wait for a writer, maybe forever. A
  // regular file ignores the flag, and anything else is refused below.
  file.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (file.fd_ < 0) return ErrnoError(errno, "open", path);
  struct stat st;
  if (::fstat(file.fd_, &st) != 0) return ErrnoError(errno, "stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("not a regular file: '", path, "' is ",
                                                      FileKindName(FileKindOfMode(st.st_mode))));
  }
  const int flags = ::fcntl(file.fd_, F_GETFL);
  if (flags < 0 || ::fcntl(file.fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return ErrnoError(errno, "fcntl", path);
  }
  file.size_ = static_cast<uint64_t>(st.st_size);
  return file;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path, uint64_t max_bytes) {
  absl::StatusOr<ReadOnlyFile> file = OpenRegularFile(path);
  if (!file.ok()) return file.status();
  const uint64_t size = file->size();
  if (size > max_bytes) {
    return absl::OutOfRangeError(
        absl::StrCat("file '", path, "' has ", size, " bytes, more than the limit ", max_bytes));
  }
  std::string out(size, '\0');
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(file->fd(), &out[done], size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "read", path);
    }
    if (n == 0) break;  // shrank while reading
    done += static_cast<size_t>(n);
  }
  out.resize(done);
  return out;
}

}  // namespace gradsum
