#include "train/tfevents.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "io/atomic_file.h"
#include "io/path_checks.h"
#include "train/tfevents.pb.h"

namespace gradsum::train {
namespace {

constexpr absl::string_view kFlag = "--tensorboard_dir";

// The byte-at-a-time table of the reflected CRC-32C polynomial.
std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    t[i] = c;
  }
  return t;
}

void AppendLittleEndian(uint64_t v, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

absl::Status Errno(absl::string_view what, const std::string& path, int err) {
  return ErrnoStatus(err, absl::StrCat(kFlag, "=", path, ": ", what));
}

// The newest (by name, which starts with the creation time) tfevents file in `dir`, or "".
std::string NewestEventsFile(const std::string& dir) {
  std::string newest;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (absl::StartsWith(name, "events.out.tfevents.") && name > newest) newest = name;
    }
    closedir(d);
  }
  return newest.empty() ? "" : absl::StrCat(dir, "/", newest);
}

}  // namespace

uint32_t Crc32c(absl::string_view data) {
  static const std::array<uint32_t, 256> table = MakeCrcTable();
  uint32_t crc = 0xffffffffu;
  for (unsigned char b : data) crc = table[(crc ^ b) & 0xff] ^ (crc >> 8);
  return crc ^ 0xffffffffu;
}

uint32_t MaskedCrc32c(absl::string_view data) {
  const uint32_t crc = Crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::vector<std::pair<std::string, double>> StepScalars(const StepMetrics& record) {
  namespace pb = google::protobuf;
  std::vector<std::pair<std::string, double>> out;
  const pb::Descriptor* d = record.GetDescriptor();
  const pb::Reflection* r = record.GetReflection();
  auto value = [&](const pb::FieldDescriptor* f, int i) -> double {
    switch (f->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT32:
        return i < 0 ? r->GetInt32(record, f) : r->GetRepeatedInt32(record, f, i);
      case pb::FieldDescriptor::CPPTYPE_INT64:
        return static_cast<double>(i < 0 ? r->GetInt64(record, f)
                                         : r->GetRepeatedInt64(record, f, i));
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
        return i < 0 ? r->GetDouble(record, f) : r->GetRepeatedDouble(record, f, i);
      default:
        return 0;
    }
  };
  for (int k = 0; k < d->field_count(); ++k) {
    const pb::FieldDescriptor* f = d->field(k);
    if (f->name() == "step") continue;  // the Event's step
    if (f->is_repeated()) {
      for (int i = 0; i < r->FieldSize(record, f); ++i) {
        out.emplace_back(absl::StrCat(f->name(), "/", i), value(f, i));
      }
    } else if (r->HasField(record, f)) {
      out.emplace_back(f->name(), value(f, -1));
    }
  }
  return out;
}

TfEventsWriter::TfEventsWriter(TfEventsWriter&& other) noexcept { *this = std::move(other); }

TfEventsWriter& TfEventsWriter::operator=(TfEventsWriter&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    buffer_ = std::move(other.buffer_);
    other.fd_ = -1;
  }
  return *this;
}

TfEventsWriter::~TfEventsWriter() {
  // A run that stops early (an error, a signal) keeps the steps it buffered, best effort.
  if (fd_ >= 0) {
    (void)Flush();
    ::close(fd_);
  }
}

absl::StatusOr<TfEventsWriter> TfEventsWriter::Open(const std::string& dir, bool append) {
  if (dir.empty()) return absl::InvalidArgumentError(absl::StrCat(kFlag, ": empty path"));
  GRADSUM_RETURN_IF_ERROR(PrepareOutputDir(kFlag, dir));
  TfEventsWriter w;
  w.path_ = append ? NewestEventsFile(dir) : "";
  const bool fresh = w.path_.empty();
  if (fresh) {
    char host[256] = "localhost";
    (void)gethostname(host, sizeof(host) - 1);
    w.path_ = absl::StrCat(dir, "/events.out.tfevents.", absl::ToUnixSeconds(absl::Now()), ".",
                           host, ".", getpid());
  }
  w.fd_ = ::open(w.path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK, 0644);
  if (w.fd_ < 0) return Errno("cannot open", w.path_, errno);
  struct stat st;
  if (fstat(w.fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(kFlag, "=", w.path_, ": not a regular file"));
  }
  if (fresh) {
    tb::Event first;
    first.set_wall_time(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
    first.set_file_version("brain.Event:2");
    w.AddRecord(first.SerializeAsString());
    GRADSUM_RETURN_IF_ERROR(w.Flush());
  }
  return w;
}

void TfEventsWriter::AddRecord(const std::string& data) {
  std::string header;
  AppendLittleEndian(data.size(), 8, &header);
  buffer_ += header;
  AppendLittleEndian(MaskedCrc32c(header), 4, &buffer_);
  buffer_ += data;
  AppendLittleEndian(MaskedCrc32c(data), 4, &buffer_);
}

void TfEventsWriter::AddScalars(int64_t step, double wall_time,
                                const std::vector<std::pair<std::string, double>>& scalars) {
  tb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  tb::Summary* summary = e.mutable_summary();
  for (const auto& [tag, v] : scalars) {
    tb::SummaryValue* value = summary->add_value();
    value->set_tag(tag);
    value->set_simple_value(static_cast<float>(v));
  }
  AddRecord(e.SerializeAsString());
}

void TfEventsWriter::AddStep(const StepMetrics& record, double wall_time) {
  AddScalars(record.step(), wall_time, StepScalars(record));
}

absl::Status TfEventsWriter::Flush() {
  if (fd_ < 0) {
    return buffer_.empty() ? absl::OkStatus()
                           : absl::FailedPreconditionError(absl::StrCat(kFlag, ": not open"));
  }
  size_t done = 0;
  while (done < buffer_.size()) {
    const ssize_t n = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Errno("write failed", path_, n < 0 ? errno : ENOSPC);
    done += static_cast<size_t>(n);
  }
  buffer_.clear();
  return absl::OkStatus();
}

absl::Status TfEventsWriter::Close() {
  if (fd_ < 0) return absl::OkStatus();
  absl::Status flushed = Flush();
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0 && flushed.ok()) return Errno("close failed", path_, errno);
  return flushed;
}

}  // namespace gradsum::train
