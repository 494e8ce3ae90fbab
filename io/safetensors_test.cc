#include "io/safetensors.h"

#include <dirent.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/half.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "io/atomic_file.h"

namespace gradsum {
namespace {

std::string TestDir(absl::string_view name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/", name);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
      out.push_back(e->d_name);
    }
  }
  ::closedir(d);
  return out;
}

// A file built by hand from a header text and raw data bytes (independent of the writer).
std::string RawFile(const std::string& header, const std::string& data) {
  std::string out;
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + header + data;
}

TensorView View(void* p, DType t, std::initializer_list<int64_t> shape) {
  return *TensorView::Create(p, t, shape);
}

TEST(SafetensorsTest, WriterProducesTheStandardLayout) {
  float w[2] = {1.0f, -2.0f};
  int64_t step[1] = {7};
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("w", View(w, DType::kF32, {2})).ok());
  ASSERT_TRUE(writer.Add("step", View(step, DType::kI64, {})).ok());
  ASSERT_TRUE(writer.AddMetadata("format", "pt").ok());
  const std::string bytes = writer.Serialize();
  // Sorted by name: "step" first at [0, 8), then "w" at [8, 16). Header padded to 8.
  std::string header =
      R"({"__metadata__":{"format":"pt"},"step":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
      R"("w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string data(16, '\0');
  std::memcpy(&data[0], step, 8);
  std::memcpy(&data[8], w, 8);
  EXPECT_EQ(bytes, RawFile(header, data));
}

TEST(SafetensorsTest, RoundTripsEveryDType) {
  std::vector<float> f32 = {1.5f, -0.0f, 3e38f, 1e-40f, 7.0f, 8.0f};
  std::vector<double> f64 = {1.0 / 3.0, -1e300};
  std::vector<BF16> bf16 = {BF16::FromFloat(1.0f), BF16::FromFloat(-3.5f), BF16::FromFloat(1e-3f)};
  std::vector<F16> f16 = {F16::FromFloat(0.5f), F16::FromFloat(65504.0f)};
  std::vector<int32_t> i32 = {-1, 2147483647, 0, 5};
  std::vector<int64_t> i64 = {INT64_MIN, 42};
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("a.f32", View(f32.data(), DType::kF32, {2, 3})).ok());
  ASSERT_TRUE(writer.Add("b.f64", View(f64.data(), DType::kF64, {2})).ok());
  ASSERT_TRUE(writer.Add("c.bf16", View(bf16.data(), DType::kBF16, {3, 1})).ok());
  ASSERT_TRUE(writer.Add("d.f16", View(f16.data(), DType::kF16, {2})).ok());
  ASSERT_TRUE(writer.Add("e.i32", View(i32.data(), DType::kI32, {2, 2})).ok());
  ASSERT_TRUE(writer.Add("f.i64", View(i64.data(), DType::kI64, {2})).ok());
  ASSERT_TRUE(writer.Add("g.empty", View(nullptr, DType::kF32, {0, 4})).ok());
  const std::string path = TestDir("roundtrip") + "/t.safetensors";
  ASSERT_TRUE(writer.WriteFile(path).ok());

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->names(), (std::vector<std::string>{"a.f32", "b.f64", "c.bf16", "d.f16", "e.i32",
                                                     "f.i64", "g.empty"}));
  auto check = [&](const char* name, DType dt, std::vector<int64_t> shape, const void* want,
                   size_t bytes) {
    absl::StatusOr<TensorView> t = file->Get(name);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->dtype(), dt) << name;
    EXPECT_EQ(t->shape(), shape) << name;
    ASSERT_EQ(t->nbytes(), bytes) << name;
    if (bytes > 0) {
      EXPECT_EQ(std::memcmp(t->raw(), want, bytes), 0) << name;
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t->raw()) % DTypeSize(dt), 0u) << name;
    }
  };
  check("a.f32", DType::kF32, {2, 3}, f32.data(), 24);
  check("b.f64", DType::kF64, {2}, f64.data(), 16);
  check("c.bf16", DType::kBF16, {3, 1}, bf16.data(), 6);
  check("d.f16", DType::kF16, {2}, f16.data(), 4);
  check("e.i32", DType::kI32, {2, 2}, i32.data(), 16);
  check("f.i64", DType::kI64, {2}, i64.data(), 16);
  check("g.empty", DType::kF32, {0, 4}, nullptr, 0);
  absl::StatusOr<TensorView> missing = file->Get("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
}

TEST(SafetensorsTest, EscapedNamesAndMetadataRoundTrip) {
  float x = 1.0f;
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("we\"ird\\name\n", View(&x, DType::kF32, {1})).ok());
  ASSERT_TRUE(writer.AddMetadata("k\"", "v\tw").ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Parse(writer.Serialize());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->Contains("we\"ird\\name\n"));
  EXPECT_EQ(file->metadata().at("k\""), "v\tw");
}

