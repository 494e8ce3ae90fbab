#ifndef GRADSUM_IO_DIR_LOCK_H_
#define GRADSUM_IO_DIR_LOCK_H_

// One process owns a directory while it lives: an advisory flock(2) on a lock file in it.
// The kernel releases the lock when the process ends, however it ends (exit, crash,
// kill -9), so a lock file left behind by a dead process is taken over at once, never a
// blocker. The file records its holder (pid, host, start time) so that a process refused
// the lock can say who has it.
//
//   absl::StatusOr<DirLock> lock = DirLock::Acquire("/ckpt", "moe_lm.lock");
//   if (!lock.ok()) return lock.status();  // "held by pid 4242 on host n1 since ..."
//   ...                                    // the directory is ours until `lock` goes
//
// Advisory: it keeps out processes that take the same lock, nothing else. flock works on
// local file systems and on NFS (the client maps it to a byte-range lock that the server
// sees, so it holds across hosts); a file system without locks is an error, not a silent
// pass. Within a process, two DirLocks on one file exclude each other too (each open of
// the file is its own lock holder).

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsum {

class DirLock {
 public:
  DirLock() = default;  // holds nothing
  DirLock(DirLock&& other) noexcept;
  DirLock& operator=(DirLock&& other) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  ~DirLock();  // releases the lock

  // Takes the lock on `dir`/`file_name` without waiting: creates the file if missing
  // (never following a symlink; anything but a regular file there is InvalidArgument),
  // locks it exclusively, and writes this process's record into it. Held by another:
  // FailedPrecondition "held by pid P on host H since T (lock file F)", from the holder's
  // record. A lock file that cannot be created or opened for writing (a read-only file
  // system, no permission, a missing directory) or a file system without locks: the errno
  // status naming the file.
  static absl::StatusOr<DirLock> Acquire(const std::string& dir, absl::string_view file_name);

  bool held() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

  // The record a holder writes: "pid=P host=H since=T" (T in RFC 3339, UTC).
  static std::string HolderRecord();

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace gradsum

#endif  // GRADSUM_IO_DIR_LOCK_H_
