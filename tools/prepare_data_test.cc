// The sentencepiece tools: a tokenizer trained at test time from the repository's own README
// (one thread: deterministic), text and JSONL prepared into a Megatron dataset, read back
// with data/token_files and compared with the tokenizer's own encoding of each document.

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "data/token_files.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/prepare_data_lib.h"
#include "tools/sentencepiece.h"

namespace gradsum::tools {
namespace {

using ::testing::HasSubstr;

std::string TmpPath(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
}

std::string ReadmePath() {
  const char* src = std::getenv("TEST_SRCDIR");
  return absl::StrCat(src != nullptr ? src : ".", "/gradsum/README.md");
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteAll(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// One model for the suite, trained on the README.
const std::string& Model() {
  static const std::string* model = [] {
    SentencePieceTrainOptions o;
    o.input = ReadmePath();
    o.model_prefix = TmpPath("readme_bpe");
    o.vocab_size = 600;
    const std::string error = TrainSentencePiece(o);
    EXPECT_EQ(error, "");
    return new std::string(o.model_prefix + ".model");
  }();
  return *model;
}

std::vector<int32_t> Encoded(const SentencePieceTokenizer& tokenizer, const std::string& text) {
  std::vector<int> ids;
  EXPECT_EQ(tokenizer.Encode(text, &ids), "");
  std::vector<int32_t> out(ids.begin(), ids.end());
  out.push_back(tokenizer.eos_id());
  return out;
}

// Every document of the dataset at `prefix`, read with data/token_files.
std::vector<std::vector<int32_t>> ReadBack(const std::string& prefix, int vocab) {
  data::TokenFileOptions options;
  options.max_len = int64_t{1} << 30;
  options.vocab = vocab;
  auto corpus = data::TokenFileCorpus::OpenMegatron(prefix, options);
  EXPECT_TRUE(corpus.ok()) << corpus.status();
  std::vector<std::vector<int32_t>> docs;
  if (!corpus.ok()) return docs;
  EXPECT_EQ((*corpus)->dtype(), data::TokenDType::kUint16);
  for (int64_t i = 0; i < (*corpus)->num_documents(); ++i) docs.push_back((*corpus)->Document(i));
  return docs;
}

TEST(TokenizerTrainTest, OneThreadGivesTheSameModelBytes) {
  // The model records its own training options (model_prefix included), so it is trained
  // again under the same prefix.
  const std::string first = ReadAll(Model());
  SentencePieceTrainOptions o;
  o.input = ReadmePath();
  o.vocab_size = 600;
  o.model_prefix = TmpPath("readme_bpe");
  ASSERT_EQ(TrainSentencePiece(o), "");
  const std::string second = ReadAll(Model());
  EXPECT_GT(first.size(), 1000u);
  EXPECT_TRUE(first == second) << "the model's bytes differ between two trainings";
  SentencePieceTokenizer tokenizer;
  ASSERT_EQ(tokenizer.Load(Model()), "");
  EXPECT_EQ(tokenizer.vocab_size(), 600);
  // Byte fallback: text the README never holds still round-trips.
  std::vector<int> ids;
  ASSERT_EQ(tokenizer.Encode("Zürich ☃ gradsum", &ids), "");
  EXPECT_EQ(tokenizer.Decode(ids), "Zürich ☃ gradsum");
}

TEST(TokenizerTrainTest, UnigramAndBadType) {
  SentencePieceTrainOptions o;
  o.input = ReadmePath();
  o.vocab_size = 400;
  o.model_type = "unigram";
  o.model_prefix = TmpPath("unigram");
  EXPECT_EQ(TrainSentencePiece(o), "");
  o.model_type = "wordpiece";
  EXPECT_THAT(TrainSentencePiece(o), HasSubstr("--model_type=wordpiece"));
}

TEST(PrepareDataTest, LinesReadBackAsTheTokenizersEncodingPlusEod) {
  SentencePieceTokenizer tokenizer;
  ASSERT_EQ(tokenizer.Load(Model()), "");
  PrepareOptions o;
  o.inputs = {ReadmePath()};
  o.tokenizer = Model();
  o.output_prefix = TmpPath("readme");
  auto result = PrepareData(o);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->dtype, "uint16");
  EXPECT_EQ(result->eod_id, tokenizer.eos_id());
  std::vector<std::vector<int32_t>> expected;
  std::istringstream lines(ReadAll(ReadmePath()));
  int64_t tokens = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    expected.push_back(Encoded(tokenizer, line));
    tokens += static_cast<int64_t>(expected.back().size());
  }
  EXPECT_EQ(result->documents, static_cast<int64_t>(expected.size()));
  EXPECT_EQ(result->tokens, tokens);
  EXPECT_EQ(ReadBack(o.output_prefix, 600), expected);

  // The thread count changes nothing in the output.
  o.threads = 3;
  o.output_prefix = TmpPath("readme3");
  ASSERT_TRUE(PrepareData(o).ok());
  EXPECT_TRUE(ReadAll(TmpPath("readme3.bin")) == ReadAll(TmpPath("readme.bin")));
  EXPECT_TRUE(ReadAll(TmpPath("readme3.idx")) == ReadAll(TmpPath("readme.idx")));
}

TEST(PrepareDataTest, JsonlTextParagraphsAndFiles) {
  SentencePieceTokenizer tokenizer;
  ASSERT_EQ(tokenizer.Load(Model()), "");
  const std::string jsonl = TmpPath("docs.jsonl");
  WriteAll(jsonl,
           "{\"text\": \"first doc\\nwith two lines\", \"id\": 1}\n\n"
           "{\"text\": \"\"}\n{\"id\": 3, \"text\": \"Zürich\"}\n");
  const std::string text = TmpPath("paras.txt");
  WriteAll(text, "para one\nline two\n\npara two\n\n\nthree\n");
  PrepareOptions o;
  o.tokenizer = Model();
  o.inputs = {jsonl, text};
  o.text_documents = "paragraph";
  o.output_prefix = TmpPath("mixed");
  ASSERT_TRUE(PrepareData(o).ok());
  const std::vector<std::vector<int32_t>> expected = {
      Encoded(tokenizer, "first doc\nwith two lines"), Encoded(tokenizer, "Zürich"),
      Encoded(tokenizer, "para one\nline two"), Encoded(tokenizer, "para two"),
      Encoded(tokenizer, "three")};
  EXPECT_EQ(ReadBack(o.output_prefix, 600), expected);

  o.inputs = {text};
  o.text_documents = "file";
  o.output_prefix = TmpPath("whole");
  ASSERT_TRUE(PrepareData(o).ok());
  EXPECT_EQ(ReadBack(o.output_prefix, 600),
            (std::vector<std::vector<int32_t>>{
                Encoded(tokenizer, "para one\nline two\n\npara two\n\n\nthree")}));
}

TEST(PrepareDataTest, BadInputNamesTheValue) {
  PrepareOptions o;
  o.tokenizer = Model();
  o.output_prefix = TmpPath("bad");
  o.inputs = {TmpPath("no_such_file.txt")};
  auto r = PrepareData(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("no_such_file.txt"));

  const std::string jsonl = TmpPath("bad.jsonl");
  WriteAll(jsonl, "{\"text\": \"ok\"}\n{\"txt\": \"no\"}\n");
  o.inputs = {jsonl};
  r = PrepareData(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("bad.jsonl:2: has no \"text\" string"));
  WriteAll(jsonl, "[1, 2]\n");
  EXPECT_THAT(PrepareData(o).status().message(), HasSubstr("bad.jsonl:1: not a JSON object"));

  const std::string empty = TmpPath("empty.txt");
  WriteAll(empty, "\n\n");
  o.inputs = {empty};
  EXPECT_THAT(PrepareData(o).status().message(), HasSubstr("no document"));

  o.inputs = {ReadmePath()};
  o.threads = 0;
  EXPECT_THAT(PrepareData(o).status().message(), HasSubstr("--threads=0"));
  o.threads = 2;
  o.text_documents = "sentence";
  EXPECT_THAT(PrepareData(o).status().message(), HasSubstr("--text_documents=sentence"));
  o.text_documents = "line";
  o.format = "csv";
  EXPECT_THAT(PrepareData(o).status().message(), HasSubstr("--format=csv"));
  o.format = "auto";
  o.tokenizer = TmpPath("no_such.model");
  EXPECT_THAT(PrepareData(o).status().message(), HasSubstr("--tokenizer="));
  // Nothing half-written is left where a dataset would be.
  std::ifstream bin(TmpPath("bad.bin"));
  EXPECT_FALSE(bin.good());
}

}  // namespace
}  // namespace gradsum::tools
