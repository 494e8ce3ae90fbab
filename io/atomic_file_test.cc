#include "io/atomic_file.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace gradsum {
namespace {

TEST(AtomicFileTest, WriteThenReadBack) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp ? tmp : "/tmp", "/atomic.bin");
  const std::string data("a\0b\xff", 4);
  ASSERT_TRUE(WriteFileAtomically(path, data).ok());
  absl::StatusOr<std::string> back = ReadFileToString(path);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, data);
  absl::StatusOr<std::string> small = ReadFileToString(path, 3);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(WriteFileAtomically("", data).code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::string> dir = ReadFileToString(tmp ? tmp : "/tmp");
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(AtomicFileTest, NeverReplacesWhatIsNotARegularFile) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp ? tmp : "/tmp") + "/not_regular";
  ::mkdir(dir.c_str(), 0755);
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  absl::Status s = WriteFileAtomically(fifo, "data");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find(fifo), std::string::npos) << s;
  struct stat st;
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_EQ(WriteFileAtomically(dir, "data").code(), absl::StatusCode::kFailedPrecondition);
}

// A FIFO with no writer would block open(2) for reading forever; the readers open
// non-blockingly and refuse it, naming what it is. The read runs in a child process so that
// a regression fails here in 10 s instead of hanging the test.
TEST(AtomicFileTest, ReadingAFifoNeitherBlocksNorSucceeds) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string fifo = std::string(tmp ? tmp : "/tmp") + "/read_fifo";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    absl::StatusOr<std::string> s = ReadFileToString(fifo);
    const bool refused =
        s.status().code() == absl::StatusCode::kFailedPrecondition &&
        s.status().message().find("'" + fifo + "' is a FIFO (named pipe)") != std::string::npos;
    ::_exit(refused ? 0 : 1);
  }
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 1000 && done == 0; ++i) {
    done = ::waitpid(child, &status, WNOHANG);
    if (done == 0) ::usleep(10000);
  }
  if (done == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "reading a FIFO blocked for 10 s";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the read of a FIFO was not refused as a FIFO";
}

}  // namespace
}  // namespace gradsum