TEST(SafetensorsTest, CallerErrorsAreInvalidArgument) {
  float x = 1.0f;
  SafetensorsWriter writer;
  EXPECT_EQ(writer.Add("", View(&x, DType::kF32, {1})).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("__metadata__", View(&x, DType::kF32, {1})).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(writer.Add("x", View(&x, DType::kF32, {1})).ok());
  absl::Status dup = writer.Add("x", View(&x, DType::kF32, {1}));
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dup.message().find("\"x\""), std::string::npos);
  absl::StatusOr<TensorView> gpu = TensorView::Create(&x, DType::kF32, {1}, {Device::kCuda, 0});
  EXPECT_EQ(writer.Add("g", *gpu).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(writer.AddMetadata("m", "1").ok());
  EXPECT_EQ(writer.AddMetadata("m", "2").code(), absl::StatusCode::kInvalidArgument);
  // The header is JSON, so names and metadata must be UTF-8 ("\xff" never is).
  absl::Status bad = writer.Add("w\xff", View(&x, DType::kF32, {1}));
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("tensor name is not UTF-8"), std::string::npos) << bad;
  EXPECT_EQ(writer.AddMetadata("k\xff", "v").code(), absl::StatusCode::kInvalidArgument);
  bad = writer.AddMetadata("k", "v\xc3");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("metadata value of \"k\" is not UTF-8"), std::string::npos) << bad;
  ASSERT_TRUE(writer.Add("caf\xc3\xa9", View(&x, DType::kF32, {1})).ok());  // UTF-8 is fine
}

TEST(SafetensorsTest, AtomicWriteReplacesAndLeavesNoTemporaryFiles) {
  const std::string dir = TestDir("atomic");
  const std::string path = dir + "/x.safetensors";
  float a[3] = {1, 2, 3}, b[1] = {9};
  SafetensorsWriter w1, w2;
  ASSERT_TRUE(w1.Add("a", View(a, DType::kF32, {3})).ok());
  ASSERT_TRUE(w2.Add("b", View(b, DType::kF32, {1})).ok());
  ASSERT_TRUE(w1.WriteFile(path).ok());
  ASSERT_TRUE(w2.WriteFile(path).ok());
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"x.safetensors"});
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->names(), std::vector<std::string>{"b"});

  absl::Status no_dir = w1.WriteFile(dir + "/missing/sub/x.safetensors");
  EXPECT_EQ(no_dir.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(no_dir.message().find("missing/sub"), std::string::npos) << no_dir;
  absl::StatusOr<SafetensorsFile> absent = SafetensorsFile::Read(dir + "/absent.safetensors");
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(absent.status().message().find("absent.safetensors"), std::string::npos);
}

void ExpectDataLoss(const std::string& bytes, absl::string_view needle) {
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(bytes, "case.safetensors");
  ASSERT_FALSE(f.ok()) << "accepted, expected: " << needle;
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << f.status();
  EXPECT_NE(f.status().message().find("case.safetensors"), std::string::npos) << f.status();
  EXPECT_NE(f.status().message().find(needle), std::string::npos) << f.status();
}

TEST(SafetensorsTest, EveryTruncationIsDataLoss) {
  float w[4] = {1, 2, 3, 4};
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("w", View(w, DType::kF32, {4})).ok());
  const std::string full = writer.Serialize();
  for (size_t n = 0; n < full.size(); ++n) {
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(full.substr(0, n), "t");
    ASSERT_FALSE(f.ok()) << "prefix of " << n << " bytes accepted";
    EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << n;
  }
  // Truncating the real file on disk gives the same answer through Read().
  const std::string path = TestDir("trunc") + "/w.safetensors";
  ASSERT_TRUE(WriteFileAtomically(path, full.substr(0, full.size() - 3)).ok());
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Read(path);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(f.status().message().find(path), std::string::npos);
}

