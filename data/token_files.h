#ifndef GRADSUM_DATA_TOKEN_FILES_H_
#define GRADSUM_DATA_TOKEN_FILES_H_

// Tokenized corpora as DocumentSources (data/document_source.h), memory-mapped and read in
// place: the Megatron-Core indexed dataset (PREFIX.idx + PREFIX.bin), llm.c shards and
// headerless token files (nanoGPT's train.bin). Everything a document is built from is
// validated at Open, before the first step, so that Document() on a loaded corpus never reads
// outside the mapping; an error names the file, the field and its byte offset.
//
//   TokenFileOptions options;
//   options.eod_token = 50256;
//   options.max_len = config.seq_len();
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<TokenFileCorpus> corpus,
//                            TokenFileCorpus::Open("fineweb_train_000001.bin", options));
//
// The formats (all little-endian):
//  - Megatron-Core (megatron/core/datasets/indexed_dataset.py): PREFIX.idx holds the 9-byte
//    magic "MMIDIDX\0\0", u64 version (1), u8 dtype code (1 uint8, 2 int8, 3 int16, 4 int32,
//    5 int64, 6 float64, 7 float32, 8 uint16), u64 sequence count S, u64 count D, then
//    int32 lengths[S] (tokens), int64 pointers[S] (BYTE offsets into PREFIX.bin), int64
//    document_indices[D]. D counts the closing index: document_indices[0] = 0,
//    document_indices[D - 1] = S, and document d < D - 1 is the sequences
//    [document_indices[d], document_indices[d + 1]). The .bin is raw tokens. The sequences of
//    a document must lie back to back in the .bin (Megatron's builder always writes them so),
//    so a document is one run of tokens. The float dtypes and the multimodal variant (a
//    trailing int8 mode per sequence) are refused.
//  - llm.c shards: a header of 256 int32 (magic 20240520 with version 1 and uint16 tokens,
//    or magic 20240801 with version 7 and uint32 tokens; then the token count), then the
//    tokens. Documents are split at the EOD token (below).
//  - headerless token files: uint16 or uint32 tokens, nothing else; documents split at the
//    EOD token.
//
// Recognition (OpenTokenFile): `path` + ".idx" present, or `path` ending in .idx or .bin with
// the .idx beside it -> Megatron (the prefix); else a file whose first int32 is an llm.c magic
// -> llm.c; else the headerless dtype of the options. IsTokenFilePath says which paths the
// trainer reads as token files rather than byte text (data/corpus.h).
//
// Documents split at the EOD token: each EOD token ends the document it belongs to (it is its
// last token, so the model learns to predict it); tokens after the last EOD form the last
// document. llm.c's writers put the EOD before each document, so there the file's first
// document is the lone EOD (no label). Without an EOD token (eod_token < 0) the file is one
// document, cut into max_len pieces like any long document.
//
// Long documents: a document longer than max_len tokens is cut into pieces of max_len tokens
// (the last one shorter), each its own document, as the byte text corpus cuts long lines
// (data/text_corpus.h). Empty Megatron documents (no tokens) are skipped.
//
// Tokens: every token must lie in [0, vocab) (vocab > 0), or [0, 2^31 - 1) with vocab = 0;
// the check scans the tokens once at Open (at memory bandwidth: seconds for GBs; a scan
// longer than 2 s prints its progress to stderr every 2 s), and MaxToken() is their largest
// value. scan_tokens = false skips the scan of a Megatron .bin
// (the EOD split of the other formats reads every token anyway); MaxToken() is then the
// dtype's bound and Document() may return a token the model cannot embed.
//
// A file truncated or rewritten while mapped is outside this guarantee (the kernel raises
// SIGBUS on a page past the new end); the fingerprint (ContentFingerprint) lets a resumed run
// notice a changed file.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/document_source.h"

