// The tfevents writer against an independent reader: a CRC-32C computed bit by bit from the
// Castagnoli polynomial's exponents (not the writer's table), and a protobuf wire-format
// decoder written here (no generated code), checking every record's framing and CRCs, the
// file_version record, and each step's tags and values; then a training run's file
// against its step records, and the errors of an unusable --tensorboard_dir.
#include "train/tfevents.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "train/config.pb.h"
#include "train/test_util.h"

namespace gradsum::train {
namespace {

// CRC-32C bit by bit: x^32 + x^28 + x^27 + x^26 + x^25 + x^23 + x^22 + x^20 + x^19 + x^18 +
// x^14 + x^13 + x^11 + x^10 + x^9 + x^8 + x^6 + 1, reflected (LSB first), initial and final
// value all ones.
uint32_t ReferenceCrc32c(const std::string& data) {
  uint32_t poly = 0;
  for (int e : {28, 27, 26, 25, 23, 22, 20, 19, 18, 14, 13, 11, 10, 9, 8, 6, 0}) {
    poly |= 1u << (31 - e);  // reflected: x^e at bit 31 - e
  }
  uint32_t crc = 0xffffffffu;
  for (unsigned char byte : data) {
    for (int bit = 0; bit < 8; ++bit) {
      const uint32_t in = ((byte >> bit) & 1u) ^ (crc & 1u);
      crc >>= 1;
      if (in) crc ^= poly;
    }
  }
  return ~crc;
}

uint32_t ReferenceMasked(const std::string& data) {
  const uint32_t c = ReferenceCrc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

uint64_t LittleEndian(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(s[at + i])} << (8 * i);
  return v;
}

// A decoded Event: the fields train/tfevents.proto's numbers give.
struct DecodedEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;
};

struct Reader {
  const std::string& s;
  size_t at;
  size_t end;
  uint64_t Varint() {
    uint64_t v = 0;
    for (int shift = 0; at < end; shift += 7) {
      const unsigned char b = s[at++];
      v |= uint64_t{b & 0x7fu} << shift;
      if (!(b & 0x80)) break;
    }
    return v;
  }
};

std::pair<std::string, float> DecodeValue(const std::string& s, size_t at, size_t end) {
  Reader r{s, at, end};
  std::pair<std::string, float> out;
  while (r.at < r.end) {
    const uint64_t key = r.Varint();
    if (key == (1 << 3 | 2)) {
      const size_t n = r.Varint();
      out.first = s.substr(r.at, n);
      r.at += n;
    } else if (key == (2 << 3 | 5)) {
      const uint32_t bits = static_cast<uint32_t>(LittleEndian(s, r.at, 4));
      std::memcpy(&out.second, &bits, 4);
      r.at += 4;
    } else {
      ADD_FAILURE() << "unexpected Summary.Value key " << key;
      return out;
    }
  }
  return out;
}

DecodedEvent DecodeEvent(const std::string& s) {
  Reader r{s, 0, s.size()};
  DecodedEvent e;
  while (r.at < r.end) {
    const uint64_t key = r.Varint();
    if (key == (1 << 3 | 1)) {
      const uint64_t bits = LittleEndian(s, r.at, 8);
      std::memcpy(&e.wall_time, &bits, 8);
      r.at += 8;
    } else if (key == (2 << 3 | 0)) {
      e.step = static_cast<int64_t>(r.Varint());
    } else if (key == (3 << 3 | 2)) {
      const size_t n = r.Varint();
      e.file_version = s.substr(r.at, n);
      r.at += n;
    } else if (key == (5 << 3 | 2)) {
      const size_t n = r.Varint();
      Reader summary{s, r.at, r.at + n};
      while (summary.at < summary.end) {
        EXPECT_EQ(summary.Varint(), 1u << 3 | 2) << "Summary.value";
        const size_t m = summary.Varint();
        e.values.push_back(DecodeValue(s, summary.at, summary.at + m));
        summary.at += m;
      }
      r.at += n;
    } else {
      ADD_FAILURE() << "unexpected Event key " << key;
      break;
    }
  }
  return e;
}

// Every record of a tfevents file, each framing CRC checked.
std::vector<DecodedEvent> ReadEvents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string s = ss.str();
  std::vector<DecodedEvent> events;
  size_t at = 0;
  while (at < s.size()) {
    EXPECT_LE(at + 12, s.size()) << "truncated header at " << at;
    if (at + 12 > s.size()) break;
    const uint64_t length = LittleEndian(s, at, 8);
    EXPECT_EQ(LittleEndian(s, at + 8, 4), ReferenceMasked(s.substr(at, 8)))
        << "length CRC at " << at;
    EXPECT_LE(at + 12 + length + 4, s.size()) << "truncated record at " << at;
    if (at + 12 + length + 4 > s.size()) break;
    const std::string data = s.substr(at + 12, length);
    EXPECT_EQ(LittleEndian(s, at + 12 + length, 4), ReferenceMasked(data)) << "data CRC at " << at;
    events.push_back(DecodeEvent(data));
    at += 12 + length + 4;
  }
  return events;
}

