#include "tools/prepare_data_lib.h"

#include <cerrno>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "data/megatron_writer.h"
#include "data/token_files.h"
#include "io/atomic_file.h"
#include "nlohmann/json.hpp"
#include "tools/sentencepiece.h"

namespace gradsum::tools {

namespace {

// Documents are encoded in batches of about this many bytes of text, spread over the threads
// and written in order.
constexpr size_t kBatchBytes = size_t{4} << 20;

struct Document {
  std::string text;
  std::string where;  // "<file>:<line>" for errors
};

// Reads the documents of one input file batch by batch.
class DocumentReader {
 public:
  static absl::StatusOr<DocumentReader> Open(const std::string& path, const PrepareOptions& o) {
    // Names the file; refuses a FIFO or a directory.
    GRADSUM_RETURN_IF_ERROR(Annotate(OpenRegularFile(path).status(), "--input"));
    DocumentReader r;
    r.path_ = path;
    r.jsonl_ =
        o.format == "jsonl" ||
        (o.format == "auto" && (absl::EndsWith(path, ".jsonl") || absl::EndsWith(path, ".json")));
    r.mode_ = o.text_documents;
    r.in_ = std::make_unique<std::ifstream>(path, std::ios::binary);
    if (!*r.in_) return ErrnoStatus(errno, absl::StrCat("--input=", path, ": cannot open"));
    return r;
  }

  // Appends documents to `batch` until about kBatchBytes; false at the end of the file.
  absl::StatusOr<bool> Next(std::vector<Document>& batch, size_t& bytes) {
    std::string line;
    while (bytes < kBatchBytes) {
      if (!std::getline(*in_, line)) {
        if (in_->bad()) return ErrnoStatus(errno, absl::StrCat("--input=", path_, ": read error"));
        if (!pending_.empty()) Emit(std::move(pending_), batch, bytes);
        pending_.clear();
        return false;
      }
      ++line_;
      if (jsonl_) {
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_discarded() || !j.is_object()) {
          return absl::InvalidArgumentError(
              absl::StrCat(path_, ":", line_, ": not a JSON object (JSONL: one per line)"));
        }
        auto text = j.find("text");
        if (text == j.end() || !text->is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(path_, ":", line_, ": has no \"text\" string"));
        }
        Emit(text->get<std::string>(), batch, bytes);
      } else if (mode_ == "line") {
        Emit(std::move(line), batch, bytes);
      } else if (mode_ == "paragraph" && line.empty()) {
        Emit(std::move(pending_), batch, bytes);
        pending_.clear();
      } else {
        if (!pending_.empty() || (mode_ == "file" && line_ > 1)) pending_ += '\n';
        pending_ += line;
      }
    }
    return true;
  }

 private:
  void Emit(std::string text, std::vector<Document>& batch, size_t& bytes) {
    if (text.empty()) return;
    bytes += text.size();
    batch.push_back({std::move(text), absl::StrCat(path_, ":", line_)});
  }

  std::string path_;
  bool jsonl_ = false;
  std::string mode_;
  std::unique_ptr<std::ifstream> in_;
  std::string pending_;  // the paragraph or file so far
  int64_t line_ = 0;
};

}  // namespace

absl::StatusOr<PrepareResult> PrepareData(const PrepareOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (options.inputs.empty()) return absl::InvalidArgumentError("--input: no input file given");
  if (options.output_prefix.empty()) return absl::InvalidArgumentError("--output_prefix: empty");
  if (options.threads < 1 || options.threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads=", options.threads, ": must be in [1, 256]"));
  }
  if (options.format != "auto" && options.format != "text" && options.format != "jsonl") {
    return absl::InvalidArgumentError(
        absl::StrCat("--format=", options.format, ": must be auto, text or jsonl"));
  }
  if (options.text_documents != "line" && options.text_documents != "paragraph" &&
      options.text_documents != "file") {
    return absl::InvalidArgumentError(absl::StrCat("--text_documents=", options.text_documents,
                                                   ": must be line, paragraph or file"));
  }
  SentencePieceTokenizer tokenizer;
  if (const std::string e = tokenizer.Load(options.tokenizer); !e.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--tokenizer=", options.tokenizer, ": ", e));
  }
  PrepareResult result;
  result.eod_id = tokenizer.eos_id();
  result.vocab_size = tokenizer.vocab_size();
  if (result.eod_id < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokenizer=", options.tokenizer,
                     ": the model has no end-of-sentence id (eos_id -1), "
                     "which every document ends with"));
  }
  // Every input is checked before anything is written.
  std::vector<DocumentReader> readers;
  for (const std::string& path : options.inputs) {
    GRADSUM_ASSIGN_OR_RETURN(DocumentReader reader, DocumentReader::Open(path, options));
    readers.push_back(std::move(reader));
  }
  const data::TokenDType dtype = data::MegatronDTypeForVocab(result.vocab_size);
  result.dtype = data::TokenDTypeName(dtype);
  GRADSUM_ASSIGN_OR_RETURN(data::MegatronWriter writer,
                           data::MegatronWriter::Create(options.output_prefix, dtype));
  auto last_report = start;
  std::vector<Document> batch;
  std::vector<std::vector<int32_t>> encoded;
  std::vector<std::string> errors(options.threads);
  for (DocumentReader& reader : readers) {
    for (bool more = true; more;) {
      batch.clear();
      size_t bytes = 0;
      GRADSUM_ASSIGN_OR_RETURN(more, reader.Next(batch, bytes));
      encoded.assign(batch.size(), {});
      // Thread t encodes documents t, t + threads, ...; the order of the output is the
      // input's.
      auto encode = [&](int t) {
        std::vector<int> ids;
        for (size_t i = t; i < batch.size(); i += options.threads) {
          if (std::string e = tokenizer.Encode(batch[i].text, &ids); !e.empty()) {
            errors[t] = absl::StrCat(batch[i].where, ": ", e);
            return;
          }
          encoded[i].assign(ids.begin(), ids.end());
          encoded[i].push_back(result.eod_id);
        }
      };
      std::vector<std::thread> pool;
      for (int t = 1; t < options.threads; ++t) pool.emplace_back(encode, t);
      encode(0);
      for (std::thread& th : pool) th.join();
      for (const std::string& e : errors) {
        if (!e.empty()) return absl::InvalidArgumentError(e);
      }
      for (const std::vector<int32_t>& doc : encoded) {
        GRADSUM_RETURN_IF_ERROR(writer.AddDocument(doc));
      }
      result.text_bytes += static_cast<int64_t>(bytes);
      const auto now = std::chrono::steady_clock::now();
      if (options.progress && now - last_report >= std::chrono::seconds(1)) {
        options.progress(writer.documents(), writer.tokens(), result.text_bytes);
        last_report = now;
      }
    }
  }
  if (writer.documents() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--input: no document in ", options.inputs.size(), " file(s) (all empty)"));
  }
  result.documents = writer.documents();
  result.tokens = writer.tokens();
  GRADSUM_RETURN_IF_ERROR(writer.Finish());
  if (options.progress) options.progress(result.documents, result.tokens, result.text_bytes);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace gradsum::tools
