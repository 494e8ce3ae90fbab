#include "io/dir_lock.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "io/atomic_file.h"
#include "io/path_checks.h"

namespace gradsum {
namespace {

// The holder's record, read without the lock (a holder that has just locked may not have
// written it yet: a short wait for it, then whatever is there).
std::string ReadRecord(int fd) {
  std::string text;
  for (int attempt = 0; attempt < 50; ++attempt) {
    char buf[512];
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    text.assign(buf, n > 0 ? static_cast<size_t>(n) : 0);
    if (!absl::StripAsciiWhitespace(text).empty()) break;
    ::usleep(2000);
  }
  return std::string(absl::StripAsciiWhitespace(text));
}

// "pid 4242 on host n1 since 2026-12-04T18:00:00Z" from "pid=4242 host=n1 since=...".
std::string DescribeHolder(const std::string& record) {
  std::map<std::string, std::string> fields;
  for (absl::string_view part : absl::StrSplit(record, ' ', absl::SkipWhitespace())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
    fields[kv.first] = kv.second;
  }
  if (fields.count("pid") == 0 || fields.count("host") == 0) {
    return record.empty() ? "another process (its record is empty)"
                          : absl::StrCat("another process (record \"", record, "\")");
  }
  std::string out = absl::StrCat("pid ", fields["pid"], " on host ", fields["host"]);
  if (fields.count("since") > 0) absl::StrAppend(&out, " since ", fields["since"]);
  return out;
}

}  // namespace

DirLock::DirLock(DirLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

DirLock& DirLock::operator=(DirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the lock
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);
}

std::string DirLock::HolderRecord() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return absl::StrCat("pid=", ::getpid(), " host=", host[0] != '\0' ? host : "unknown", " since=",
                      absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone()));
}

absl::StatusOr<DirLock> DirLock::Acquire(const std::string& dir, absl::string_view file_name) {
  DirLock lock;
  lock.path_ = absl::StrCat(dir, "/", file_name);
  const std::string& path = lock.path_;
  absl::StatusOr<FileKind> kind = StatFileKind(path);
  if (!kind.ok()) return kind.status();
  if (*kind != FileKind::kMissing && *kind != FileKind::kRegular) {
    return absl::InvalidArgumentError(absl::StrCat("the lock file '", path, "' is ",
                                                   FileKindName(*kind), ", not a regular file"));
  }
  // O_NOFOLLOW: a symlink planted at the name is refused (ELOOP), not followed;
  // O_NONBLOCK: whatever is there, the open cannot wait.
  lock.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  if (lock.fd_ < 0)
    return ErrnoStatus(errno, absl::StrCat("cannot open the lock file '", path, "'"));
  struct stat st;
  if (::fstat(lock.fd_, &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat '", path, "'"));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("the lock file '", path, "' is ",
                                                   FileKindName(FileKindOfMode(st.st_mode)),
                                                   ", not a regular file"));
  }
  int rc;
  do {
    rc = ::flock(lock.fd_, LOCK_EX | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "held by ", DescribeHolder(ReadRecord(lock.fd_)), " (lock file ", path, ")"));
    }
    return ErrnoStatus(errno, absl::StrCat("cannot lock '", path, "'"));
  }
  const std::string record = HolderRecord() + "\n";
  if (::ftruncate(lock.fd_, 0) != 0 ||
      ::pwrite(lock.fd_, record.data(), record.size(), 0) != static_cast<ssize_t>(record.size())) {
    return ErrnoStatus(errno, absl::StrCat("cannot write the lock file '", path, "'"));
  }
  return lock;
}

}  // namespace gradsum
