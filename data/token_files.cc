#include "data/token_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/progress.h"
#include "core/status.h"
#include "io/atomic_file.h"
#include "io/fingerprint.h"

namespace gradsum::data {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the token files are little-endian and read in place");

namespace {

constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kMegatronHeaderBytes = 9 + 8 + 1 + 8 + 8;  // 34
constexpr int32_t kLlmCMagic16 = 20240520, kLlmCMagic32 = 20240801;
constexpr int32_t kLlmCVersion16 = 1, kLlmCVersion32 = 7;
constexpr int64_t kLlmCHeaderBytes = 256 * 4;
// Tokens must fit the loader's int32 with room for a bound: [0, 2^31 - 1).
constexpr int64_t kMaxTokenBound = std::numeric_limits<int32_t>::max();

// "<file>: <field> at byte offset <offset>: <why>".
absl::Status Corrupt(absl::string_view file, absl::string_view field, int64_t offset,
                     absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat(file, ": ", field, " at byte offset ", offset, ": ", why));
}

// A little-endian value at `offset` of `bytes` (the caller checked the bounds); memcpy, since
// the .idx's arrays start at byte 34 and are not aligned.
template <typename T>
T Load(const unsigned char* bytes, int64_t offset) {
  T v;
  std::memcpy(&v, bytes + offset, sizeof(T));
  return v;
}

bool EndsWith(const std::string& s, absl::string_view suffix) { return absl::EndsWith(s, suffix); }

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// The Megatron prefix `path` names, or "" when there is none.
std::string MegatronPrefix(const std::string& path) {
  if (Exists(path + ".idx")) return path;
  if (EndsWith(path, ".idx") || EndsWith(path, ".bin")) {
    const std::string prefix = path.substr(0, path.size() - 4);
    if (Exists(prefix + ".idx")) return prefix;
  }
  return "";
}

// Whether some Open is printing its scan's progress: the thread ranks of a process open the
// same files at once, and one line every 2 s says as much as one per rank.
std::atomic<bool> g_scan_reporting{false};

// The progress of one Open's pass over the tokens (core/progress.h: nothing for a scan under
// 2 s, so quick runs print what they did before).
class ScanProgress {
 public:
  ScanProgress(const std::string& file, int64_t total) : owner_(!g_scan_reporting.exchange(true)) {
    if (owner_) {
      reporter_ = std::make_unique<ProgressReporter>(absl::StrCat("checking the tokens of ", file),
                                                     total, "tokens");
    }
  }
  ~ScanProgress() {
    if (!owner_) return;
    reporter_->Finish();
    g_scan_reporting = false;
  }
  ScanProgress(const ScanProgress&) = delete;
  ScanProgress& operator=(const ScanProgress&) = delete;
  void Add(int64_t tokens) {
    done_ += tokens;
    if (reporter_ != nullptr) reporter_->Update(done_);
  }

 private:
  const bool owner_;
  std::unique_ptr<ProgressReporter> reporter_;
  int64_t done_ = 0;
};

// Tokens between two looks at the clock in a file's single pass (~1 ms of scanning).
constexpr int64_t kScanChunk = int64_t{1} << 20;

}  // namespace

int TokenDTypeBytes(TokenDType t) {
  switch (t) {
    case TokenDType::kUint8:
    case TokenDType::kInt8:
      return 1;
    case TokenDType::kInt16:
    case TokenDType::kUint16:
      return 2;
    case TokenDType::kInt32:
    case TokenDType::kUint32:
      return 4;
    case TokenDType::kInt64:
      return 8;
  }
  return 0;
}

const char* TokenDTypeName(TokenDType t) {
  switch (t) {
    case TokenDType::kUint8:
      return "uint8";
    case TokenDType::kInt8:
      return "int8";
    case TokenDType::kInt16:
      return "int16";
    case TokenDType::kInt32:
      return "int32";
    case TokenDType::kInt64:
      return "int64";
    case TokenDType::kUint16:
      return "uint16";
    case TokenDType::kUint32:
      return "uint32";
  }
  return "?";
}