std::string TmpDir(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/", name, "_", getpid());
}

TEST(TfEventsTest, Crc32cMatchesTheBitwiseReferenceAndTheKnownCheckValue) {
  EXPECT_EQ(ReferenceCrc32c("123456789"), 0xe3069283u);  // CRC-32C's check value
  EXPECT_EQ(Crc32c("123456789"), 0xe3069283u);
  std::string data;
  for (int n = 0; n < 300; ++n) {
    EXPECT_EQ(Crc32c(data), ReferenceCrc32c(data)) << n;
    EXPECT_EQ(MaskedCrc32c(data), ReferenceMasked(data)) << n;
    data.push_back(static_cast<char>((n * 131 + 7) & 0xff));
  }
}

TEST(TfEventsTest, WritesFramedEventsThatAnIndependentReaderDecodes) {
  const std::string dir = TmpDir("tb_fresh") + "/sub";  // parents created
  absl::StatusOr<TfEventsWriter> w = TfEventsWriter::Open(dir, /*append=*/false);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(absl::StrContains(w->path(), "/events.out.tfevents.")) << w->path();
  w->AddScalars(1, 100.5, {{"ce", 2.5}, {"maxvio/0", 0.125}});
  w->AddScalars(2, 101.5, {{"ce", 1.75}, {"lr", 1e-3}});
  ASSERT_TRUE(w->Flush().ok());
  w->AddScalars(3, 102.5, {});
  ASSERT_TRUE(w->Close().ok());
  const std::vector<DecodedEvent> events = ReadEvents(w->path());
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_GT(events[0].wall_time, 1.6e9);
  EXPECT_EQ(events[1].step, 1);
  EXPECT_EQ(events[1].wall_time, 100.5);
  ASSERT_EQ(events[1].values.size(), 2u);
  EXPECT_EQ(events[1].values[0].first, "ce");
  EXPECT_EQ(events[1].values[0].second, 2.5f);
  EXPECT_EQ(events[1].values[1].first, "maxvio/0");
  EXPECT_EQ(events[1].values[1].second, 0.125f);
  EXPECT_EQ(events[2].step, 2);
  EXPECT_EQ(events[2].values[1].second, 1e-3f);
  EXPECT_EQ(events[3].step, 3);
  EXPECT_TRUE(events[3].values.empty());

  // A resume appends to the newest file: no second file_version.
  absl::StatusOr<TfEventsWriter> again = TfEventsWriter::Open(dir, /*append=*/true);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->path(), w->path());
  again->AddScalars(4, 103.5, {{"ce", 1.5}});
  ASSERT_TRUE(again->Close().ok());
  const std::vector<DecodedEvent> appended = ReadEvents(w->path());
  ASSERT_EQ(appended.size(), 5u);
  EXPECT_EQ(appended[4].step, 4);
  EXPECT_EQ(appended[4].values[0].second, 1.5f);
}

TEST(TfEventsTest, UnusableDirectoryIsAnErrorNamingTheFlag) {
  const std::string file = TmpDir("tb_file");
  std::ofstream(file) << "x";
  for (const std::string& dir : {file, file + "/below", std::string("/proc/version/x")}) {
    absl::StatusOr<TfEventsWriter> w = TfEventsWriter::Open(dir, /*append=*/false);
    ASSERT_FALSE(w.ok()) << dir;
    EXPECT_TRUE(absl::StrContains(w.status().message(), "--tensorboard_dir")) << w.status();
    EXPECT_TRUE(absl::StrContains(w.status().message(), dir.substr(0, file.size()))) << w.status();
  }
  EXPECT_FALSE(TfEventsWriter::Open("", false).ok());
}

TEST(TfEventsTest, StepScalarsAreEveryNumberOfTheRecord) {
  StepMetrics r;
  r.set_step(3);
  r.set_ce(1.5);
  r.set_valid_tokens(12);
  r.add_maxvio(0.25);
  r.add_maxvio(0.5);
  const auto scalars = StepScalars(r);
  ASSERT_EQ(scalars.size(), 4u);
  EXPECT_EQ(scalars[0], (std::pair<std::string, double>("ce", 1.5)));
  EXPECT_EQ(scalars[1], (std::pair<std::string, double>("valid_tokens", 12)));
  EXPECT_EQ(scalars[2], (std::pair<std::string, double>("maxvio/0", 0.25)));
  EXPECT_EQ(scalars[3], (std::pair<std::string, double>("maxvio/1", 0.5)));
}

