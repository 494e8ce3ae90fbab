#include "io/path_checks.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/atomic_file.h"

namespace gradsum {
namespace {

using ::testing::HasSubstr;

// A fresh directory with a regular file, a FIFO and a socket in it; under /tmp, since a
// socket's path must fit sockaddr_un (108 bytes), which Bazel's TEST_TMPDIR may not.
struct Fixture {
  std::string dir, file, fifo, socket;
  Fixture() {
    char name[] = "/tmp/gradsum-path-checks-XXXXXX";
    EXPECT_NE(::mkdtemp(name), nullptr);
    dir = name;
    file = dir + "/file.txt";
    std::ofstream(file) << "x";
    fifo = dir + "/fifo";
    EXPECT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
    socket = dir + "/socket";
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    socket.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ::close(fd);  // the socket file stays
  }
  ~Fixture() {
    ::chmod((dir + "/ro").c_str(), 0755);
    std::filesystem::remove_all(dir);
  }
};

TEST(PathChecksTest, KindsByStat) {
  Fixture f;
  EXPECT_EQ(*StatFileKind(f.file), FileKind::kRegular);
  EXPECT_EQ(*StatFileKind(f.dir), FileKind::kDirectory);
  EXPECT_EQ(*StatFileKind(f.fifo), FileKind::kFifo);
  EXPECT_EQ(*StatFileKind(f.socket), FileKind::kSocket);
  EXPECT_EQ(*StatFileKind("/dev/null"), FileKind::kCharDevice);
  EXPECT_EQ(*StatFileKind(f.dir + "/none"), FileKind::kMissing);
  // A path through a regular file is an error of its own, not "missing".
  EXPECT_EQ(StatFileKind(f.file + "/x").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(IsNullDevice("/dev/null"));
  EXPECT_FALSE(IsNullDevice("/dev/zero"));
  EXPECT_FALSE(IsNullDevice(f.file));
}

TEST(PathChecksTest, InputsAreExistingRegularFiles) {
  Fixture f;
  EXPECT_TRUE(CheckInputFile("--data", f.file).ok());
  absl::Status missing = CheckInputFile("--data", f.dir + "/none");
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("--data=" + f.dir + "/none: no such file"));
  for (const auto& [path, kind] : {std::pair<std::string, std::string>{f.fifo, "a FIFO"},
                                   {f.socket, "a socket"},
                                   {f.dir, "a directory"},
                                   {"/dev/zero", "a character device"}}) {
    absl::Status s = CheckInputFile("--config", path);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("--config=" + path + ": is " + kind));
    EXPECT_THAT(s.message(), HasSubstr("--config takes a regular file"));
  }
}

TEST(PathChecksTest, OutputFilesAreProbedWithoutBeingTouched) {
  Fixture f;
  EXPECT_TRUE(CheckOutputFile("--export", f.dir + "/new.safetensors").ok());
  EXPECT_FALSE(std::filesystem::exists(f.dir + "/new.safetensors"));
  EXPECT_TRUE(CheckOutputFile("--export", f.file).ok());
  EXPECT_EQ(*ReadFileToString(f.file), "x");  // not truncated
  // Nothing is left of the probes.
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(f.dir)) entries += e.exists() ? 1 : 0;
  EXPECT_EQ(entries, 3);
  for (const std::string& path :
       {f.fifo, f.socket, f.dir, std::string("/dev/full"), std::string("/dev/null")}) {
    absl::Status s = CheckOutputFile("--export", path);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << path << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("--export=" + path + ": is "));
  }
  EXPECT_TRUE(CheckOutputFile("--metrics", "/dev/null", {.allow_null_device = true}).ok());
  absl::Status full = CheckOutputFile("--metrics", "/dev/full", {.allow_null_device = true});
  EXPECT_EQ(full.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(full.message(), HasSubstr("takes a regular file or /dev/null"));
  absl::Status no_dir = CheckOutputFile("--export", f.dir + "/none/x.safetensors");
  EXPECT_EQ(no_dir.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_dir.message(), HasSubstr("its directory '" + f.dir + "/none' does not exist"));
  EXPECT_EQ(CheckOutputFile("--export", f.dir + "/").code(), absl::StatusCode::kInvalidArgument);
}

TEST(PathChecksTest, OutputDirsAreCreatedAndProbed) {
  Fixture f;
  EXPECT_TRUE(PrepareOutputDir("--dump_dir", f.dir + "/a/b").ok());
  EXPECT_TRUE(std::filesystem::is_directory(f.dir + "/a/b"));
  EXPECT_TRUE(std::filesystem::is_empty(f.dir + "/a/b"));
  absl::Status file = PrepareOutputDir("--dump_dir", f.file);
  EXPECT_EQ(file.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.message(), HasSubstr("is a regular file; --dump_dir takes a directory"));
  absl::Status under_file = PrepareOutputDir("--dump_dir", f.file + "/dump");
  EXPECT_FALSE(under_file.ok());
  EXPECT_THAT(under_file.message(), HasSubstr("--dump_dir=" + f.file + "/dump"));
}

// Root ignores permission bits, so only a non-root run can see EACCES here; a read-only
// file system is the case every user meets.
TEST(PathChecksTest, ADirectoryWithoutWritePermissionIsRefusedUnlessRoot) {
  Fixture f;
  const std::string ro = f.dir + "/ro";
  ASSERT_EQ(::mkdir(ro.c_str(), 0555), 0);
  absl::Status s = ProbeWritableDir(ro);
  if (::geteuid() == 0) {
    EXPECT_TRUE(s.ok()) << s;
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(s.message(), HasSubstr("cannot create a file in '" + ro + "'"));
  }
}

}  // namespace
}  // namespace gradsum
