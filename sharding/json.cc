#include "sharding/json.h"

#include <cmath>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace gradsum {

JsonValue JsonValue::Bool(bool b) {
  JsonValue v;
  v.type_ = Type::kBool;
  v.bool_ = b;
  return v;
}
JsonValue JsonValue::Int(int64_t i) {
  JsonValue v;
  v.type_ = Type::kInt;
  v.int_ = i;
  return v;
}
JsonValue JsonValue::Double(double d) {
  JsonValue v;
  v.type_ = Type::kDouble;
  v.double_ = d;
  return v;
}
JsonValue JsonValue::String(std::string s) {
  JsonValue v;
  v.type_ = Type::kString;
  v.string_ = std::move(s);
  return v;
}
JsonValue JsonValue::Array() {
  JsonValue v;
  v.type_ = Type::kArray;
  return v;
}
JsonValue JsonValue::Object() {
  JsonValue v;
  v.type_ = Type::kObject;
  return v;
}

const JsonValue* JsonValue::Find(absl::string_view key) const {
  if (type_ != Type::kObject) return nullptr;
  for (const auto& m : members_) {
    if (m.first == key) return &m.second;
  }
  return nullptr;
}

void JsonValue::Append(JsonValue v) {
  if (type_ == Type::kArray) array_.push_back(std::move(v));
}

void JsonValue::Set(std::string key, JsonValue v) {
  if (type_ != Type::kObject) return;
  for (auto& m : members_) {
    if (m.first == key) {
      m.second = std::move(v);
      return;
    }
  }
  members_.emplace_back(std::move(key), std::move(v));
}

void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(out, "\\u%04x", c);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

namespace {

void SerializeTo(const JsonValue& v, std::string* out) {
  switch (v.type()) {
    case JsonValue::Type::kNull: out->append("null"); break;
    case JsonValue::Type::kBool: out->append(v.as_bool() ? "true" : "false"); break;
    case JsonValue::Type::kInt: absl::StrAppend(out, v.as_int()); break;
    case JsonValue::Type::kDouble:
      if (std::isfinite(v.as_double())) {
        absl::StrAppendFormat(out, "%.17g", v.as_double());
      } else {
        out->append("null");
      }
      break;
    case JsonValue::Type::kString: AppendJsonString(v.as_string(), out); break;
    case JsonValue::Type::kArray: {
      out->push_back('[');
      bool first = true;
      for (const JsonValue& e : v.array()) {
        if (!first) out->push_back(',');
        first = false;
        SerializeTo(e, out);
      }
      out->push_back(']');
      break;
    }
    case JsonValue::Type::kObject: {
      out->push_back('{');
      bool first = true;
      for (const auto& m : v.members()) {
        if (!first) out->push_back(',');
        first = false;
        AppendJsonString(m.first, out);
        out->push_back(':');
        SerializeTo(m.second, out);
      }
      out->push_back('}');
      break;
    }
  }
}

}  // namespace

std::string JsonValue::Serialize() const {
  std::string out;
  SerializeTo(*this, &out);
  return out;
}

// Recursive descent over untrusted bytes. Every read checks `pos_ < text_.size()`.
class JsonParser {
 public:
  JsonParser(absl::string_view text, int max_depth) : text_(text), max_depth_(max_depth) {}

  absl::StatusOr<JsonValue> ParseDocument() {
    JsonValue v;
    absl::Status s = ParseValue(0, &v);
    if (!s.ok()) return s;
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected data after the JSON value");
    return v;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("JSON error at byte ", pos_, ": ", what));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(absl::string_view literal) {
    if (text_.substr(pos_, literal.size()) == literal) {
      pos_ += literal.size();
      return true;
    }
    return false;
  }

  absl::Status ParseValue(int depth, JsonValue* out) {
    if (depth > max_depth_) return Error(absl::StrCat("nesting deeper than ", max_depth_));
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end of input, expected a value");
    const char c = text_[pos_];
    if (c == '{') return ParseObject(depth, out);
    if (c == '[') return ParseArray(depth, out);
    if (c == '"') {
      out->type_ = JsonValue::Type::kString;
      return ParseString(&out->string_);
    }
    if (c == '-' || (c >= '0' && c <= '9')) return ParseNumber(out);
    if (Consume("true")) {
      *out = JsonValue::Bool(true);
      return absl::OkStatus();
    }
    if (Consume("false")) {
      *out = JsonValue::Bool(false);
      return absl::OkStatus();
    }
    if (Consume("null")) {
      *out = JsonValue();
      return absl::OkStatus();
    }
    return Error(absl::StrFormat("unexpected character 0x%02x", static_cast<unsigned char>(c)));
  }