const char* TokenFileFormatName(TokenFileFormat f) {
  switch (f) {
    case TokenFileFormat::kMegatron:
      return "Megatron indexed dataset";
    case TokenFileFormat::kLlmC:
      return "llm.c shard";
    case TokenFileFormat::kFlat:
      return "headerless token file";
  }
  return "?";
}

// A whole file mapped read-only (nothing mapped when it is empty).
class TokenFileCorpus::Mapping {
 public:
  static absl::StatusOr<std::unique_ptr<Mapping>> Open(const std::string& path) {
    GRADSUM_ASSIGN_OR_RETURN(ReadOnlyFile file, OpenRegularFile(path));
    auto m = std::unique_ptr<Mapping>(new Mapping());
    m->size_ = static_cast<int64_t>(file.size());
    if (m->size_ > 0) {
      void* p = mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, file.fd(), 0);
      if (p == MAP_FAILED) return ErrnoStatus(errno, absl::StrCat("mmap '", path, "'"));
      m->data_ = static_cast<const unsigned char*>(p);
    }
    return m;
  }
  ~Mapping() {
    if (data_ != nullptr) munmap(const_cast<unsigned char*>(data_), size_);
  }
  const unsigned char* data() const { return data_; }
  int64_t size() const { return size_; }
  uint64_t Fingerprint() const {
    return Fingerprint64(absl::string_view(reinterpret_cast<const char*>(data_), size_));
  }

 private:
  Mapping() = default;
  const unsigned char* data_ = nullptr;
  int64_t size_ = 0;
};

TokenFileCorpus::TokenFileCorpus() = default;
TokenFileCorpus::~TokenFileCorpus() = default;

int64_t TokenFileCorpus::TokenAt(int64_t index) const {
  const unsigned char* p = tokens_ + index * TokenDTypeBytes(dtype_);
  switch (dtype_) {
    case TokenDType::kUint8:
      return *p;
    case TokenDType::kInt8:
      return static_cast<int8_t>(*p);
    case TokenDType::kInt16:
      return Load<int16_t>(p, 0);
    case TokenDType::kUint16:
      return Load<uint16_t>(p, 0);
    case TokenDType::kInt32:
      return Load<int32_t>(p, 0);
    case TokenDType::kUint32:
      return Load<uint32_t>(p, 0);
    case TokenDType::kInt64:
      return Load<int64_t>(p, 0);
  }
  return 0;
}

std::vector<int32_t> TokenFileCorpus::Document(int64_t i) const {
  std::vector<int32_t> doc(lengths_[i]);
  const int64_t start = starts_[i];
  for (int64_t t = 0; t < static_cast<int64_t>(doc.size()); ++t) {
    doc[t] = static_cast<int32_t>(TokenAt(start + t));
  }
  return doc;
}

std::string TokenFileCorpus::Describe() const {
  return absl::StrCat("--data=", path_, " (", TokenFileFormatName(format_), ", ",
                      TokenDTypeName(dtype_), " tokens)");
}

void TokenFileCorpus::AddDocument(int64_t start, int64_t n, int64_t max_len) {
  for (int64_t s = 0; s < n; s += max_len) {
    const int64_t len = std::min(max_len, n - s);
    starts_.push_back(start + s);
    lengths_.push_back(static_cast<int32_t>(len));
    min_len_ = starts_.size() == 1 ? len : std::min(min_len_, len);
    max_len_ = std::max(max_len_, len);
  }
  num_tokens_ += n;
}

absl::Status TokenFileCorpus::ScanAndSplit(int64_t n, int64_t bound, const std::string& file,
                                           int64_t eod, int64_t max_len) {
  ScanProgress progress(file, n);
  int64_t doc = 0;
  for (int64_t chunk = 0; chunk < n; chunk += kScanChunk) {
    const int64_t end = std::min(n, chunk + kScanChunk);
    GRADSUM_RETURN_IF_ERROR(ScanTokens(chunk, end - chunk, bound, file));
    if (eod >= 0) {
      for (int64_t t = chunk; t < end; ++t) {
        if (TokenAt(t) == eod) {
          AddDocument(doc, t + 1 - doc, max_len);
          doc = t + 1;
        }
      }
    }
    progress.Add(end - chunk);
  }
  if (doc < n) AddDocument(doc, n - doc, max_len);
  return absl::OkStatus();
}

