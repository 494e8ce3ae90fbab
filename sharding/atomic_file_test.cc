#include "sharding/atomic_file.h"

#include <sys/stat.h>

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

}  // namespace
}  // namespace gradsum
