#ifndef GRADSUM_IO_PATH_CHECKS_H_
#define GRADSUM_IO_PATH_CHECKS_H_

// Checks on the paths a program is given, made before anything opens them: an open(2) of a
// FIFO blocks until the other end appears (forever, if nobody comes), and an output that
// cannot be written should be found before the work whose result it holds, not after.
//
//   GRADSUM_RETURN_IF_ERROR(CheckInputFile("--data", path));        // an existing regular file
//   GRADSUM_RETURN_IF_ERROR(CheckOutputFile("--export", path, {}));  // absent or regular, and
//                                                                    // its directory writable
//   GRADSUM_RETURN_IF_ERROR(PrepareOutputDir("--dump_dir", dir));    // created, writable
//
// `flag` only names the path in messages ("--export=/dev/full: is a character device; ...").
// Every check is stat(2) or an O_NONBLOCK open, so none of them blocks on a FIFO; the
// readers and writers of io/ open non-blockingly too (atomic_file.h), so a path that became
// a FIFO after its check still cannot block them.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsum {

// What a path names, by stat(2) (symlinks followed).
enum class FileKind {
  kMissing,  // nothing at the path (ENOENT)
  kRegular,
  kDirectory,
  kFifo,
  kSocket,
  kCharDevice,
  kBlockDevice,
  kOther,
};

// "a regular file", "a FIFO (named pipe)", "a character device", ...
absl::string_view FileKindName(FileKind kind);

// The kind of a stat(2) st_mode.
FileKind FileKindOfMode(unsigned mode);

// The kind of `path`. kMissing when nothing is there; any other stat(2) error (a parent that
// is not a directory, no search permission, a symlink loop) is its errno status naming the
// path.
absl::StatusOr<FileKind> StatFileKind(const std::string& path);

// True if `path` is the null device (character device 1:3, whatever its name).
bool IsNullDevice(const std::string& path);

// An input file: `path` must exist and be a regular file. Missing: NotFound naming flag and
// path; a directory, FIFO, socket or device: InvalidArgument naming flag, path and kind.
absl::Status CheckInputFile(absl::string_view flag, const std::string& path);

struct OutputFileOptions {
  // Accept the null device, whose writes are discarded (for a log nobody wants to keep).
  bool allow_null_device = false;
};

// An output file written whole later (atomically, as a new file renamed over `path`, or
// opened in place): `path` must be absent or a regular file (or the null device when
// allowed), and its directory must exist and accept a new file, which is checked by
// creating and removing an empty one (ProbeWritableDir). A directory, FIFO, socket or other
// device is InvalidArgument naming flag, path and kind; a directory that does not exist or
// cannot be written (read-only file system, no permission) is its errno status naming it.
absl::Status CheckOutputFile(absl::string_view flag, const std::string& path,
                             const OutputFileOptions& options = {});

// An output directory: created with its parents if missing; it must then be a directory
// that accepts a new file (ProbeWritableDir). Errors name flag and path.
absl::Status PrepareOutputDir(absl::string_view flag, const std::string& dir);

// Creates an empty file in `dir` (O_CREAT | O_EXCL, a name of its own) and removes it: the
// one honest test that `dir` takes new files, whoever runs it (root ignores permission
// bits but not a read-only file system). Errors are the errno status naming `dir`.
absl::Status ProbeWritableDir(const std::string& dir);

}  // namespace gradsum

#endif  // GRADSUM_IO_PATH_CHECKS_H_
