#include "io/dir_lock.h"

#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp ? tmp : "/tmp") + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string Contents(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(DirLockTest, OneHolderAtATimeAndTheRefusalNamesIt) {
  const std::string dir = FreshDir("lock_one");
  absl::StatusOr<DirLock> first = DirLock::Acquire(dir, "run.lock");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->held());
  EXPECT_EQ(first->path(), dir + "/run.lock");
  EXPECT_THAT(Contents(dir + "/run.lock"),
              StartsWith("pid=" + std::to_string(::getpid()) + " host="));
  // Another open of the file is another holder, in this process too.
  absl::StatusOr<DirLock> second = DirLock::Acquire(dir, "run.lock");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  EXPECT_THAT(second.status().message(), HasSubstr("held by pid " + std::to_string(::getpid()) +
                                                   " on host " + host + " since "));
  EXPECT_THAT(second.status().message(), HasSubstr("(lock file " + dir + "/run.lock)"));
  // Released with the object: the next one gets it.
  *first = DirLock();
  absl::StatusOr<DirLock> third = DirLock::Acquire(dir, "run.lock");
  EXPECT_TRUE(third.ok()) << third.status();
}

// A process killed while holding the lock leaves its file behind, and no lock: the next
// holder takes it at once and writes its own record.
TEST(DirLockTest, AFileLeftByAKilledHolderIsNoBlocker) {
  const std::string dir = FreshDir("lock_stale");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    absl::StatusOr<DirLock> lock = DirLock::Acquire(dir, "run.lock");
    const char held = lock.ok() ? 'y' : 'n';
    (void)!::write(ready[1], &held, 1);
    ::pause();  // holds it until killed
    ::_exit(0);
  }
  ::close(ready[1]);
  pollfd wait_for_child = {ready[0], POLLIN, 0};
  char held = 0;
  if (::poll(&wait_for_child, 1, 30000) == 1) (void)!::read(ready[0], &held, 1);
  ::close(ready[0]);
  absl::StatusOr<DirLock> while_held = DirLock::Acquire(dir, "run.lock");
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_EQ(held, 'y') << "the child did not take the lock within 30 s";
  EXPECT_THAT(while_held.status().message(), HasSubstr("held by pid " + std::to_string(child)));
  EXPECT_THAT(Contents(dir + "/run.lock"), HasSubstr("pid=" + std::to_string(child)));
  absl::StatusOr<DirLock> after = DirLock::Acquire(dir, "run.lock");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_THAT(Contents(dir + "/run.lock"), StartsWith("pid=" + std::to_string(::getpid())));
}

TEST(DirLockTest, AnythingButARegularFileIsRefusedAndNothingBlocks) {
  const std::string dir = FreshDir("lock_kinds");
  ASSERT_EQ(::mkfifo((dir + "/fifo.lock").c_str(), 0644), 0);
  absl::StatusOr<DirLock> fifo = DirLock::Acquire(dir, "fifo.lock");
  EXPECT_EQ(fifo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fifo.status().message(), HasSubstr("is a FIFO (named pipe), not a regular file"));
  std::filesystem::create_directories(dir + "/dir.lock");
  EXPECT_EQ(DirLock::Acquire(dir, "dir.lock").status().code(), absl::StatusCode::kInvalidArgument);
  // A symlink is not followed, even to a regular file.
  std::ofstream(dir + "/target") << "";
  std::filesystem::create_symlink(dir + "/target", dir + "/link.lock");
  EXPECT_FALSE(DirLock::Acquire(dir, "link.lock").ok());
  absl::StatusOr<DirLock> missing = DirLock::Acquire(dir + "/none", "run.lock");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(dir + "/none/run.lock"));
}

// A directory where the lock file cannot be created is an error naming the file, not a
// wait and not a run without its lock. A read-only bind mount needs privileges a test does
// not have, so two file systems that refuse the create stand in for it: /proc (no regular
// files can be created there, even as root) and, unless run as root, a directory without
// write permission.
TEST(DirLockTest, ADirectoryThatRefusesTheLockFileIsAnErrorNamingIt) {
  absl::StatusOr<DirLock> proc = DirLock::Acquire("/proc", "run.lock");
  ASSERT_FALSE(proc.ok());
  EXPECT_THAT(proc.status().message(), HasSubstr("/proc/run.lock"));
  if (::geteuid() != 0) {
    const std::string dir = FreshDir("lock_readonly");
    ASSERT_EQ(::chmod(dir.c_str(), 0555), 0);
    absl::StatusOr<DirLock> ro = DirLock::Acquire(dir, "run.lock");
    ::chmod(dir.c_str(), 0755);
    EXPECT_EQ(ro.status().code(), absl::StatusCode::kPermissionDenied) << ro.status();
    EXPECT_THAT(ro.status().message(), HasSubstr(dir + "/run.lock"));
  }
}

}  // namespace
}  // namespace gradsum