namespace gradsum::data {

// A token's storage in the file.
enum class TokenDType { kUint8, kInt8, kInt16, kInt32, kInt64, kUint16, kUint32 };
int TokenDTypeBytes(TokenDType t);
const char* TokenDTypeName(TokenDType t);

enum class TokenFileFormat { kMegatron, kLlmC, kFlat };
const char* TokenFileFormatName(TokenFileFormat f);

struct TokenFileOptions {
  // The end-of-document token of llm.c shards and headerless files; < 0: none (the whole
  // file is one document). Megatron datasets take their boundaries from the index.
  int64_t eod_token = -1;
  // Longest document (the packed sequence length); longer ones are cut. Must be positive.
  int64_t max_len = 0;
  // Every token must be < vocab; 0: only < 2^31 - 1 (the trainer checks MaxToken() < its
  // vocabulary after Open, train/trainer.cc via CheckCorpusVocab).
  int64_t vocab = 0;
  // Scan a Megatron .bin's tokens at Open (see the header comment).
  bool scan_tokens = true;
  // The dtype of a headerless file: kUint16 or kUint32.
  TokenDType flat_dtype = TokenDType::kUint16;
};

class TokenFileCorpus : public DocumentSource {
 public:
  ~TokenFileCorpus() override;
  // Recognises the format (see the header comment) and opens it. Errors: the file's
  // (NotFound, PermissionDenied, FailedPrecondition for a non-regular file, naming it);
  // InvalidArgument "<file>: <field> at byte offset <n>: <why>" for a malformed file or a
  // token out of range, and for bad options.
  static absl::StatusOr<std::unique_ptr<TokenFileCorpus>> Open(const std::string& path,
                                                               const TokenFileOptions& options);
  // One format, without recognition: `prefix` names PREFIX.idx and PREFIX.bin.
  static absl::StatusOr<std::unique_ptr<TokenFileCorpus>> OpenMegatron(
      const std::string& prefix, const TokenFileOptions& options);
  static absl::StatusOr<std::unique_ptr<TokenFileCorpus>> OpenLlmC(const std::string& path,
                                                                   const TokenFileOptions& options);
  static absl::StatusOr<std::unique_ptr<TokenFileCorpus>> OpenFlat(const std::string& path,
                                                                   const TokenFileOptions& options);

  int64_t num_documents() const override { return static_cast<int64_t>(starts_.size()); }
  int64_t DocumentLength(int64_t i) const override { return lengths_[i]; }
  std::vector<int32_t> Document(int64_t i) const override;
  int64_t MinDocumentLength() const override { return min_len_; }
  int64_t MaxDocumentLength() const override { return max_len_; }
  std::string Describe() const override;
  // XXH3-64 of the mapped bytes (for Megatron: of the .idx's and the .bin's fingerprints).
  uint64_t ContentFingerprint() const override { return fingerprint_; }

  TokenFileFormat format() const { return format_; }
  TokenDType dtype() const { return dtype_; }
  // The largest token (after the scan; without it the dtype's largest value).
  int64_t MaxToken() const { return max_token_; }
  int64_t num_tokens() const { return num_tokens_; }  // in documents

 private:
  class Mapping;
  TokenFileCorpus();
  // Checks the tokens [0, n) (ScanTokens) and splits them into documents at the EOD token
  // (eod < 0: none), each cut into max_len pieces: one pass in chunks, whose progress a long
  // scan prints (core/progress.h).
  absl::Status ScanAndSplit(int64_t n, int64_t bound, const std::string& file, int64_t eod,
                            int64_t max_len);
  void AddDocument(int64_t start, int64_t n, int64_t max_len);
  int64_t TokenAt(int64_t index) const;
  // Checks the tokens [start, start + n) lie in [0, bound); the error names `file` and the
  // token's byte offset (data_offset_ + its index * size).
  absl::Status ScanTokens(int64_t start, int64_t n, int64_t bound, const std::string& file);

  TokenFileFormat format_ = TokenFileFormat::kFlat;
  TokenDType dtype_ = TokenDType::kUint16;
  std::string path_;  // the file, or the Megatron prefix
  std::unique_ptr<Mapping> idx_, bin_;
  const unsigned char* tokens_ = nullptr;  // the first token in bin_
  int64_t data_offset_ = 0;                // its byte offset in the file
  std::vector<int64_t> starts_;            // each document's first token (index into tokens_)
  std::vector<int32_t> lengths_;           // its tokens
  int64_t min_len_ = 0, max_len_ = 0, max_token_ = 0, num_tokens_ = 0;
  uint64_t fingerprint_ = 0;
};

// Whether the trainer reads `path` (data.path) as a token file: PREFIX.idx beside it (or the
// path is such a .idx / .bin), a .bin whose first int32 is an llm.c magic, or a path ending
// in .u16 (headerless uint16) or .u32 (headerless uint32). Any other path, a .bin that is
// neither Megatron's nor llm.c's included, is a byte text file (data/text_corpus.h), as it
// was before token files: give nanoGPT's headerless train.bin a .u16 name (a link will do).
bool IsTokenFilePath(const std::string& path);

// The headerless dtype a path's extension gives: kUint32 for .u32, else kUint16.
TokenDType FlatDTypeOfPath(const std::string& path);

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_TOKEN_FILES_H_