  absl::Status ParseObject(int depth, JsonValue* out) {
    *out = JsonValue::Object();
    ++pos_;  // '{'
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == '}') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a string key");
      std::string key;
      absl::Status s = ParseString(&key);
      if (!s.ok()) return s;
      if (out->Find(key) != nullptr) return Error(absl::StrCat("duplicate key \"", key, "\""));
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      JsonValue value;
      s = ParseValue(depth + 1, &value);
      if (!s.ok()) return s;
      out->members_.emplace_back(std::move(key), std::move(value));
      SkipSpace();
      if (pos_ >= text_.size()) return Error("unexpected end of input in an object");
      if (text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (text_[pos_] == '}') {
        ++pos_;
        return absl::OkStatus();
      }
      return Error("expected ',' or '}'");
    }
  }

  absl::Status ParseArray(int depth, JsonValue* out) {
    *out = JsonValue::Array();
    ++pos_;  // '['
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == ']') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      JsonValue value;
      absl::Status s = ParseValue(depth + 1, &value);
      if (!s.ok()) return s;
      out->array_.push_back(std::move(value));
      SkipSpace();
      if (pos_ >= text_.size()) return Error("unexpected end of input in an array");
      if (text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (text_[pos_] == ']') {
        ++pos_;
        return absl::OkStatus();
      }
      return Error("expected ',' or ']'");
    }
  }

  absl::Status ParseHex4(uint32_t* out) {
    if (text_.size() - pos_ < 4) return Error("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = text_[pos_ + i];
      v <<= 4;
      if (h >= '0' && h <= '9') {
        v |= static_cast<uint32_t>(h - '0');
      } else if (h >= 'a' && h <= 'f') {
        v |= static_cast<uint32_t>(h - 'a' + 10);
      } else if (h >= 'A' && h <= 'F') {
        v |= static_cast<uint32_t>(h - 'A' + 10);
      } else {
        return Error("bad hex digit in \\u escape");
      }
    }
    pos_ += 4;
    *out = v;
    return absl::OkStatus();
  }

  static void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
      out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
  }

  absl::Status ParseString(std::string* out) {
    ++pos_;  // opening quote
    out->clear();
    while (true) {
      if (pos_ >= text_.size()) return Error("unterminated string");
      const unsigned char c = static_cast<unsigned char>(text_[pos_]);
      if (c == '"') {
        ++pos_;
        return absl::OkStatus();
      }
      if (c < 0x20) return Error("control character in a string");
      if (c != '\\') {
        out->push_back(static_cast<char>(c));
        ++pos_;
        continue;
      }
      ++pos_;
      if (pos_ >= text_.size()) return Error("unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t cp = 0;
          absl::Status s = ParseHex4(&cp);
          if (!s.ok()) return s;
          if (cp >= 0xdc00 && cp <= 0xdfff) return Error("unpaired low surrogate");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (!Consume("\\u")) return Error("unpaired high surrogate");
            uint32_t lo = 0;
            s = ParseHex4(&lo);
            if (!s.ok()) return s;
            if (lo < 0xdc00 || lo > 0xdfff) return Error("bad low surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          AppendUtf8(cp, out);
          break;
        }
        default: return Error(absl::StrFormat("bad escape '\\%c'", e));
      }
    }
  }

  static bool IsDigit(char c) { return c >= '0' && c <= '9'; }

  absl::Status ParseNumber(JsonValue* out) {
    const size_t start = pos_;
    if (text_[pos_] == '-') ++pos_;
    if (pos_ >= text_.size() || !IsDigit(text_[pos_])) return Error("expected a digit");
    if (text_[pos_] == '0') {
      ++pos_;
    } else {
      while (pos_ < text_.size() && IsDigit(text_[pos_])) ++pos_;
    }
    bool integral = true;
    if (pos_ < text_.size() && text_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (pos_ >= text_.size() || !IsDigit(text_[pos_])) return Error("expected a digit after '.'");
      while (pos_ < text_.size() && IsDigit(text_[pos_])) ++pos_;
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (pos_ >= text_.size() || !IsDigit(text_[pos_])) return Error("expected an exponent");
      while (pos_ < text_.size() && IsDigit(text_[pos_])) ++pos_;
    }
    const std::string token(text_.substr(start, pos_ - start));
    if (integral) {
      // Exact int64 when it fits; a larger integer becomes a double (callers that need
      // an integer then reject it as not is_int()).
      const bool negative = token[0] == '-';
      uint64_t magnitude = 0;
      bool overflow = false;
      for (size_t i = negative ? 1 : 0; i < token.size(); ++i) {
        const uint64_t d = static_cast<uint64_t>(token[i] - '0');
        if (magnitude > (std::numeric_limits<uint64_t>::max() - d) / 10) {
          overflow = true;
          break;
        }
        magnitude = magnitude * 10 + d;
      }
      const uint64_t limit = negative ? uint64_t{1} << 63 : (uint64_t{1} << 63) - 1;
      if (!overflow && magnitude <= limit) {
        *out = JsonValue::Int(negative ? static_cast<int64_t>(0 - magnitude)
                                       : static_cast<int64_t>(magnitude));
        return absl::OkStatus();
      }
    }
    // SimpleAtod is locale-independent ('.' is the decimal point whatever the locale).
    double d = 0;
    if (!absl::SimpleAtod(token, &d)) return Error(absl::StrCat("bad number ", token));
    *out = JsonValue::Double(d);
    return absl::OkStatus();
  }

  absl::string_view text_;
  size_t pos_ = 0;
  int max_depth_;
};

absl::StatusOr<JsonValue> ParseJson(absl::string_view text, int max_depth) {
  return JsonParser(text, max_depth).ParseDocument();
}

}  // namespace gradsum
