#include "core/progress.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace gradsum {

namespace {

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void StderrLine(const std::string& line) {
  const std::string out = line + "\n";
  std::fwrite(out.data(), 1, out.size(), stderr);
  std::fflush(stderr);
}

}  // namespace

ProgressReporter::ProgressReporter(std::string label, int64_t total, std::string unit, Clock clock,
                                   Sink sink, double interval_s)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      clock_(clock ? std::move(clock) : Clock(SteadySeconds)),
      sink_(sink ? std::move(sink) : Sink(StderrLine)),
      interval_s_(interval_s) {
  start_ = last_ = clock_();
}

std::string ProgressReporter::Count(double n) {
  const char* suffix[] = {"", "k", "M", "G", "T", "P"};
  int i = 0;
  while (std::fabs(n) >= 999.5 && i < 5) {
    n /= 1000;
    ++i;
  }
  if (i == 0 && n == std::floor(n)) return absl::StrFormat("%.0f", n);  // a count
  return absl::StrFormat(n >= 99.95 ? "%.0f%s" : n >= 9.995 ? "%.1f%s" : "%.2f%s", n, suffix[i]);
}

std::string ProgressReporter::Duration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(seconds, 0.0)));
  if (s < 60) return absl::StrCat(s, " s");
  if (s < 3600) return absl::StrFormat("%d min %02d s", s / 60, s % 60);
  return absl::StrFormat("%d h %02d min", s / 3600, (s % 3600) / 60);
}

void ProgressReporter::Update(int64_t done) {
  done_ = done;
  const double now = clock_();
  if (now - start_ < interval_s_ || now - last_ < interval_s_) return;
  last_ = now;
  const double elapsed = now - start_;
  const double rate = elapsed > 0 ? done / elapsed : 0;
  std::string line = absl::StrCat(label_, ": ", Count(done));
  if (unit_.empty()) {
    line = absl::StrCat(label_, ": ", Duration(elapsed), " so far");
  } else if (total_ > 0) {
    absl::StrAppend(&line, " of ", Count(total_), " ", unit_,
                    absl::StrFormat(" (%.0f%%)", 100.0 * done / total_), ", ", Count(rate), " ",
                    unit_, "/s, ETA ",
                    rate > 0 ? Duration((total_ - done) / rate) : std::string("unknown"));
  } else {
    absl::StrAppend(&line, " ", unit_, ", ", Count(rate), " ", unit_, "/s, ", Duration(elapsed),
                    " so far");
  }
  sink_(line);
  ++lines_;
}

void ProgressReporter::Finish() {
  if (lines_ == 0) return;
  const std::string took = absl::StrCat("done in ", Duration(clock_() - start_));
  sink_(unit_.empty() ? absl::StrCat(label_, ": ", took)
                      : absl::StrCat(label_, ": ", Count(done_), " ", unit_, " ", took));
}

}  // namespace gradsum