TEST(SafetensorsTest, CorruptHeadersAreDataLoss) {
  const std::string d8(8, '\0');
  ExpectDataLoss("abc", "truncated");
  {
    std::string huge = RawFile("{}", "");
    huge[5] = 1;  // header length ~2^40
    ExpectDataLoss(huge, "exceeds");
  }
  ExpectDataLoss(RawFile("{\"a\":", ""), "bad header");
  ExpectDataLoss(RawFile("[1,2]", ""), "not a JSON object");
  ExpectDataLoss(RawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":1})", d8),
                 "duplicate key");
  ExpectDataLoss(RawFile(R"({"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", d8),
                 "unknown dtype \"Q7\"");
  ExpectDataLoss(RawFile(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", d8), "dtype");
  ExpectDataLoss(RawFile(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", d8), "shape");
  ExpectDataLoss(RawFile(R"({"w":{"dtype":"F32","shape":[2]}})", d8), "data_offsets");
  ExpectDataLoss(RawFile(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", d8),
                 "non-negative");
  ExpectDataLoss(RawFile(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", d8),
                 "non-negative");
  ExpectDataLoss(RawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", d8),
                 "invalid data_offsets");
  ExpectDataLoss(RawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", d8),
                 "run past the data buffer");
  ExpectDataLoss(RawFile(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8),
                 "needs 12");
  ExpectDataLoss(
      RawFile(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", d8),
      "w");
  ExpectDataLoss(RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                         d8),
                 "overlap");
  ExpectDataLoss(RawFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8),
                 "belong to no tensor");
  ExpectDataLoss(RawFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", d8),
                 "cover 4");
  ExpectDataLoss(RawFile(R"({"__metadata__":[1]})", ""), "__metadata__");
  ExpectDataLoss(RawFile(R"({"__metadata__":{"k":1}})", ""), "not a string");
  ExpectDataLoss(RawFile(R"({"w":5})", ""), "not an object");
  ExpectDataLoss(RawFile("{\"w\":" + std::string(100000, '[') + std::string(100000, ']') + "}", ""),
                 "nesting deeper than");
  ExpectDataLoss(
      RawFile(R"({"w":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})", d8),
      "duplicate key \"dtype\"");
  ExpectDataLoss(RawFile("{\"\xff\":1}", ""), "bad header");  // not UTF-8

  absl::StatusOr<SafetensorsFile> u8 = SafetensorsFile::Parse(
      RawFile(R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})", d8));
  EXPECT_EQ(u8.status().code(), absl::StatusCode::kUnimplemented);
}

TEST(SafetensorsTest, AcceptsHeaderPaddingAndEmptyFile) {
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(RawFile("{}      ", ""));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->num_tensors(), 0);
}

TEST(SafetensorsTest, RandomCorruptionNeverCrashes) {
  std::vector<float> w(16, 1.0f);
  std::vector<int64_t> n(3, 5);
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("weight", View(w.data(), DType::kF32, {4, 4})).ok());
  ASSERT_TRUE(writer.Add("n", View(n.data(), DType::kI64, {3})).ok());
  const std::string full = writer.Serialize();
  uint64_t state = 99;
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string s = full;
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    // Mostly hit the 8-byte length and the JSON header, where structure lives.
    const size_t limit = (state >> 60) < 12 ? 8 + 160 : s.size();
    s[(state >> 20) % std::min(limit, s.size())] = static_cast<char>(state >> 56);
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(s, "fuzz");
    if (f.ok()) {
      ++accepted;  // e.g. a flipped data byte or a harmless header byte
    } else {
      EXPECT_TRUE(f.status().code() == absl::StatusCode::kDataLoss ||
                  f.status().code() == absl::StatusCode::kUnimplemented)
          << f.status();
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, 20000);
}

// The header-only reader: the ranges of a hand-built file, reads of parts of one tensor,
// and the same validation as a whole-file read.
TEST(SafetensorsHeaderTest, ReadsRangesOfOneTensorWithoutTheRest) {
  const std::string dir = TestDir("header");
  float a[3] = {1.5f, -2.0f, 4.0f};
  float b[2] = {7.0f, 8.0f};
  std::string data(reinterpret_cast<const char*>(a), 12);
  data.append(reinterpret_cast<const char*>(b), 8);
  const std::string header =
      R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
      R"("b":{"dtype":"F32","shape":[1,2],"data_offsets":[12,20]}})";
  ASSERT_TRUE(WriteFileAtomically(dir + "/f.safetensors", RawFile(header, data)).ok());
  absl::StatusOr<SafetensorsHeader> h = SafetensorsHeader::Read(dir + "/f.safetensors");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(h->metadata().at("k"), "v");
  EXPECT_EQ((*h->Find("b"))->shape, (std::vector<int64_t>{1, 2}));
  float got[2] = {0, 0};
  ASSERT_TRUE(h->ReadTensorBytes("a", 4, 8, got).ok());
  EXPECT_EQ(got[0], -2.0f);
  EXPECT_EQ(got[1], 4.0f);
  ASSERT_TRUE(h->ReadTensorBytes("b", 4, 4, got).ok());
  EXPECT_EQ(got[0], 8.0f);
  EXPECT_EQ(h->ReadTensorBytes("b", 4, 8, got).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(h->ReadTensorBytes("c", 0, 4, got).code(), absl::StatusCode::kNotFound);
  // A truncated file fails as the whole-file reader fails.
  ASSERT_TRUE(
      WriteFileAtomically(dir + "/t.safetensors", RawFile(header, data.substr(0, 16))).ok());
  absl::StatusOr<SafetensorsHeader> t = SafetensorsHeader::Read(dir + "/t.safetensors");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(SafetensorsFile::Read(dir + "/t.safetensors").status().message(), t.status().message());
  EXPECT_EQ(SafetensorsHeader::Read(dir + "/none").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace gradsum