absl::Status TokenFileCorpus::ScanTokens(int64_t start, int64_t n, int64_t bound,
                                         const std::string& file) {
  const int size = TokenDTypeBytes(dtype_);
  for (int64_t t = start; t < start + n; ++t) {
    const int64_t v = TokenAt(t);
    if (v < 0 || v >= bound) {
      return Corrupt(file, absl::StrCat("token ", t), data_offset_ + t * size,
                     absl::StrCat("value ", v, " outside [0, ", bound, ")",
                                  bound < kMaxTokenBound ? " (model.vocab)" : ""));
    }
    max_token_ = std::max(max_token_, v);
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckOptions(const TokenFileOptions& o) {
  if (o.max_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_len=", o.max_len, ": must be positive (data.seq_len)"));
  }
  if (o.vocab < 0 || o.vocab > kMaxTokenBound) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab=", o.vocab, ": must be in [0, ", kMaxTokenBound, "]"));
  }
  if (o.flat_dtype != TokenDType::kUint16 && o.flat_dtype != TokenDType::kUint32) {
    return absl::InvalidArgumentError(absl::StrCat("flat_dtype=", TokenDTypeName(o.flat_dtype),
                                                   ": a headerless file is uint16 or uint32"));
  }
  return absl::OkStatus();
}

int64_t Bound(const TokenFileOptions& o) { return o.vocab > 0 ? o.vocab : kMaxTokenBound; }

}  // namespace