// A training run's file: one Event per step at its step, holding every number of the step's
// record (as float), and the eval CE on the evaluated steps.
TEST(TfEventsTest, TrainingRunWritesEveryStepsRecord) {
  TrainConfig config = TinyConfig(2, 2, 2, TrainConfig::fsdp);
  config.mutable_optim()->set_steps(4);
  config.mutable_log()->set_eval_every(2);
  const std::string dir = TmpDir("tb_run");
  config.mutable_log()->set_tensorboard_dir(dir);
  absl::StatusOr<std::vector<RankOutcome>> ranks = RunInProcess(config);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  ASSERT_TRUE((*ranks)[0].status.ok()) << (*ranks)[0].status;
  const std::vector<StepMetrics>& history = (*ranks)[0].history;
  ASSERT_EQ(history.size(), 4u);
  std::string file;
  DIR* d = opendir(dir.c_str());
  ASSERT_NE(d, nullptr);
  int files = 0;
  while (dirent* e = readdir(d)) {
    if (absl::StrContains(e->d_name, "tfevents")) {
      file = absl::StrCat(dir, "/", e->d_name);
      ++files;
    }
  }
  closedir(d);
  ASSERT_EQ(files, 1);
  const std::vector<DecodedEvent> events = ReadEvents(file);
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  for (int s = 0; s < 4; ++s) {
    const DecodedEvent& e = events[s + 1];
    const StepMetrics& r = history[s];
    EXPECT_EQ(e.step, r.step());
    std::map<std::string, float> got(e.values.begin(), e.values.end());
    EXPECT_EQ(got.size(), e.values.size()) << "a tag written twice";
    EXPECT_EQ(got.at("ce"), static_cast<float>(r.ce()));
    EXPECT_EQ(got.at("grad_norm"), static_cast<float>(r.grad_norm()));
    EXPECT_EQ(got.at("lr"), static_cast<float>(r.lr()));
    EXPECT_EQ(got.at("mfu"), static_cast<float>(r.mfu()));
    EXPECT_EQ(got.at("consumed_tokens"), static_cast<float>(r.consumed_tokens()));
    EXPECT_EQ(got.at("maxvio/1"), static_cast<float>(r.maxvio(1)));
    EXPECT_EQ(got.count("eval_ce"), r.has_eval_ce() ? 1u : 0u);
    if (r.has_eval_ce()) {
      EXPECT_EQ(got.at("eval_ce"), static_cast<float>(r.eval_ce()));
    }
    // Every scalar of the record, no more.
    EXPECT_EQ(e.values.size(), StepScalars(r).size());
    for (const auto& [tag, v] : StepScalars(r))
      EXPECT_EQ(got.at(tag), static_cast<float>(v)) << tag;
  }
}

// The one tfevents file of `dir` (a failure when there is not exactly one).
std::string OnlyEventsFile(const std::string& dir) {
  std::string file;
  int files = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (absl::StrContains(e->d_name, "tfevents")) {
        file = absl::StrCat(dir, "/", e->d_name);
        ++files;
      }
    }
    closedir(d);
  }
  EXPECT_EQ(files, 1) << dir;
  return file;
}

// A --resume appends to the run's file: one file_version, then every step once up to the
// checkpoint and the resumed steps after it.
TEST(TfEventsTest, ResumeAppendsToTheRunsFile) {
  const std::string dir = TmpDir("tb_resume");
  TrainConfig first = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  first.mutable_optim()->set_steps(2);
  first.mutable_checkpoint()->set_dir(dir + "/ckpt");
  first.mutable_log()->set_tensorboard_dir(dir + "/tb");
  auto a = RunInProcess(first);
  ASSERT_TRUE(a.ok() && (*a)[0].status.ok()) << (a.ok() ? (*a)[0].status : a.status());
  TrainConfig second = first;
  second.mutable_optim()->set_steps(4);
  second.mutable_checkpoint()->set_resume(true);
  auto b = RunInProcess(second);
  ASSERT_TRUE(b.ok() && (*b)[0].status.ok()) << (b.ok() ? (*b)[0].status : b.status());
  const std::vector<DecodedEvent> events = ReadEvents(OnlyEventsFile(dir + "/tb"));
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  for (int s = 1; s <= 4; ++s) EXPECT_EQ(events[s].step, s);
  const StepMetrics& resumed = (*b)[0].history[1];  // step 4
  std::map<std::string, float> got(events[4].values.begin(), events[4].values.end());
  EXPECT_EQ(got.at("ce"), static_cast<float>(resumed.ce()));
  EXPECT_EQ(got.at("consumed_sequences"), static_cast<float>(resumed.consumed_sequences()));
}

// An unusable --tensorboard_dir stops the run before step 1, on every rank, naming it.
TEST(TfEventsTest, UnusableDirectoryFailsBeforeTraining) {
  const std::string file = TmpDir("tb_not_a_dir");
  std::ofstream(file) << "x";
  TrainConfig config = TinyConfig(2, 2, 1, TrainConfig::fsdp);
  config.mutable_log()->set_tensorboard_dir(file + "/tb");
  auto ranks = RunInProcess(config);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  for (const RankOutcome& r : *ranks) {
    EXPECT_FALSE(r.status.ok());
    EXPECT_TRUE(absl::StrContains(r.status.message(), "--tensorboard_dir")) << r.status;
    EXPECT_TRUE(r.history.empty());
  }
}

}  // namespace
}  // namespace gradsum::train
