#ifndef GRADSUM_DATA_TEXT_CORPUS_H_
#define GRADSUM_DATA_TEXT_CORPUS_H_

// A text file as a corpus (--data): byte-level documents, one per line. The file is read
// whole at Load, fingerprinted (so ranks can check they read the same bytes) and indexed by
// line; documents are then views of its bytes.
//
//   GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<TextFileCorpus> corpus,
//                            TextFileCorpus::Load("corpus.txt", config.seq_len()));

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/document_source.h"

namespace gradsum::data {

// The largest --data file (bytes): the file is held in memory with an 8-byte index entry
// per document, so a file of N bytes takes at most 9 N bytes.
inline constexpr uint64_t kMaxDataFileBytes = uint64_t{1} << 30;

// A text file as documents: each line including its '\n' is a document; a line longer
// than `max_len` bytes is split into pieces of at most `max_len`.
class TextFileCorpus : public DocumentSource {
 public:
  // Reads `path` (ReadFileToString). It must be a regular file (FailedPrecondition naming
  // it: not a device or a directory) of 1 to kMaxDataFileBytes bytes (InvalidArgument if
  // empty, OutOfRange if bigger); a file that cannot be read is NotFound / PermissionDenied.
  static absl::StatusOr<std::unique_ptr<TextFileCorpus>> Load(const std::string& path, int max_len);
  // Load, but the thread ranks of one process share one read-only copy: while a corpus
  // loaded from the same file (the same device, inode, size and modification time) with the
  // same max_len is alive in the process, it is returned instead of a new copy (issue 50: at
  // world 8 a 1 GB file took 8 copies). Errors are Load's.
  static absl::StatusOr<std::shared_ptr<const TextFileCorpus>> LoadShared(const std::string& path,
                                                                          int max_len);
  int64_t num_documents() const override { return static_cast<int64_t>(starts_.size()) - 1; }
  int64_t DocumentLength(int64_t i) const override { return starts_[i + 1] - starts_[i]; }
  std::vector<int32_t> Document(int64_t i) const override;
  int64_t MinDocumentLength() const override { return min_len_; }
  int64_t MaxDocumentLength() const override { return max_len_; }
  std::string Describe() const override { return "--data=" + path_; }
  // XXH3-64 of the file's bytes (io/fingerprint.h Fingerprint64, `xxhsum -H3 FILE`).
  uint64_t ContentFingerprint() const override { return fingerprint_; }

 private:
  std::string path_;
  std::string bytes_;
  uint64_t fingerprint_ = 0;
  std::vector<int64_t> starts_;  // documents tile the file: starts_[i + 1] ends document i
  int64_t min_len_ = 0, max_len_ = 0;
};

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_TEXT_CORPUS_H_
