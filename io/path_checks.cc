#include "io/path_checks.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "io/atomic_file.h"

namespace gradsum {
namespace {

// "--export=/dev/full: is a character device; --export takes a regular file".
absl::Status WrongKind(absl::string_view flag, const std::string& path, FileKind kind,
                       absl::string_view wanted) {
  return absl::InvalidArgumentError(
      absl::StrCat(flag, "=", path, ": is ", FileKindName(kind), "; ", flag, " takes ", wanted));
}

}  // namespace

absl::string_view FileKindName(FileKind kind) {
  switch (kind) {
    case FileKind::kMissing:
      return "missing";
    case FileKind::kRegular:
      return "a regular file";
    case FileKind::kDirectory:
      return "a directory";
    case FileKind::kFifo:
      return "a FIFO (named pipe)";
    case FileKind::kSocket:
      return "a socket";
    case FileKind::kCharDevice:
      return "a character device";
    case FileKind::kBlockDevice:
      return "a block device";
    case FileKind::kOther:
      break;
  }
  return "not a regular file";
}

FileKind FileKindOfMode(unsigned mode) {
  if (S_ISREG(mode)) return FileKind::kRegular;
  if (S_ISDIR(mode)) return FileKind::kDirectory;
  if (S_ISFIFO(mode)) return FileKind::kFifo;
  if (S_ISSOCK(mode)) return FileKind::kSocket;
  if (S_ISCHR(mode)) return FileKind::kCharDevice;
  if (S_ISBLK(mode)) return FileKind::kBlockDevice;
  return FileKind::kOther;
}

absl::StatusOr<FileKind> StatFileKind(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return FileKind::kMissing;
    return ErrnoStatus(errno, absl::StrCat("stat '", path, "'"));
  }
  return FileKindOfMode(st.st_mode);
}

bool IsNullDevice(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode) && major(st.st_rdev) == 1 &&
         minor(st.st_rdev) == 3;
}

absl::Status CheckInputFile(absl::string_view flag, const std::string& path) {
  absl::StatusOr<FileKind> kind = StatFileKind(path);
  if (!kind.ok()) return Annotate(kind.status(), absl::StrCat(flag, "=", path));
  if (*kind == FileKind::kMissing) {
    return absl::NotFoundError(absl::StrCat(flag, "=", path, ": no such file"));
  }
  if (*kind != FileKind::kRegular) return WrongKind(flag, path, *kind, "a regular file");
  return absl::OkStatus();
}

absl::Status CheckOutputFile(absl::string_view flag, const std::string& path,
                             const OutputFileOptions& options) {
  const std::string name = absl::StrCat(flag, "=", path);
  if (path.empty() || path.back() == '/') {
    return absl::InvalidArgumentError(absl::StrCat(name, ": not a file path"));
  }
  absl::StatusOr<FileKind> kind = StatFileKind(path);
  if (!kind.ok()) return Annotate(kind.status(), name);
  if (options.allow_null_device && IsNullDevice(path)) return absl::OkStatus();
  if (*kind != FileKind::kMissing && *kind != FileKind::kRegular) {
    return WrongKind(flag, path, *kind,
                     options.allow_null_device ? "a regular file or /dev/null" : "a regular file");
  }
  const std::string dir = DirectoryOf(path);
  absl::StatusOr<FileKind> dir_kind = StatFileKind(dir);
  if (!dir_kind.ok()) return Annotate(dir_kind.status(), name);
  if (*dir_kind == FileKind::kMissing) {
    return absl::NotFoundError(absl::StrCat(name, ": its directory '", dir, "' does not exist"));
  }
  if (*dir_kind != FileKind::kDirectory) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": '", dir, "' is ", FileKindName(*dir_kind), ", not a directory"));
  }
  return Annotate(ProbeWritableDir(dir), name);
}

absl::Status PrepareOutputDir(absl::string_view flag, const std::string& dir) {
  const std::string name = absl::StrCat(flag, "=", dir);
  absl::StatusOr<FileKind> kind = StatFileKind(dir);
  if (!kind.ok()) return Annotate(kind.status(), name);
  if (*kind == FileKind::kMissing) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return ErrnoStatus(ec.value(), absl::StrCat(name, ": cannot create"));
    kind = StatFileKind(dir);
    if (!kind.ok()) return Annotate(kind.status(), name);
  }
  if (*kind != FileKind::kDirectory) return WrongKind(flag, dir, *kind, "a directory");
  return Annotate(ProbeWritableDir(dir), name);
}

absl::Status ProbeWritableDir(const std::string& dir) {
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0;; ++attempt) {
    // pid + counter keeps concurrent probes (threads, processes) apart; a process of the
    // same pid on another host sharing the directory only costs a retry.
    const std::string probe = absl::StrCat(dir, "/.write-probe.", ::getpid(), ".",
                                           counter.fetch_add(1, std::memory_order_relaxed));
    const int fd = ::open(probe.c_str(),
                          O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
    if (fd < 0) {
      if (errno == EEXIST && attempt < 16) continue;
      return ErrnoStatus(errno, absl::StrCat("cannot create a file in '", dir, "'"));
    }
    ::close(fd);
    if (::unlink(probe.c_str()) != 0) {
      return ErrnoStatus(errno, absl::StrCat("cannot remove the probe file '", probe, "'"));
    }
    return absl::OkStatus();
  }
}

}  // namespace gradsum