absl::StatusOr<std::unique_ptr<TokenFileCorpus>> TokenFileCorpus::OpenMegatron(
    const std::string& prefix, const TokenFileOptions& options) {
  GRADSUM_RETURN_IF_ERROR(CheckOptions(options));
  const std::string idx_name = prefix + ".idx", bin_name = prefix + ".bin";
  auto corpus = std::unique_ptr<TokenFileCorpus>(new TokenFileCorpus());
  corpus->format_ = TokenFileFormat::kMegatron;
  corpus->path_ = prefix;
  GRADSUM_ASSIGN_OR_RETURN(corpus->idx_, Mapping::Open(idx_name));
  GRADSUM_ASSIGN_OR_RETURN(corpus->bin_, Mapping::Open(bin_name));
  const unsigned char* idx = corpus->idx_->data();
  const int64_t idx_size = corpus->idx_->size();
  if (idx_size < kMegatronHeaderBytes) {
    return Corrupt(idx_name, "header", idx_size,
                   absl::StrCat("truncated: the header needs ", kMegatronHeaderBytes,
                                " bytes, the file has ", idx_size));
  }
  if (std::memcmp(idx, kMegatronMagic, sizeof(kMegatronMagic)) != 0) {
    return Corrupt(idx_name, "magic", 0, "not \"MMIDIDX\\0\\0\" (not a Megatron index)");
  }
  const uint64_t version = Load<uint64_t>(idx, 9);
  if (version != 1) {
    return Corrupt(idx_name, "version", 9, absl::StrCat(version, ", expected 1"));
  }
  const uint8_t code = idx[17];
  constexpr TokenDType kCodes[] = {TokenDType::kUint8, TokenDType::kInt8,  TokenDType::kInt16,
                                   TokenDType::kInt32, TokenDType::kInt64, TokenDType::kInt64,
                                   TokenDType::kInt64, TokenDType::kUint16};
  if (code < 1 || code > 8 || code == 6 || code == 7) {
    return Corrupt(
        idx_name, "dtype code", 17,
        absl::StrCat(code, code == 6 || code == 7 ? " (float64 / float32): tokens must be integers"
                                                  : ": not a Megatron dtype code (1 to 8)"));
  }
  corpus->dtype_ = kCodes[code - 1];
  const int itemsize = TokenDTypeBytes(corpus->dtype_);
  const uint64_t S = Load<uint64_t>(idx, 18), D = Load<uint64_t>(idx, 26);
  // Bounded by the file before any product is formed, so nothing below overflows.
  const uint64_t body = static_cast<uint64_t>(idx_size - kMegatronHeaderBytes);
  if (S > body / 12) {
    return Corrupt(idx_name, "sequence count", 18,
                   absl::StrCat(S, " sequences need ", S, " x 12 index bytes, the file has ", body,
                                " after the header (truncated?)"));
  }
  if (D > (body - 12 * S) / 8) {
    return Corrupt(idx_name, "document count", 26,
                   absl::StrCat(D, " document indices need 8 bytes each; ", body - 12 * S,
                                " bytes are left after the sequences (truncated?)"));
  }
  const int64_t lengths_at = kMegatronHeaderBytes;
  const int64_t pointers_at = lengths_at + 4 * static_cast<int64_t>(S);
  const int64_t docs_at = pointers_at + 8 * static_cast<int64_t>(S);
  const int64_t end = docs_at + 8 * static_cast<int64_t>(D);
  if (end != idx_size) {
    return Corrupt(
        idx_name, "end of the document indices", end,
        absl::StrCat(idx_size - end, " trailing bytes (a multimodal index, or a wrong count)"));
  }
  if (D < 2) {
    return Corrupt(idx_name, "document count", 26,
                   absl::StrCat(D, ": the dataset is empty (no document)"));
  }
  const int64_t bin_size = corpus->bin_->size();
  corpus->tokens_ = corpus->bin_->data();
  corpus->data_offset_ = 0;
  // Sequences: a length >= 0 and a pointer, aligned, whose tokens lie inside the .bin.
  for (uint64_t s = 0; s < S; ++s) {
    const int64_t len_at = lengths_at + 4 * static_cast<int64_t>(s);
    const int64_t ptr_at = pointers_at + 8 * static_cast<int64_t>(s);
    const int32_t len = Load<int32_t>(idx, len_at);
    const int64_t ptr = Load<int64_t>(idx, ptr_at);
    if (len < 0) {
      return Corrupt(idx_name, absl::StrCat("length of sequence ", s), len_at,
                     absl::StrCat(len, " is negative"));
    }
    if (ptr < 0 || ptr % itemsize != 0 || ptr > bin_size ||
        static_cast<int64_t>(len) * itemsize > bin_size - ptr) {
      return Corrupt(idx_name, absl::StrCat("pointer of sequence ", s), ptr_at,
                     absl::StrCat("bytes [", ptr, ", ", ptr, " + ", len, " x ", itemsize,
                                  ") are not whole ", TokenDTypeName(corpus->dtype_),
                                  " tokens inside ", bin_name, " (", bin_size, " bytes)"));
    }
  }
  // Documents: indices from 0 to S, never decreasing, over sequences back to back.
  if (Load<int64_t>(idx, docs_at) != 0) {
    return Corrupt(idx_name, "document index 0", docs_at,
                   absl::StrCat(Load<int64_t>(idx, docs_at), ", expected 0"));
  }
  const int64_t last = Load<int64_t>(idx, docs_at + 8 * static_cast<int64_t>(D - 1));
  if (last != static_cast<int64_t>(S)) {
    return Corrupt(idx_name, absl::StrCat("document index ", D - 1),
                   docs_at + 8 * static_cast<int64_t>(D - 1),
                   absl::StrCat(last, ", expected the sequence count ", S));
  }
  const int64_t bound = Bound(options);
  std::unique_ptr<ScanProgress> progress;
  if (options.scan_tokens) progress = std::make_unique<ScanProgress>(bin_name, bin_size / itemsize);
  for (uint64_t d = 0; d + 1 < D; ++d) {
    const int64_t at = docs_at + 8 * static_cast<int64_t>(d + 1);
    const int64_t first = Load<int64_t>(idx, at - 8), next = Load<int64_t>(idx, at);
    if (next < first || next > static_cast<int64_t>(S)) {
      return Corrupt(idx_name, absl::StrCat("document index ", d + 1), at,
                     absl::StrCat(next, " after ", first,
                                  ": document indices must not decrease nor pass the sequence "
                                  "count ",
                                  S));
    }
    if (first == next) continue;  // an empty document
    const int64_t start = Load<int64_t>(idx, pointers_at + 8 * first) / itemsize;
    int64_t n = 0;
    for (int64_t s = first; s < next; ++s) {
      const int64_t ptr = Load<int64_t>(idx, pointers_at + 8 * s);
      if (ptr / itemsize != start + n) {
        return Corrupt(idx_name, absl::StrCat("pointer of sequence ", s), pointers_at + 8 * s,
                       absl::StrCat(ptr, ": sequence ", s, " of document ", d,
                                    " does not follow the previous one in ", bin_name,
                                    " (expected byte ", (start + n) * itemsize, ")"));
      }
      n += Load<int32_t>(idx, lengths_at + 4 * s);
    }
    if (n == 0) continue;
    if (options.scan_tokens) {
      GRADSUM_RETURN_IF_ERROR(corpus->ScanTokens(start, n, bound, bin_name));
      progress->Add(n);
    }
    corpus->AddDocument(start, n, options.max_len);
  }
  if (corpus->starts_.empty()) {
    return Corrupt(idx_name, "sequence lengths", lengths_at,
                   "the dataset is empty (every document has 0 tokens)");
  }
  if (!options.scan_tokens) {
    switch (corpus->dtype_) {
      case TokenDType::kUint8:
        corpus->max_token_ = 255;
        break;
      case TokenDType::kInt8:
        corpus->max_token_ = 127;
        break;
      case TokenDType::kInt16:
        corpus->max_token_ = 32767;
        break;
      case TokenDType::kUint16:
        corpus->max_token_ = 65535;
        break;
      default:
        corpus->max_token_ = kMaxTokenBound - 1;
    }
  }
  corpus->fingerprint_ =
      Fingerprint64(absl::StrCat(corpus->idx_->Fingerprint(), ":", corpus->bin_->Fingerprint()));
  return corpus;
}

