#include "sharding/atomic_file.h"

#include <sys/stat.h>

#include <cstdlib>
#include <set>
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

TEST(AtomicFileTest, FingerprintSeesEveryBitFlipAndLengthChange) {
  std::string data(37, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 31 + 7);
  std::set<uint64_t> seen = {Fingerprint64(data)};
  for (size_t byte = 0; byte < data.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string d = data;
      d[byte] ^= static_cast<char>(1 << bit);
      EXPECT_TRUE(seen.insert(Fingerprint64(d)).second) << byte << ":" << bit;
    }
  }
  // Appended zero bytes (a file padded or extended with zeros) change it too.
  for (int extra = 1; extra <= 16; ++extra) {
    EXPECT_TRUE(seen.insert(Fingerprint64(data + std::string(extra, '\0'))).second) << extra;
  }
  EXPECT_NE(Fingerprint64(""), Fingerprint64(std::string(8, '\0')));
}


TEST(AtomicFileTest, FingerprintIsXxh3AndFilesStreamToTheSameValue) {
  // XXH3-64 with seed 0 of the empty input, as published by xxHash (xxhsum -H3).
  EXPECT_EQ(Fingerprint64(""), 0x2D06800538D394C2ull);
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp ? tmp : "/tmp") + "/fingerprint_stream.bin";
  std::string data(3 * (1 << 20) + 12345, '\0');  // several read pieces and a tail
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  ASSERT_TRUE(WriteFileAtomically(path, data).ok());
  absl::StatusOr<uint64_t> fp = FingerprintFile(path, data.size());
  ASSERT_TRUE(fp.ok()) << fp.status();
  EXPECT_EQ(*fp, Fingerprint64(data));
  EXPECT_EQ(FingerprintFile(path, data.size() - 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(FingerprintFile(tmp ? tmp : "/tmp", 100).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(FingerprintFile(path + ".missing", 100).status().code(), absl::StatusCode::kNotFound);
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
