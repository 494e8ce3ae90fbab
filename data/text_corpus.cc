#include "data/text_corpus.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "io/atomic_file.h"
#include "io/fingerprint.h"

namespace gradsum::data {

absl::StatusOr<std::unique_ptr<TextFileCorpus>> TextFileCorpus::Load(const std::string& path,
                                                                     int max_len) {
  const std::string name = absl::StrCat("--data=", path);
  if (max_len < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_len=", max_len, ": must be positive"));
  }
  absl::StatusOr<std::string> bytes = ReadFileToString(path, kMaxDataFileBytes);
  if (!bytes.ok()) return Annotate(bytes.status(), name);
  auto corpus = std::unique_ptr<TextFileCorpus>(new TextFileCorpus());
  corpus->path_ = path;
  corpus->bytes_ = std::move(*bytes);
  if (corpus->bytes_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": file is empty"));
  }
  corpus->fingerprint_ = Fingerprint64(corpus->bytes_);
  const int64_t n = static_cast<int64_t>(corpus->bytes_.size());
  corpus->min_len_ = max_len;
  int64_t line_start = 0;
  while (line_start < n) {
    const void* nl = std::memchr(corpus->bytes_.data() + line_start, '\n', n - line_start);
    int64_t line_end = nl == nullptr ? n : static_cast<const char*>(nl) - corpus->bytes_.data() + 1;
    for (int64_t s = line_start; s < line_end; s += max_len) {
      corpus->starts_.push_back(s);
      const int64_t len = std::min<int64_t>(max_len, line_end - s);
      corpus->min_len_ = std::min(corpus->min_len_, len);
      corpus->max_len_ = std::max(corpus->max_len_, len);
    }
    line_start = line_end;
  }
  corpus->starts_.push_back(n);
  return corpus;
}

std::vector<int32_t> TextFileCorpus::Document(int64_t i) const {
  std::vector<int32_t> doc(DocumentLength(i));
  for (int64_t t = 0; t < static_cast<int64_t>(doc.size()); ++t) {
    doc[t] = static_cast<unsigned char>(bytes_[starts_[i] + t]);
  }
  return doc;
}

}  // namespace gradsum::data
