#ifndef GRADSUM_TRAIN_TFEVENTS_H_
#define GRADSUM_TRAIN_TFEVENTS_H_

// TensorBoard event files (--tensorboard_dir): the tfevents format TensorBoard reads, from
// rank 0. A file is a sequence of TFRecords, each
//   uint64 length (little-endian) | uint32 masked CRC-32C of those 8 bytes |
//   `length` bytes: a serialized Event (train/tfevents.proto) | uint32 masked CRC-32C of them
// (masked: ((crc >> 15) | (crc << 17)) + 0xa282ead8), the first record an Event with
// file_version "brain.Event:2". Each step is one Event whose Summary holds every scalar of
// its StepMetrics record (StepScalars), at the record's step.
//
//   GRADSUM_ASSIGN_OR_RETURN(TfEventsWriter tb, TfEventsWriter::Open(dir, /*append=*/false));
//   tb.AddStep(record, wall_time);            // buffered
//   GRADSUM_RETURN_IF_ERROR(tb.Flush());      // each log interval: one write(2)
//   GRADSUM_RETURN_IF_ERROR(tb.Close());
//
// Errors name --tensorboard_dir and the path: a directory that cannot be created or
// written, and a failed write (a full disk), are found at Open (which writes the first
// record, or probes the directory when appending), before training.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "train/metrics.pb.h"

namespace gradsum::train {

// CRC-32C (Castagnoli, reflected polynomial 0x82f63b78) of `data`, and TFRecord's mask of it.
uint32_t Crc32c(absl::string_view data);
uint32_t MaskedCrc32c(absl::string_view data);

// Every scalar of `record`: each set singular numeric field under its name ("ce", "mfu",
// ...), each element of a repeated one as "name/i" ("maxvio/0"); eval_ce and z_out only
// where set. In field order.
std::vector<std::pair<std::string, double>> StepScalars(const StepMetrics& record);

class TfEventsWriter {
 public:
  TfEventsWriter() = default;  // closed
  TfEventsWriter(TfEventsWriter&& other) noexcept;
  TfEventsWriter& operator=(TfEventsWriter&& other) noexcept;
  ~TfEventsWriter();

  // Creates `dir` (with its parents) and a new file events.out.tfevents.<seconds>.<host>
  // in it, whose first record (file_version) is written at once; with `append` (a
  // --resume), the newest tfevents file in `dir` is continued instead (a new one if there
  // is none). Errors name --tensorboard_dir.
  static absl::StatusOr<TfEventsWriter> Open(const std::string& dir, bool append);

  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  // Buffers the Event of `record` (StepScalars at record.step()), stamped `wall_time`.
  void AddStep(const StepMetrics& record, double wall_time);
  // Buffers one Event (tests, and AddStep).
  void AddScalars(int64_t step, double wall_time,
                  const std::vector<std::pair<std::string, double>>& scalars);
  // Writes the buffered records (one write(2) per call, retried on short writes).
  absl::Status Flush();
  // Flush, then close (OK if not open).
  absl::Status Close();

 private:
  void AddRecord(const std::string& data);
  int fd_ = -1;
  std::string path_;
  std::string buffer_;
};

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_TFEVENTS_H_
