#ifndef GRADSUM_TOOLS_PREPARE_DATA_LIB_H_
#define GRADSUM_TOOLS_PREPARE_DATA_LIB_H_

// Text into a Megatron indexed dataset (data/megatron_writer.h) through a sentencepiece
// model (tools/sentencepiece.h): the work of //tools:prepare_data, callable from tests.
//
// Documents: in a JSONL file (a name ending in .jsonl or .json, or format "jsonl") each
// line is a JSON object whose "text" string is one document; in a text file, by
// `text_documents`: "line" (the default: each line, without its '\n', is a document, as
// --data reads byte text), "paragraph" (blocks separated by blank lines, inner newlines kept)
// or "file" (the whole file). Empty documents (and empty lines of JSONL) are skipped. Each
// document is the tokenizer's ids of its text followed by the EOD id (the model's </s>,
// eos_id), written as one sequence and one document of the dataset, in input order whatever
// the thread count. The dtype is Megatron's for the model's vocabulary (uint16 below 65500
// ids, else int32).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gradsum::tools {

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string tokenizer;                // a sentencepiece .model
  std::string output_prefix;            // writes output_prefix.bin and output_prefix.idx
  std::string format = "auto";          // auto (by extension) | text | jsonl
  std::string text_documents = "line";  // line | paragraph | file
  int threads = 2;                      // encoding threads
  // Called about once a second and at the end with the totals so far (the tool's progress
  // display); may be empty.
  std::function<void(int64_t documents, int64_t tokens, int64_t bytes)> progress;
};

struct PrepareResult {
  int64_t documents = 0;
  int64_t tokens = 0;      // EOD ids included
  int64_t text_bytes = 0;  // of the documents' text
  int eod_id = -1;
  int vocab_size = 0;
  std::string dtype;
  double seconds = 0;
};

// Errors: InvalidArgument naming the option or "<file>:<line>" for a bad value or document
// (a JSONL line that is not an object with a "text" string, a model without an EOD id),
// NotFound / PermissionDenied naming an input that cannot be read, the tokenizer's load
// error naming --tokenizer, the writer's errors naming the output.
absl::StatusOr<PrepareResult> PrepareData(const PrepareOptions& options);

}  // namespace gradsum::tools

#endif  // GRADSUM_TOOLS_PREPARE_DATA_LIB_H_
