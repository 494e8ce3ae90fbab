#include "torch/large_buffers.h"

#include <cstdint>
#include <cstring>

#include "gtest/gtest.h"

namespace gradsum::torch_ops {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(LargeBuffersTest, AlignedWritableAndReusedWhenTheSizeFits) {
  ReleaseCachedLargeBuffer();
  LargeBuffer a = TakeLargeBuffer(33 * kMiB);
  ASSERT_NE(a.data, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data) % (2 * kMiB), 0u);
  EXPECT_GE(a.usable_bytes, 33 * kMiB);
  std::memset(a.data, 1, 33 * kMiB);
  GiveBackLargeBuffer(a);
  // The same size, and a smaller one down to half the buffer: the kept buffer, touched.
  LargeBuffer b = TakeLargeBuffer(33 * kMiB);
  EXPECT_EQ(b.data, a.data);
  EXPECT_EQ(static_cast<unsigned char*>(b.data)[33 * kMiB - 1], 1);
  GiveBackLargeBuffer(b);
  LargeBuffer c = TakeLargeBuffer(20 * kMiB);
  EXPECT_EQ(c.data, a.data);
  // Taken: the next request maps anew.
  LargeBuffer d = TakeLargeBuffer(20 * kMiB);
  ASSERT_NE(d.data, nullptr);
  EXPECT_NE(d.data, c.data);
  GiveBackLargeBuffer(d);
  GiveBackLargeBuffer(c);  // replaces d, which is unmapped
  LargeBuffer e = TakeLargeBuffer(20 * kMiB);
  EXPECT_EQ(e.data, c.data);
  EXPECT_EQ(ReleaseCachedLargeBuffer(), 0u);  // nothing kept now
  GiveBackLargeBuffer(e);
  EXPECT_EQ(ReleaseCachedLargeBuffer(), e.mapped_bytes);
}

TEST(LargeBuffersTest, TooSmallOrFarTooLargeIsNotReused) {
  ReleaseCachedLargeBuffer();
  LargeBuffer a = TakeLargeBuffer(40 * kMiB);
  ASSERT_NE(a.data, nullptr);
  GiveBackLargeBuffer(a);
  LargeBuffer big = TakeLargeBuffer(100 * kMiB);  // does not fit
  EXPECT_NE(big.data, a.data);
  LargeBuffer small = TakeLargeBuffer(10 * kMiB);  // would waste more than half
  EXPECT_NE(small.data, a.data);
  EXPECT_GT(ReleaseCachedLargeBuffer(), 40 * kMiB);
  EXPECT_EQ(ReleaseCachedLargeBuffer(), 0u);
  GiveBackLargeBuffer(big);
  GiveBackLargeBuffer(small);
  ReleaseCachedLargeBuffer();
}

}  // namespace
}  // namespace gradsum::torch_ops
