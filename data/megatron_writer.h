#ifndef GRADSUM_DATA_MEGATRON_WRITER_H_
#define GRADSUM_DATA_MEGATRON_WRITER_H_

// Writes a Megatron-Core indexed dataset (PREFIX.bin + PREFIX.idx, the format
// data/token_files.h reads) one document at a time, as Megatron's preprocess_data.py does
// without sentence splitting: each document one sequence, document_indices 0, 1, ..., S.
// The tokens stream to PREFIX.bin.tmp; Finish writes the index and renames both into place,
// so an interrupted run leaves no PREFIX.bin / PREFIX.idx pair that looks complete.
//
//   GRADSUM_ASSIGN_OR_RETURN(MegatronWriter writer,
//                            MegatronWriter::Create("out/web", TokenDType::kUint16));
//   GRADSUM_RETURN_IF_ERROR(writer.AddDocument({17, 4, 2}));
//   GRADSUM_RETURN_IF_ERROR(writer.Finish());

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "data/token_files.h"

namespace gradsum::data {

// Megatron's choice (indexed_dataset.py DType.optimal_dtype): uint16 for a vocabulary below
// 65500 ids, else int32.
TokenDType MegatronDTypeForVocab(int64_t vocab);

class MegatronWriter {
 public:
  // `dtype` kUint8, kInt16, kUint16, kInt32 or kInt64 (InvalidArgument otherwise); errors
  // opening PREFIX.bin.tmp name it.
  static absl::StatusOr<MegatronWriter> Create(const std::string& prefix, TokenDType dtype);
  MegatronWriter(MegatronWriter&&) noexcept;
  MegatronWriter& operator=(MegatronWriter&&) noexcept;
  ~MegatronWriter();  // removes the temporary file if Finish was not reached

  // Appends one document (at least one token). InvalidArgument naming the document and the
  // token if one does not fit the dtype; I/O errors name the file.
  absl::Status AddDocument(const std::vector<int32_t>& tokens);
  // Writes PREFIX.idx and renames PREFIX.bin.tmp to PREFIX.bin.
  absl::Status Finish();

  int64_t documents() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t tokens() const { return tokens_; }

 private:
  MegatronWriter() = default;

  std::string prefix_;
  TokenDType dtype_ = TokenDType::kUint16;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  int64_t tokens_ = 0;
  std::vector<unsigned char> buffer_;
};

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_MEGATRON_WRITER_H_
