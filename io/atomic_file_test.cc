#include "io/atomic_file.h"

#include <sys/stat.h>

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

}  // namespace
}  // namespace gradsum
