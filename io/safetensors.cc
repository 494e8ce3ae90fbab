#include "io/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "io/atomic_file.h"

namespace gradsum {
namespace {

// The reference implementation refuses headers above 100 MB; so do we, before allocating.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
constexpr absl::string_view kMetadataKey = "__metadata__";

bool HostIsLittleEndian() {
  const uint16_t one = 1;
  unsigned char first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

struct DTypeNameEntry {
  DType dtype;
  absl::string_view name;
};
constexpr DTypeNameEntry kDTypeNames[] = {
    {DType::kF32, "F32"}, {DType::kF64, "F64"}, {DType::kBF16, "BF16"},
    {DType::kF16, "F16"}, {DType::kI32, "I32"}, {DType::kI64, "I64"},
};
// Valid in the safetensors format but not gradsum dtypes.
constexpr absl::string_view kForeignDTypes[] = {"BOOL", "U8",      "I8",      "U16",     "I16",
                                                "U32",  "U64",     "F8_E4M3", "F8_E5M2", "F8_E8M0",
                                                "F4",   "F6_E2M3", "F6_E3M2"};

// DataLoss "safetensors file '<source>': <parts>", the message of every malformed file.
template <typename... Parts>
absl::Status DataLoss(absl::string_view source, const Parts&... parts) {
  return absl::DataLossError(absl::StrCat("safetensors file '", source, "': ", parts...));
}

// The header is JSON, which holds only UTF-8 text: InvalidArgument naming `what` otherwise.
absl::Status CheckUtf8(absl::string_view what, absl::string_view text) {
  try {
    (void)nlohmann::json(std::string(text)).dump();
  } catch (const nlohmann::json::type_error&) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors ", what, " is not UTF-8"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view SafetensorsDTypeName(DType dtype) {
  for (const auto& e : kDTypeNames) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

absl::Status SafetensorsWriter::Add(absl::string_view name, const TensorView& tensor) {
  if (name.empty()) return absl::InvalidArgumentError("safetensors tensor name is empty");
  if (name == kMetadataKey) {
    return absl::InvalidArgumentError("safetensors tensor name \"__metadata__\" is reserved");
  }
  if (tensor.device().type != Device::kCpu) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors tensor \"", name,
                                                   "\" is not on the CPU: ", tensor.DebugString()));
  }
  if (absl::Status s = CheckUtf8("tensor name", name); !s.ok()) return s;
  if (!tensors_.emplace(std::string(name), tensor).second) {
    return absl::InvalidArgumentError(absl::StrCat("duplicate safetensors tensor \"", name, "\""));
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::AddMetadata(absl::string_view key, absl::string_view value) {
  if (absl::Status s = CheckUtf8(absl::StrCat("metadata key \"", key, "\""), key); !s.ok())
    return s;
  if (absl::Status s = CheckUtf8(absl::StrCat("metadata value of \"", key, "\""), value); !s.ok()) {
    return s;
  }
  if (!metadata_.emplace(std::string(key), std::string(value)).second) {
    return absl::InvalidArgumentError(
        absl::StrCat("duplicate safetensors metadata key \"", key, "\""));
  }
  return absl::OkStatus();
}

std::string SafetensorsWriter::Serialize() const {
  // An ordered_json keeps the members in insertion order: __metadata__ first, then the
  // tensors by name, their data laid out in that order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json& meta = header[std::string(kMetadataKey)];
    meta = nlohmann::ordered_json::object();
    for (const auto& kv : metadata_) meta[kv.first] = kv.second;
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors_) {
    const uint64_t begin = offset;
    offset += t.nbytes();
    header[name] = {{"dtype", std::string(SafetensorsDTypeName(t.dtype()))},
                    {"shape", t.shape()},
                    {"data_offsets", {begin, offset}}};
  }
  // Add and AddMetadata admit only UTF-8, so `replace` never fires: no throw here.
  std::string json = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + json.size() + offset);
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out.append(json);
  for (const auto& [name, t] : tensors_) {
    out.append(static_cast<const char*>(t.raw()), t.nbytes());
  }
  return out;
}

absl::Status SafetensorsWriter::WriteFile(const std::string& path) const {
  if (!HostIsLittleEndian()) {
    return absl::UnimplementedError("safetensors writing needs a little-endian host");
  }
  return WriteFileAtomically(path, Serialize());
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Read(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFileToString(path);
  if (!bytes.ok()) return bytes.status();
  return Parse(*bytes, path);
}

namespace {

// The header text as a JSON object. nlohmann-json parses; the safetensors rules are checked
// by the callers. JSON itself allows duplicate keys (nlohmann keeps the last); a tensor file
// must not, so the parser's callback records them. Deeper values are dropped, not built (a
// header is 3 levels deep; this bounds the memory and the destructor's recursion on a
// hostile header).
absl::StatusOr<nlohmann::json> ParseHeaderJson(absl::string_view header_text,
                                               absl::string_view source) {
  auto loss = [&](auto&&... parts) { return DataLoss(source, parts...); };
  constexpr int kMaxDepth = 16;
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  bool too_deep = false;
  const nlohmann::json::parser_callback_t on_event = [&](int depth,
                                                         nlohmann::json::parse_event_t event,
                                                         nlohmann::json& parsed) {
    if (depth > kMaxDepth) {
      too_deep = true;
      return false;
    }
    switch (event) {
      case nlohmann::json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case nlohmann::json::parse_event_t::key:
        if (!open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      case nlohmann::json::parse_event_t::object_end:
        open_objects.pop_back();
        break;
      default:
        break;
    }
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(header_text.begin(), header_text.end(), on_event);
  } catch (const nlohmann::json::exception& e) {
    return loss("bad header: ", e.what());
  }
  if (too_deep) return loss("bad header: nesting deeper than ", kMaxDepth);
  if (!duplicate.empty()) return loss("bad header: duplicate key \"", duplicate, "\"");
  if (!header.is_object()) return loss("header is not a JSON object");
  return header;
}

// A JSON integer that fits int64_t and is >= 0.
bool NonNegative(const nlohmann::json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return false;
    *out = static_cast<int64_t>(v.get<uint64_t>());
    return true;
  }
  if (!v.is_number_integer() || v.get<int64_t>() < 0) return false;
  *out = v.get<int64_t>();
  return true;
}

// The "__metadata__" entry: an object of strings, into *metadata.
absl::Status ParseMetadata(const nlohmann::json& value, absl::string_view source,
                           std::map<std::string, std::string>* metadata) {
  auto loss = [&](auto&&... parts) { return DataLoss(source, parts...); };
  if (!value.is_object()) return loss("\"__metadata__\" is not an object");
  for (const auto& [k, v] : value.items()) {
    if (!v.is_string()) return loss("metadata value for \"", k, "\" is not a string");
    (*metadata)[k] = v.get<std::string>();
  }
  return absl::OkStatus();
}

// Tensor `name`'s entry: a known dtype, a shape of non-negative integers, data_offsets
// inside the data buffer of `data_size` bytes that hold exactly the shape's bytes.
absl::StatusOr<SafetensorsTensorRange> ParseTensorEntry(const std::string& name,
                                                        const nlohmann::json& value,
                                                        uint64_t data_size,
                                                        absl::string_view source) {
  auto loss = [&](auto&&... parts) { return DataLoss(source, parts...); };
  if (name.empty()) return loss("a tensor has an empty name");
  if (!value.is_object()) return loss("entry \"", name, "\" is not an object");
  const auto dtype_v = value.find("dtype");
  const auto shape_v = value.find("shape");
  const auto offsets_v = value.find("data_offsets");
  if (dtype_v == value.end() || !dtype_v->is_string()) {
    return loss("tensor \"", name, "\" has no string \"dtype\"");
  }
  if (shape_v == value.end() || !shape_v->is_array()) {
    return loss("tensor \"", name, "\" has no array \"shape\"");
  }
  if (offsets_v == value.end() || !offsets_v->is_array() || offsets_v->size() != 2) {
    return loss("tensor \"", name, "\" has no two-element \"data_offsets\"");
  }
  const std::string dtype_name = dtype_v->get<std::string>();
  SafetensorsTensorRange entry;
  bool known = false;
  for (const auto& e : kDTypeNames) {
    if (e.name == dtype_name) {
      entry.dtype = e.dtype;
      known = true;
    }
  }
  if (!known) {
    for (absl::string_view foreign : kForeignDTypes) {
      if (foreign == dtype_name) {
        return absl::UnimplementedError(absl::StrCat("safetensors file '", source, "': tensor \"",
                                                     name, "\" has dtype ", foreign,
                                                     ", which gradsum does not support"));
      }
    }
    return loss("tensor \"", name, "\" has unknown dtype \"", dtype_name, "\"");
  }
  for (const nlohmann::json& d : *shape_v) {
    int64_t dim = 0;
    if (!NonNegative(d, &dim)) {
      return loss("tensor \"", name, "\" has a shape entry that is not a non-negative integer");
    }
    entry.shape.push_back(dim);
  }
  absl::StatusOr<int64_t> numel = NumElements(entry.shape);
  if (!numel.ok()) return loss("tensor \"", name, "\": ", numel.status().message());
  int64_t b = 0, e = 0;
  if (!NonNegative((*offsets_v)[0], &b) || !NonNegative((*offsets_v)[1], &e) || e < b) {
    return loss("tensor \"", name, "\" has invalid data_offsets");
  }
  const uint64_t begin = static_cast<uint64_t>(b);
  const uint64_t end = static_cast<uint64_t>(e);
  if (end > data_size) {
    return loss("tensor \"", name, "\" data_offsets [", begin, ", ", end,
                ") run past the data buffer of ", data_size, " bytes (truncated?)");
  }
  const uint64_t elem = DTypeSize(entry.dtype);
  if (static_cast<uint64_t>(*numel) > data_size / elem ||
      static_cast<uint64_t>(*numel) * elem != end - begin) {
    return loss("tensor \"", name, "\" has ", end - begin, " bytes but shape [",
                absl::StrJoin(entry.shape, ","), "] of ", dtype_name, " needs ",
                static_cast<uint64_t>(*numel) * elem);
  }
  entry.begin = begin;
  entry.end = end;
  return entry;
}

// One tensor's bytes [begin, end) of the data buffer.
struct ByteSpan {
  uint64_t begin, end;
  const std::string* name;
};

// Tensors must tile the buffer exactly: no overlap (aliasing) and no hole (hidden bytes).
absl::Status CheckSpansTileBuffer(std::vector<ByteSpan> spans, uint64_t data_size,
                                  absl::string_view source) {
  auto loss = [&](auto&&... parts) { return DataLoss(source, parts...); };
  std::sort(spans.begin(), spans.end(), [](const ByteSpan& a, const ByteSpan& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const std::string* previous = nullptr;
  for (const ByteSpan& s : spans) {
    if (s.begin < cursor) {
      return loss("tensors \"", *previous, "\" and \"", *s.name, "\" overlap at byte ", s.begin);
    }
    if (s.begin > cursor)
      return loss("data bytes [", cursor, ", ", s.begin, ") belong to no tensor");
    cursor = s.end;
    previous = s.name;
  }
  if (cursor != data_size) {
    return loss("data buffer has ", data_size, " bytes but the tensors cover ", cursor);
  }
  return absl::OkStatus();
}

// Parses and validates a header (the JSON text) for a data buffer of `data_size` bytes:
// every rule of the format, and that the tensors tile the buffer.
absl::Status ParseHeader(absl::string_view header_text, uint64_t data_size,
                         absl::string_view source,
                         std::map<std::string, SafetensorsTensorRange, std::less<>>* tensors,
                         std::map<std::string, std::string>* metadata) {
  absl::StatusOr<nlohmann::json> header = ParseHeaderJson(header_text, source);
  if (!header.ok()) return header.status();
  std::vector<ByteSpan> spans;
  for (const auto& [name, value] : header->items()) {
    if (name == kMetadataKey) {
      GRADSUM_RETURN_IF_ERROR(ParseMetadata(value, source, metadata));
      continue;
    }
    absl::StatusOr<SafetensorsTensorRange> entry = ParseTensorEntry(name, value, data_size, source);
    if (!entry.ok()) return entry.status();
    const uint64_t begin = entry->begin, end = entry->end;
    auto inserted = tensors->emplace(name, *std::move(entry));
    spans.push_back({begin, end, &inserted.first->first});
  }
  return CheckSpansTileBuffer(std::move(spans), data_size, source);
}

// The 8-byte little-endian header length at `bytes`.
uint64_t HeaderLength(const char* bytes) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  return n;
}

// The header length field `header_len` of a file with `after` bytes after the field.
absl::Status CheckHeaderLength(uint64_t header_len, uint64_t after, absl::string_view source) {
  auto loss = [&](auto&&... parts) { return DataLoss(source, parts...); };
  if (header_len > after) {
    return loss("header length ", header_len, " exceeds the ", after,
                " bytes after the length field (truncated or corrupt)");
  }
  if (header_len > kMaxHeaderBytes) {
    return loss("header length ", header_len, " exceeds the limit ", kMaxHeaderBytes);
  }
  if (header_len < 2) return loss("header length ", header_len, " is too short for JSON");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(absl::string_view bytes,
                                                       absl::string_view source) {
  auto loss = [&](auto&&... parts) { return DataLoss(source, parts...); };
  if (!HostIsLittleEndian()) {
    return absl::UnimplementedError("safetensors reading needs a little-endian host");
  }
  if (bytes.size() < 8) {
    return loss("truncated: ", bytes.size(), " bytes, fewer than the 8-byte header length");
  }
  const uint64_t header_len = HeaderLength(bytes.data());
  GRADSUM_RETURN_IF_ERROR(CheckHeaderLength(header_len, bytes.size() - 8, source));
  const absl::string_view data = bytes.substr(8 + header_len);
  std::map<std::string, SafetensorsTensorRange, std::less<>> ranges;
  SafetensorsFile file;
  file.source_ = std::string(source);
  GRADSUM_RETURN_IF_ERROR(
      ParseHeader(bytes.substr(8, header_len), data.size(), source, &ranges, &file.metadata_));
  for (auto& [name, r] : ranges) {
    Entry entry;
    entry.dtype = r.dtype;
    entry.shape = std::move(r.shape);
    entry.storage = std::make_shared<std::vector<uint64_t>>((r.end - r.begin + 7) / 8);
    if (r.end > r.begin) std::memcpy(entry.storage->data(), data.data() + r.begin, r.end - r.begin);
    file.tensors_.emplace(name, std::move(entry));
  }
  return file;
}

absl::StatusOr<SafetensorsHeader> SafetensorsHeader::Read(const std::string& path) {
  auto loss = [&](auto&&... parts) { return DataLoss(path, parts...); };
  if (!HostIsLittleEndian()) {
    return absl::UnimplementedError("safetensors reading needs a little-endian host");
  }
  SafetensorsHeader h;
  h.path_ = path;
  GRADSUM_ASSIGN_OR_RETURN(ReadOnlyFile file, OpenRegularFile(path));
  h.file_bytes_ = file.size();
  h.file_ = std::make_shared<ReadOnlyFile>(std::move(file));
  if (h.file_bytes_ < 8) {
    return loss("truncated: ", h.file_bytes_, " bytes, fewer than the 8-byte header length");
  }
  char length[8];
  GRADSUM_RETURN_IF_ERROR(h.ReadAt(0, 8, length));
  const uint64_t header_len = HeaderLength(length);
  GRADSUM_RETURN_IF_ERROR(CheckHeaderLength(header_len, h.file_bytes_ - 8, path));
  std::string header(header_len, '\0');
  GRADSUM_RETURN_IF_ERROR(h.ReadAt(8, header_len, &header[0]));
  h.data_begin_ = 8 + header_len;
  GRADSUM_RETURN_IF_ERROR(
      ParseHeader(header, h.file_bytes_ - h.data_begin_, path, &h.tensors_, &h.metadata_));
  return h;
}

absl::Status SafetensorsHeader::ReadAt(uint64_t offset, uint64_t n, void* out) const {
  char* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = ::pread(file_->fd(), p, n, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("read '", path_, "'"));
    }
    if (got == 0) {
      return DataLoss(path_, "ends at byte ", offset, ", before its header says (truncated)");
    }
    p += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::StatusOr<const SafetensorsTensorRange*> SafetensorsHeader::Find(
    absl::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no tensor \"", name, "\" in safetensors file '", path_, "'"));
  }
  return &it->second;
}

absl::Status SafetensorsHeader::ReadTensorBytes(absl::string_view name, uint64_t offset, uint64_t n,
                                                void* out) const {
  GRADSUM_ASSIGN_OR_RETURN(const SafetensorsTensorRange* t, Find(name));
  if (offset > t->end - t->begin || n > t->end - t->begin - offset) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", ", offset + n, ") of tensor \"",
                                              name, "\" in '", path_, "', which has ",
                                              t->end - t->begin));
  }
  return ReadAt(data_begin_ + t->begin + offset, n, out);
}

std::vector<std::string> SafetensorsHeader::names() const {
  std::vector<std::string> out;
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

bool SafetensorsFile::Contains(absl::string_view name) const {
  return tensors_.find(name) != tensors_.end();
}

absl::StatusOr<TensorView> SafetensorsFile::Get(absl::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no tensor \"", name, "\" in safetensors file '", source_, "'"));
  }
  return TensorView::Create(it->second.storage->data(), it->second.dtype, it->second.shape);
}

}  // namespace gradsum
