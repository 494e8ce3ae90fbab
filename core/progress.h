#ifndef GRADSUM_CORE_PROGRESS_H_
#define GRADSUM_CORE_PROGRESS_H_

// A progress line for long preparation (a token file's scan at start-up, a tokenizer's
// training): work done of the total, its rate and an ETA, printed at most once per interval
// and only once the work has run for an interval, so short work prints nothing and the
// outputs of quick runs stay as they were.
//
//   ProgressReporter progress("scanning x.bin", num_tokens, "tokens");
//   for (...) progress.Update(done);   // cheap: reads the clock, prints when due
//   progress.Finish();                 // "... done in 12.3 s" if a line was printed
//
// The clock and the sink are injectable so that a test decides when time passes and reads
// the lines; by default the steady clock and one fwrite of the line to stderr (a line of its
// own even when ranks print at once).

#include <cstdint>
#include <functional>
#include <string>

namespace gradsum {

class ProgressReporter {
 public:
  using Clock = std::function<double()>;                 // seconds, never decreasing
  using Sink = std::function<void(const std::string&)>;  // one line, without '\n'

  // `total` <= 0: unknown (the line then says what is done and the time, no ETA); `unit`
  // empty: nothing is counted (the line says only how long the work has run; Update(0)).
  ProgressReporter(std::string label, int64_t total, std::string unit, Clock clock = nullptr,
                   Sink sink = nullptr, double interval_s = 2.0);

  // `done` units of `total` so far; prints a line when an interval has passed since the
  // start and since the last line.
  void Update(int64_t done);
  // After the work: says how long it took, if any line was printed.
  void Finish();
  int lines_printed() const { return lines_; }

  // "1.5k", "23.4M", "1.20G": three significant digits, for counts and rates.
  static std::string Count(double n);
  // "45 s", "3 min 05 s", "2 h 07 min".
  static std::string Duration(double seconds);

 private:
  std::string label_, unit_;
  int64_t total_;
  Clock clock_;
  Sink sink_;
  double interval_s_, start_, last_;
  int64_t done_ = 0;
  int lines_ = 0;
};

}  // namespace gradsum

#endif  // GRADSUM_CORE_PROGRESS_H_
