#include "core/progress.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// A clock the test advances and a sink that keeps the lines.
struct Fake {
  double now = 100.0;
  std::vector<std::string> lines;
  ProgressReporter Make(const std::string& label, int64_t total, const std::string& unit) {
    return ProgressReporter(
        label, total, unit, [this] { return now; },
        [this](const std::string& line) { lines.push_back(line); });
  }
};

TEST(ProgressReporterTest, ShortWorkPrintsNothing) {
  Fake f;
  ProgressReporter p = f.Make("scanning a.bin", 1000, "tokens");
  for (int i = 1; i <= 10; ++i) {
    f.now += 0.19;
    p.Update(i * 100);
  }
  p.Finish();
  EXPECT_THAT(f.lines, IsEmpty());
  EXPECT_EQ(p.lines_printed(), 0);
}

TEST(ProgressReporterTest, LongWorkPrintsEveryIntervalWithRateAndEta) {
  Fake f;
  ProgressReporter p = f.Make("scanning a.bin", 10'000'000, "tokens");
  // 1M tokens per second, updates every 0.5 s: lines at 2, 4 and 6 s, none in between.
  for (int i = 1; i <= 14; ++i) {
    f.now += 0.5;
    p.Update(i * 500'000);
  }
  p.Finish();
  EXPECT_THAT(f.lines,
              ElementsAre("scanning a.bin: 2.00M of 10.0M tokens (20%), 1.00M tokens/s, ETA 8 s",
                          "scanning a.bin: 4.00M of 10.0M tokens (40%), 1.00M tokens/s, ETA 6 s",
                          "scanning a.bin: 6.00M of 10.0M tokens (60%), 1.00M tokens/s, ETA 4 s",
                          "scanning a.bin: 7.00M tokens done in 7 s"));
}

TEST(ProgressReporterTest, IntervalCountsFromTheLastLineNotFromTheGrid) {
  Fake f;
  ProgressReporter p = f.Make("x", 100, "B");
  f.now += 2.5;
  p.Update(10);  // a line (2.5 s in)
  f.now += 1.9;
  p.Update(20);  // 1.9 s after it: none
  f.now += 0.2;
  p.Update(30);  // 2.1 s after it: a line
  ASSERT_EQ(f.lines.size(), 2u);
  EXPECT_EQ(f.lines[1], "x: 30 of 100 B (30%), 6.52 B/s, ETA 11 s");
}

TEST(ProgressReporterTest, UnknownTotalAndNothingCounted) {
  Fake f;
  ProgressReporter counted = f.Make("reading", 0, "lines");
  ProgressReporter timed = f.Make("training", 0, "");
  f.now += 125;
  counted.Update(2500);
  timed.Update(0);
  timed.Finish();
  EXPECT_THAT(f.lines, ElementsAre("reading: 2.50k lines, 20 lines/s, 2 min 05 s so far",
                                   "training: 2 min 05 s so far", "training: done in 2 min 05 s"));
}

TEST(ProgressReporterTest, CountAndDuration) {
  EXPECT_EQ(ProgressReporter::Count(0), "0");
  EXPECT_EQ(ProgressReporter::Count(999), "999");
  EXPECT_EQ(ProgressReporter::Count(6.523), "6.52");
  EXPECT_EQ(ProgressReporter::Count(1500), "1.50k");
  EXPECT_EQ(ProgressReporter::Count(23'456'000), "23.5M");
  EXPECT_EQ(ProgressReporter::Count(999'600), "1.00M");
  EXPECT_EQ(ProgressReporter::Count(4.2e9), "4.20G");
  EXPECT_EQ(ProgressReporter::Duration(0.4), "0 s");
  EXPECT_EQ(ProgressReporter::Duration(59.4), "59 s");
  EXPECT_EQ(ProgressReporter::Duration(185), "3 min 05 s");
  EXPECT_EQ(ProgressReporter::Duration(7620), "2 h 07 min");
}

}  // namespace
}  // namespace gradsum
