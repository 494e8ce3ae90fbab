#include "data/token_files.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::data {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Little-endian bytes of `v`'s low `n` bytes.
void Put(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A Megatron indexed dataset written as indexed_dataset.py does: each document a list of
// sequences, the sequences back to back in the .bin, pointers in bytes.
struct Megatron {
  std::string idx, bin;
};
Megatron MakeMegatron(const std::vector<std::vector<std::vector<int64_t>>>& docs, int code = 8,
                      int itemsize = 2) {
  Megatron m;
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers, doc_index = {0};
  for (const auto& doc : docs) {
    for (const auto& seq : doc) {
      lengths.push_back(static_cast<int32_t>(seq.size()));
      pointers.push_back(static_cast<int64_t>(m.bin.size()));
      for (int64_t t : seq) Put(m.bin, static_cast<uint64_t>(t), itemsize);
    }
    doc_index.push_back(static_cast<int64_t>(lengths.size()));
  }
  m.idx.append("MMIDIDX\0\0", 9);
  Put(m.idx, 1, 8);
  Put(m.idx, code, 1);
  Put(m.idx, lengths.size(), 8);
  Put(m.idx, doc_index.size(), 8);
  for (int32_t l : lengths) Put(m.idx, static_cast<uint32_t>(l), 4);
  for (int64_t p : pointers) Put(m.idx, static_cast<uint64_t>(p), 8);
  for (int64_t d : doc_index) Put(m.idx, static_cast<uint64_t>(d), 8);
  return m;
}

std::string WriteMegatron(const Megatron& m, const std::string& name) {
  const std::string prefix = ::testing::TempDir() + "/" + name;
  WriteFile(prefix + ".idx", m.idx);
  WriteFile(prefix + ".bin", m.bin);
  return prefix;
}

// The sample dataset: 4 documents, one of two sequences, one empty.
Megatron Sample() { return MakeMegatron({{{1, 2, 3}, {4}}, {{5, 6}}, {}, {{7, 8, 9, 10, 11}}}); }

// Byte offsets of the sample's .idx: 34-byte header, then S = 4 lengths, 4 pointers, D = 5
// document indices.
constexpr int kLengthsAt = 34, kPointersAt = 34 + 16, kDocsAt = 34 + 16 + 32;

TokenFileOptions Options(int64_t max_len = 4, int64_t vocab = 0, int64_t eod = -1) {
  TokenFileOptions o;
  o.max_len = max_len;
  o.vocab = vocab;
  o.eod_token = eod;
  return o;
}

std::vector<std::vector<int32_t>> AllDocuments(const DocumentSource& c) {
  std::vector<std::vector<int32_t>> docs;
  for (int64_t i = 0; i < c.num_documents(); ++i) {
    docs.push_back(c.Document(i));
    EXPECT_EQ(c.DocumentLength(i), static_cast<int64_t>(docs.back().size()));
  }
  return docs;
}

using Docs = std::vector<std::vector<int32_t>>;

TEST(MegatronTest, DocumentsAreTheIndexsSequencesAndLongOnesAreCut) {
  const std::string prefix = WriteMegatron(Sample(), "sample");
  for (const std::string& path : {prefix, prefix + ".bin", prefix + ".idx"}) {
    auto corpus = TokenFileCorpus::Open(path, Options(4, 12));
    ASSERT_TRUE(corpus.ok()) << corpus.status();
    EXPECT_EQ((*corpus)->format(), TokenFileFormat::kMegatron);
    EXPECT_EQ((*corpus)->dtype(), TokenDType::kUint16);
    // The empty document is skipped; the 5-token one is cut at max_len = 4.
    EXPECT_EQ(AllDocuments(**corpus), (Docs{{1, 2, 3, 4}, {5, 6}, {7, 8, 9, 10}, {11}}));
    EXPECT_EQ((*corpus)->MinDocumentLength(), 1);
    EXPECT_EQ((*corpus)->MaxDocumentLength(), 4);
    EXPECT_EQ((*corpus)->MaxToken(), 11);
    EXPECT_EQ((*corpus)->num_tokens(), 11);
    EXPECT_THAT((*corpus)->Describe(), HasSubstr("Megatron"));
    EXPECT_NE((*corpus)->ContentFingerprint(), 0u);
  }
  EXPECT_TRUE(IsTokenFilePath(prefix));
}

TEST(MegatronTest, EveryIntegerDType) {
  const std::vector<std::pair<int, int>> codes = {{1, 1}, {2, 1}, {3, 2}, {4, 4}, {5, 8}, {8, 2}};
  for (const auto& [code, size] : codes) {
    const std::string prefix = WriteMegatron(MakeMegatron({{{0, 100, 127}}, {{3}}}, code, size),
                                             "dtype" + std::to_string(code));
    auto corpus = TokenFileCorpus::OpenMegatron(prefix, Options(8));
    ASSERT_TRUE(corpus.ok()) << code << ": " << corpus.status();
    EXPECT_EQ(AllDocuments(**corpus), (Docs{{0, 100, 127}, {3}})) << code;
  }
}

TEST(MegatronTest, WithoutTheScanMaxTokenIsTheDTypesBound) {
  const std::string prefix = WriteMegatron(Sample(), "noscan");
  TokenFileOptions o = Options(4, 5);  // tokens up to 11 pass unseen
  o.scan_tokens = false;
  auto corpus = TokenFileCorpus::Open(prefix, o);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ((*corpus)->MaxToken(), 65535);
}

// Opens the sample with `mutate` applied to its files; expects InvalidArgument whose message
// has every one of `parts`.
void ExpectCorrupt(const std::string& name, void (*mutate)(Megatron&),
                   const std::vector<std::string>& parts, int64_t vocab = 0) {
  Megatron m = Sample();
  mutate(m);
  const std::string prefix = WriteMegatron(m, name);
  auto corpus = TokenFileCorpus::Open(prefix, Options(4, vocab));
  ASSERT_FALSE(corpus.ok()) << name;
  EXPECT_EQ(corpus.status().code(), absl::StatusCode::kInvalidArgument) << corpus.status();
  for (const std::string& part : parts) {
    EXPECT_THAT(corpus.status().message(), HasSubstr(part)) << name;
  }
}

TEST(MegatronCorruptTest, BadMagic) {
  ExpectCorrupt("magic", [](Megatron& m) { m.idx[0] = 'X'; },
                {"magic.idx: magic at byte offset 0"});
}

TEST(MegatronCorruptTest, WrongVersion) {
  ExpectCorrupt("version", [](Megatron& m) { m.idx[9] = 2; },
                {"version.idx: version at byte offset 9", "2, expected 1"});
}

TEST(MegatronCorruptTest, FloatDType) {
  ExpectCorrupt("float", [](Megatron& m) { m.idx[17] = 7; },
                {"dtype code at byte offset 17", "float"});
  ExpectCorrupt("code9", [](Megatron& m) { m.idx[17] = 9; }, {"dtype code at byte offset 17", "9"});
}

TEST(MegatronCorruptTest, TruncatedIdx) {
  ExpectCorrupt("short_header", [](Megatron& m) { m.idx.resize(20); },
                {"short_header.idx: header at byte offset 20", "truncated"});
  // Cut inside the document indices: the counts ask for more than the file holds.
  ExpectCorrupt("short_docs", [](Megatron& m) { m.idx.resize(m.idx.size() - 3); },
                {"short_docs.idx: document count at byte offset 26", "truncated"});
  ExpectCorrupt("short_lengths", [](Megatron& m) { m.idx.resize(kLengthsAt + 6); },
                {"short_lengths.idx: sequence count at byte offset 18"});
  ExpectCorrupt(
      "trailing", [](Megatron& m) { m.idx.append(4, '\0'); },
      {"trailing.idx: end of the document indices at byte offset 122", "4 trailing bytes"});
}

TEST(MegatronCorruptTest, PointerPastTheEndOfTheBin) {
  // Sequence 3 (tokens 7..11) moved 2 bytes on: its last token would be past the end.
  ExpectCorrupt(
      "pointer", [](Megatron& m) { m.idx[kPointersAt + 3 * 8] += 2; },
      {"pointer.idx: pointer of sequence 3 at byte offset 74", "inside", "pointer.bin (22 bytes)"});
  // A truncated .bin: the same field.
  ExpectCorrupt("short_bin", [](Megatron& m) { m.bin.resize(m.bin.size() - 1); },
                {"short_bin.idx: pointer of sequence 3 at byte offset 74"});
  // A pointer not on a token: odd for uint16.
  ExpectCorrupt("odd_pointer", [](Megatron& m) { m.idx[kPointersAt + 2 * 8] += 1; },
                {"pointer of sequence 2 at byte offset 66"});
}

TEST(MegatronCorruptTest, NegativeLength) {
  ExpectCorrupt("negative", [](Megatron& m) { std::memset(&m.idx[kLengthsAt + 4], 0xff, 4); },
                {"length of sequence 1 at byte offset 38", "-1 is negative"});
}

TEST(MegatronCorruptTest, NonMonotoneDocumentIndices) {
  // Indices 0 2 3 3 4 -> 0 3 2 3 4.
  ExpectCorrupt("monotone",
                [](Megatron& m) {
                  m.idx[kDocsAt + 8] = 3;
                  m.idx[kDocsAt + 16] = 2;
                },
                {"monotone.idx: document index 2 at byte offset 98", "must not decrease"});
  ExpectCorrupt("first", [](Megatron& m) { m.idx[kDocsAt] = 1; },
                {"document index 0 at byte offset 82", "expected 0"});
  ExpectCorrupt("last", [](Megatron& m) { m.idx[kDocsAt + 32] = 3; },
                {"document index 4 at byte offset 114", "expected the sequence count 4"});
}

TEST(MegatronCorruptTest, SequencesOfADocumentNotBackToBack) {
  // Document 0's second sequence pointed at the first's start.
  ExpectCorrupt("gap", [](Megatron& m) { m.idx[kPointersAt + 8] = 0; },
                {"gap.idx: pointer of sequence 1 at byte offset 58", "does not follow"});
}

TEST(MegatronCorruptTest, TokenAtOrAboveVocab) {
  // Token 11 is the .bin's last: byte offset 20.
  ExpectCorrupt(
      "vocab", [](Megatron&) {}, {"vocab.bin: token 10 at byte offset 20", "value 11", "[0, 11)"},
      11);
  // int16 -1 is below 0.
  const std::string prefix = WriteMegatron(MakeMegatron({{{1, 0xffff}}}, 3, 2), "negative_token");
  auto corpus = TokenFileCorpus::Open(prefix, Options());
  EXPECT_THAT(
      corpus.status().message(),
      AllOf(HasSubstr("negative_token.bin: token 1 at byte offset 2"), HasSubstr("value -1")));
}

TEST(MegatronCorruptTest, Empty) {
  ExpectCorrupt("empty_file", [](Megatron& m) { m.idx.clear(); },
                {"empty_file.idx: header at byte offset 0", "truncated"});
  const std::string none = WriteMegatron(MakeMegatron({}), "no_documents");
  EXPECT_THAT(
      TokenFileCorpus::Open(none, Options()).status().message(),
      AllOf(HasSubstr("no_documents.idx: document count at byte offset 26"), HasSubstr("empty")));
  const std::string zero = WriteMegatron(MakeMegatron({{}, {{}}}), "zero_tokens");
  EXPECT_THAT(TokenFileCorpus::Open(zero, Options()).status().message(),
              AllOf(HasSubstr("zero_tokens.idx"), HasSubstr("empty")));
}

TEST(MegatronCorruptTest, MissingBin) {
  const std::string prefix = ::testing::TempDir() + "/no_bin";
  WriteFile(prefix + ".idx", Sample().idx);
  auto corpus = TokenFileCorpus::Open(prefix, Options());
  EXPECT_EQ(corpus.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(corpus.status().message(), HasSubstr("no_bin.bin"));
}

std::string LlmC(int32_t magic, int32_t version, const std::vector<int64_t>& tokens, int itemsize) {
  std::string out;
  Put(out, static_cast<uint32_t>(magic), 4);
  Put(out, static_cast<uint32_t>(version), 4);
  Put(out, tokens.size(), 4);
  out.resize(1024, '\0');
  for (int64_t t : tokens) Put(out, static_cast<uint64_t>(t), itemsize);
  return out;
}

TEST(LlmCTest, DocumentsEndAtTheEodToken) {
  const std::string path = ::testing::TempDir() + "/shard16.bin";
  WriteFile(path, LlmC(20240520, 1, {9, 1, 2, 9, 3, 4, 5, 6, 7, 9, 8}, 2));
  auto corpus = TokenFileCorpus::Open(path, Options(4, 0, 9));
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ((*corpus)->format(), TokenFileFormat::kLlmC);
  // The leading EOD is a document of its own; 3 4 5 6 7 9 is cut at 4.
  EXPECT_EQ(AllDocuments(**corpus), (Docs{{9}, {1, 2, 9}, {3, 4, 5, 6}, {7, 9}, {8}}));
  EXPECT_EQ((*corpus)->MaxToken(), 9);
  EXPECT_TRUE(IsTokenFilePath(path));  // a .bin with llm.c's magic

  const std::string path32 = ::testing::TempDir() + "/shard32.bin";
  WriteFile(path32, LlmC(20240801, 7, {128000, 70000, 128001, 5}, 4));
  auto wide = TokenFileCorpus::Open(path32, Options(8, 128256, 128001));
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_EQ((*wide)->dtype(), TokenDType::kUint32);
  EXPECT_EQ(AllDocuments(**wide), (Docs{{128000, 70000, 128001}, {5}}));
}

TEST(LlmCTest, CorruptShards) {
  const std::string path = ::testing::TempDir() + "/bad_shard.bin";
  auto open = [&](const std::string& bytes, int64_t vocab = 0) {
    WriteFile(path, bytes);
    return TokenFileCorpus::OpenLlmC(path, Options(4, vocab, 0)).status();
  };
  EXPECT_THAT(open(LlmC(20240520, 7, {1, 2}, 2)).message(),
              AllOf(HasSubstr("bad_shard.bin: version at byte offset 4"), HasSubstr("expected 1")));
  EXPECT_THAT(open(LlmC(20240521, 1, {1, 2}, 2)).message(),
              HasSubstr("bad_shard.bin: magic at byte offset 0"));
  std::string truncated = LlmC(20240520, 1, {1, 2, 3}, 2);
  truncated.pop_back();
  EXPECT_THAT(open(truncated).message(),
              AllOf(HasSubstr("token count at byte offset 8"), HasSubstr("truncated")));
  EXPECT_THAT(open(LlmC(20240520, 1, {1, 2, 3}, 2).substr(0, 100)).message(),
              AllOf(HasSubstr("header at byte offset 100"), HasSubstr("truncated")));
  EXPECT_THAT(open(LlmC(20240520, 1, {}, 2)).message(), HasSubstr("empty"));
  EXPECT_THAT(open(LlmC(20240520, 1, {1, 300, 2}, 2), 256).message(),
              AllOf(HasSubstr("token 1 at byte offset 1026"), HasSubstr("value 300")));
}

std::string Flat(const std::vector<int64_t>& tokens, int itemsize) {
  std::string out;
  for (int64_t t : tokens) Put(out, static_cast<uint64_t>(t), itemsize);
  return out;
}

TEST(FlatTest, Uint16AndUint32) {
  const std::string u16 = ::testing::TempDir() + "/train.bin";
  WriteFile(u16, Flat({5, 6, 0, 7, 0, 8, 9}, 2));
  auto corpus = TokenFileCorpus::Open(u16, Options(8, 0, 0));
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ((*corpus)->format(), TokenFileFormat::kFlat);
  EXPECT_EQ(AllDocuments(**corpus), (Docs{{5, 6, 0}, {7, 0}, {8, 9}}));
  // A headerless .bin is not recognised as tokens by the trainer's path rule (a byte text
  // file named .bin stays text); .u16 is.
  EXPECT_FALSE(IsTokenFilePath(u16));
  const std::string named = ::testing::TempDir() + "/train.u16";
  WriteFile(named, Flat({5, 6, 0, 7, 0, 8, 9}, 2));
  EXPECT_TRUE(IsTokenFilePath(named));

  const std::string u32 = ::testing::TempDir() + "/train.u32";
  WriteFile(u32, Flat({100000, 1, 2, 3, 4}, 4));
  TokenFileOptions o = Options(2);  // no EOD: one document, cut in pieces of 2
  o.flat_dtype = FlatDTypeOfPath(u32);
  auto wide = TokenFileCorpus::Open(u32, o);
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_EQ(AllDocuments(**wide), (Docs{{100000, 1}, {2, 3}, {4}}));
  EXPECT_EQ((*wide)->MaxToken(), 100000);
  EXPECT_FALSE(IsTokenFilePath(::testing::TempDir() + "/corpus.txt"));
}

TEST(FlatTest, CorruptFiles) {
  const std::string path = ::testing::TempDir() + "/bad.u16";
  WriteFile(path, Flat({1, 2}, 2) + "x");
  EXPECT_THAT(TokenFileCorpus::Open(path, Options()).status().message(),
              AllOf(HasSubstr("bad.u16: end at byte offset 5"), HasSubstr("whole number")));
  WriteFile(path, "");
  EXPECT_THAT(TokenFileCorpus::Open(path, Options()).status().message(),
              AllOf(HasSubstr("bad.u16"), HasSubstr("empty")));
  WriteFile(path, Flat({1, 2, 70}, 2));
  EXPECT_THAT(TokenFileCorpus::Open(path, Options(4, 64)).status().message(),
              AllOf(HasSubstr("bad.u16: token 2 at byte offset 4"), HasSubstr("value 70")));
  // An EOD token the vocabulary cannot hold, and bad options.
  EXPECT_EQ(TokenFileCorpus::Open(path, Options(4, 64, 64)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TokenFileCorpus::Open(path, Options(0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TokenFileCorpus::Open(::testing::TempDir() + "/missing.u16", Options()).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace gradsum::data
