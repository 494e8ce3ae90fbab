#ifndef GRADSUM_TRAIN_METRICS_FILE_H_
#define GRADSUM_TRAIN_METRICS_FILE_H_

// The --metrics JSONL file, every write checked: each line goes out in one write(2) (no
// buffer that could fail later, unseen), and a failed open, write or close is an error
// naming the path and the cause (a full disk, no permission, a read-only file system).
// The path must be a regular file (created if missing) or /dev/null (the lines are
// discarded); a FIFO, socket, directory or any other device is refused before anything
// opens it, so the open cannot block (a FIFO without a reader would, forever).
//
//   GRADSUM_ASSIGN_OR_RETURN(MetricsFile f, MetricsFile::Open(path, /*append=*/false));
//   GRADSUM_ASSIGN_OR_RETURN(std::string line, record.ToJson());
//   GRADSUM_RETURN_IF_ERROR(f.WriteLine(line));
//   GRADSUM_RETURN_IF_ERROR(f.Close());

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsum::train {

class MetricsFile {
 public:
  MetricsFile() = default;  // closed; WriteLine is FailedPrecondition
  MetricsFile(MetricsFile&& other) noexcept;
  MetricsFile& operator=(MetricsFile&& other) noexcept;
  ~MetricsFile();

  // Creates or truncates `path` (appends when `append`). A directory, FIFO, socket or
  // device other than /dev/null is InvalidArgument naming the path and what it is (checked
  // by stat(2), and again on the descriptor of a non-blocking open).
  static absl::StatusOr<MetricsFile> Open(const std::string& path, bool append);
  bool is_open() const { return fd_ >= 0; }
  // Writes `line` and a newline.
  absl::Status WriteLine(absl::string_view line);
  // Closes the file (OK if it is not open).
  absl::Status Close();

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_METRICS_FILE_H_
