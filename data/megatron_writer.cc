#include "data/megatron_writer.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "io/atomic_file.h"

namespace gradsum::data {

namespace {

// The .idx dtype code of `t` (data/token_files.h lists them).
int DTypeCode(TokenDType t) {
  switch (t) {
    case TokenDType::kUint8:
      return 1;
    case TokenDType::kInt8:
      return 2;
    case TokenDType::kInt16:
      return 3;
    case TokenDType::kInt32:
      return 4;
    case TokenDType::kInt64:
      return 5;
    case TokenDType::kUint16:
      return 8;
    case TokenDType::kUint32:
      break;
  }
  return 0;
}

int64_t DTypeMax(TokenDType t) {
  switch (t) {
    case TokenDType::kUint8:
      return 255;
    case TokenDType::kInt8:
      return 127;
    case TokenDType::kInt16:
      return 32767;
    case TokenDType::kUint16:
      return 65535;
    default:
      return std::numeric_limits<int32_t>::max();
  }
}

template <typename T>
void Append(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

}  // namespace

TokenDType MegatronDTypeForVocab(int64_t vocab) {
  return vocab < 65500 ? TokenDType::kUint16 : TokenDType::kInt32;
}

absl::StatusOr<MegatronWriter> MegatronWriter::Create(const std::string& prefix, TokenDType dtype) {
  if (DTypeCode(dtype) == 0 || dtype == TokenDType::kInt8) {
    return absl::InvalidArgumentError(absl::StrCat("dtype ", TokenDTypeName(dtype),
                                                   ": a Megatron dataset written here holds "
                                                   "uint8, int16, uint16, int32 or int64"));
  }
  MegatronWriter writer;
  writer.prefix_ = prefix;
  writer.dtype_ = dtype;
  const std::string tmp = prefix + ".bin.tmp";
  writer.bin_ = std::fopen(tmp.c_str(), "wb");
  if (writer.bin_ == nullptr) return ErrnoStatus(errno, absl::StrCat("cannot create ", tmp));
  return writer;
}

MegatronWriter::MegatronWriter(MegatronWriter&& o) noexcept { *this = std::move(o); }

MegatronWriter& MegatronWriter::operator=(MegatronWriter&& o) noexcept {
  if (this != &o) {
    prefix_ = std::move(o.prefix_);
    dtype_ = o.dtype_;
    bin_ = std::exchange(o.bin_, nullptr);
    lengths_ = std::move(o.lengths_);
    tokens_ = o.tokens_;
    buffer_ = std::move(o.buffer_);
  }
  return *this;
}

MegatronWriter::~MegatronWriter() {
  if (bin_ != nullptr) {
    std::fclose(bin_);
    std::remove((prefix_ + ".bin.tmp").c_str());
  }
}

absl::Status MegatronWriter::AddDocument(const std::vector<int32_t>& tokens) {
  if (bin_ == nullptr) return absl::FailedPreconditionError(prefix_ + ": writer is finished");
  if (tokens.empty() || tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(prefix_, ": document ", documents(), " has ",
                                                   tokens.size(), " tokens (1 to 2^31 - 1)"));
  }
  const int size = TokenDTypeBytes(dtype_);
  const int64_t max = DTypeMax(dtype_);
  buffer_.resize(tokens.size() * size);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t t = tokens[i];
    if (t < 0 || t > max) {
      return absl::InvalidArgumentError(absl::StrCat(prefix_, ": document ", documents(), " token ",
                                                     i, " = ", t, " does not fit ",
                                                     TokenDTypeName(dtype_)));
    }
    // Little-endian (the host's, static_assert in data/token_files.cc): the low bytes.
    std::memcpy(buffer_.data() + i * size, &t, size);
  }
  if (std::fwrite(buffer_.data(), 1, buffer_.size(), bin_) != buffer_.size()) {
    return ErrnoStatus(errno, absl::StrCat("cannot write ", prefix_, ".bin.tmp"));
  }
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  tokens_ += static_cast<int64_t>(tokens.size());
  return absl::OkStatus();
}

absl::Status MegatronWriter::Finish() {
  if (bin_ == nullptr) return absl::FailedPreconditionError(prefix_ + ": writer is finished");
  const std::string tmp = prefix_ + ".bin.tmp";
  const bool flushed = std::fflush(bin_) == 0;
  const int err = errno;
  std::fclose(bin_);
  bin_ = nullptr;
  if (!flushed) {
    std::remove(tmp.c_str());
    return ErrnoStatus(err, absl::StrCat("cannot write ", tmp));
  }
  const uint64_t s = lengths_.size();
  std::string idx("MMIDIDX\0\0", 9);
  Append<uint64_t>(idx, 1);
  Append<uint8_t>(idx, static_cast<uint8_t>(DTypeCode(dtype_)));
  Append<uint64_t>(idx, s);
  Append<uint64_t>(idx, s + 1);
  for (int32_t len : lengths_) Append<int32_t>(idx, len);
  int64_t pointer = 0;
  for (int32_t len : lengths_) {
    Append<int64_t>(idx, pointer);
    pointer += int64_t{len} * TokenDTypeBytes(dtype_);
  }
  for (uint64_t d = 0; d <= s; ++d) Append<int64_t>(idx, static_cast<int64_t>(d));
  if (std::rename(tmp.c_str(), (prefix_ + ".bin").c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    return ErrnoStatus(e, absl::StrCat("cannot rename ", tmp, " to ", prefix_, ".bin"));
  }
  return WriteFileAtomically(prefix_ + ".idx", idx);
}

}  // namespace gradsum::data
