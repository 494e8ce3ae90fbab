#include "data/text_corpus.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
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

absl::StatusOr<std::shared_ptr<const TextFileCorpus>> TextFileCorpus::LoadShared(
    const std::string& path, int max_len) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    absl::StatusOr<std::unique_ptr<TextFileCorpus>> error = Load(path, max_len);  // names it
    if (!error.ok()) return error.status();
    return std::shared_ptr<const TextFileCorpus>(std::move(*error));
  }
  // What identifies the file's content for as long as nobody rewrites it in place within one
  // second and at the same size; Load fingerprints what it read, and the ranks of separate
  // processes compare that (train/config_agreement.h).
  using Key = std::tuple<std::string, int, dev_t, ino_t, off_t, int64_t, int64_t>;
  const Key key{path,       max_len,           st.st_dev,         st.st_ino,
                st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec};
  static std::mutex mu;
  static std::map<Key, std::weak_ptr<const TextFileCorpus>>* cache =
      new std::map<Key, std::weak_ptr<const TextFileCorpus>>();
  // Held while loading: the other ranks would load the same bytes; they wait and share them.
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = cache->begin(); it != cache->end();) {
    it = it->second.expired() ? cache->erase(it) : std::next(it);
  }
  if (auto it = cache->find(key); it != cache->end()) {
    if (std::shared_ptr<const TextFileCorpus> alive = it->second.lock()) return alive;
  }
  absl::StatusOr<std::unique_ptr<TextFileCorpus>> loaded = Load(path, max_len);
  if (!loaded.ok()) return loaded.status();
  std::shared_ptr<const TextFileCorpus> shared(std::move(*loaded));
  (*cache)[key] = shared;
  return shared;
}

std::vector<int32_t> TextFileCorpus::Document(int64_t i) const {
  std::vector<int32_t> doc(DocumentLength(i));
  for (int64_t t = 0; t < static_cast<int64_t>(doc.size()); ++t) {
    doc[t] = static_cast<unsigned char>(bytes_[starts_[i] + t]);
  }
  return doc;
}

}  // namespace gradsum::data