namespace {

// The tokens of a headerless or llm.c file: the EOD split, each token checked.
absl::Status CheckEod(const TokenFileOptions& o) {
  if (o.eod_token >= Bound(o)) {
    return absl::InvalidArgumentError(absl::StrCat("eod_token=", o.eod_token, ": must be below ",
                                                   o.vocab > 0 ? "model.vocab=" : "", Bound(o)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenFileCorpus>> TokenFileCorpus::OpenLlmC(
    const std::string& path, const TokenFileOptions& options) {
  GRADSUM_RETURN_IF_ERROR(CheckOptions(options));
  GRADSUM_RETURN_IF_ERROR(CheckEod(options));
  auto corpus = std::unique_ptr<TokenFileCorpus>(new TokenFileCorpus());
  corpus->format_ = TokenFileFormat::kLlmC;
  corpus->path_ = path;
  GRADSUM_ASSIGN_OR_RETURN(corpus->bin_, Mapping::Open(path));
  const unsigned char* bytes = corpus->bin_->data();
  const int64_t size = corpus->bin_->size();
  if (size < kLlmCHeaderBytes) {
    return Corrupt(path, "header", size,
                   absl::StrCat("truncated: the llm.c header needs ", kLlmCHeaderBytes,
                                " bytes, the file has ", size));
  }
  const int32_t magic = Load<int32_t>(bytes, 0), version = Load<int32_t>(bytes, 4);
  const int32_t count = Load<int32_t>(bytes, 8);
  if (magic != kLlmCMagic16 && magic != kLlmCMagic32) {
    return Corrupt(
        path, "magic", 0,
        absl::StrCat(magic, ": not an llm.c shard (", kLlmCMagic16, " or ", kLlmCMagic32, ")"));
  }
  const int32_t expected = magic == kLlmCMagic16 ? kLlmCVersion16 : kLlmCVersion32;
  if (version != expected) {
    return Corrupt(path, "version", 4,
                   absl::StrCat(version, ", expected ", expected, " with magic ", magic));
  }
  corpus->dtype_ = magic == kLlmCMagic16 ? TokenDType::kUint16 : TokenDType::kUint32;
  const int itemsize = TokenDTypeBytes(corpus->dtype_);
  if (count < 0 || (size - kLlmCHeaderBytes) / itemsize != count ||
      (size - kLlmCHeaderBytes) % itemsize != 0) {
    return Corrupt(path, "token count", 8,
                   absl::StrCat(count, " ", TokenDTypeName(corpus->dtype_), " tokens, but ",
                                size - kLlmCHeaderBytes,
                                " bytes follow the header (truncated or wrong count)"));
  }
  if (count == 0) return Corrupt(path, "token count", 8, "0: the shard is empty");
  corpus->data_offset_ = kLlmCHeaderBytes;
  corpus->tokens_ = bytes + kLlmCHeaderBytes;
  GRADSUM_RETURN_IF_ERROR(
      corpus->ScanAndSplit(count, Bound(options), path, options.eod_token, options.max_len));
  corpus->fingerprint_ = corpus->bin_->Fingerprint();
  return corpus;
}

absl::StatusOr<std::unique_ptr<TokenFileCorpus>> TokenFileCorpus::OpenFlat(
    const std::string& path, const TokenFileOptions& options) {
  GRADSUM_RETURN_IF_ERROR(CheckOptions(options));
  GRADSUM_RETURN_IF_ERROR(CheckEod(options));
  auto corpus = std::unique_ptr<TokenFileCorpus>(new TokenFileCorpus());
  corpus->format_ = TokenFileFormat::kFlat;
  corpus->path_ = path;
  corpus->dtype_ = options.flat_dtype;
  GRADSUM_ASSIGN_OR_RETURN(corpus->bin_, Mapping::Open(path));
  const int64_t size = corpus->bin_->size();
  const int itemsize = TokenDTypeBytes(corpus->dtype_);
  if (size == 0) return Corrupt(path, "tokens", 0, "the file is empty");
  if (size % itemsize != 0) {
    return Corrupt(path, "end", size,
                   absl::StrCat("the size is not a whole number of ",
                                TokenDTypeName(corpus->dtype_), " tokens (truncated?)"));
  }
  corpus->tokens_ = corpus->bin_->data();
  GRADSUM_RETURN_IF_ERROR(corpus->ScanAndSplit(size / itemsize, Bound(options), path,
                                               options.eod_token, options.max_len));
  corpus->fingerprint_ = corpus->bin_->Fingerprint();
  return corpus;
}

absl::StatusOr<std::unique_ptr<TokenFileCorpus>> TokenFileCorpus::Open(
    const std::string& path, const TokenFileOptions& options) {
  const std::string prefix = MegatronPrefix(path);
  if (!prefix.empty()) return OpenMegatron(prefix, options);
  // The first int32 tells an llm.c shard; reading it opens the file (its errors name it).
  GRADSUM_ASSIGN_OR_RETURN(ReadOnlyFile file, OpenRegularFile(path));
  int32_t magic = 0;
  if (file.size() >= sizeof(magic) && pread(file.fd(), &magic, sizeof(magic), 0) == 4 &&
      (magic == kLlmCMagic16 || magic == kLlmCMagic32)) {
    return OpenLlmC(path, options);
  }
  return OpenFlat(path, options);
}

bool IsTokenFilePath(const std::string& path) {
  if (!MegatronPrefix(path).empty() || EndsWith(path, ".u16") || EndsWith(path, ".u32")) {
    return true;
  }
  if (!EndsWith(path, ".bin")) return false;
  // A .bin is an llm.c shard only if it says so: a byte text file named .bin stays text, as
  // it was read before token files. Opened non-blocking and only if regular (a FIFO or a
  // device is the text path's to refuse by name).
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st;
  int32_t magic = 0;
  const bool shard = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
                     pread(fd, &magic, sizeof(magic), 0) == sizeof(magic) &&
                     (magic == kLlmCMagic16 || magic == kLlmCMagic32);
  close(fd);
  return shard;
}

TokenDType FlatDTypeOfPath(const std::string& path) {
  return EndsWith(path, ".u32") ? TokenDType::kUint32 : TokenDType::kUint16;
}

}  // namespace gradsum::data
