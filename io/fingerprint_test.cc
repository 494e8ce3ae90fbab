#include "io/fingerprint.h"

#include <cstdlib>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "io/atomic_file.h"

namespace gradsum {
namespace {

TEST(FingerprintTest, FingerprintSeesEveryBitFlipAndLengthChange) {
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

TEST(FingerprintTest, FingerprintIsXxh3AndFilesStreamToTheSameValue) {
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

}  // namespace
}  // namespace gradsum
