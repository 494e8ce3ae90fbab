// Proves that the system abseil is found and links: Status, StrCat, Mutex, Time, flags.
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

ABSL_FLAG(int, smoke_value, 7, "a flag to prove absl_flags links");

namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError(absl::StrCat("odd value ", x));
  return x / 2;
}

TEST(AbslSmoke, StatusStringsMutexTimeFlags) {
  EXPECT_EQ(*Half(8), 4);
  EXPECT_EQ(Half(3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Half(3).status().message(), "odd value 3");
  EXPECT_EQ(absl::StrFormat("%05.1f", 2.25), "002.2");
  absl::Mutex mu;
  int guarded = 0;
  {
    absl::MutexLock lock(&mu);
    guarded = 1;
  }
  EXPECT_EQ(guarded, 1);
  EXPECT_GT(absl::ToUnixSeconds(absl::Now()), 1600000000);
  EXPECT_EQ(absl::GetFlag(FLAGS_smoke_value), 7);
}

}  // namespace
