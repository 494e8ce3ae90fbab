#ifndef GRADSUM_SHARDING_JSON_H_
#define GRADSUM_SHARDING_JSON_H_

// A small, strict JSON reader and writer for the files gradsum owns: safetensors headers
// and checkpoint manifests. No JSON library is available in this build, and these files
// come from disk, so the parser treats its input as untrusted: every malformed input is an
// InvalidArgument naming the byte offset, nesting is capped, and nothing recurses without
// bound.
//
//   absl::StatusOr<JsonValue> v = ParseJson(R"({"a": [1, 2], "b": "x"})");
//   const JsonValue* a = v->Find("a");          // nullptr when absent
//   int64_t first = a->array()[0].as_int();
//
//   JsonValue out = JsonValue::Object();
//   out.Set("rank", JsonValue::Int(3));
//   std::string text = out.Serialize();         // {"rank":3}
//
// Numbers: integers in the int64 range are kept exactly (is_int()); anything else with a
// fraction or exponent is a double. Object keys keep insertion order; a duplicate key is
// an error (safetensors forbids it, and it would make a manifest ambiguous).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsum {

class JsonValue {
 public:
  enum class Type { kNull, kBool, kInt, kDouble, kString, kArray, kObject };

  JsonValue() = default;  // null
  static JsonValue Bool(bool b);
  static JsonValue Int(int64_t i);
  static JsonValue Double(double d);
  static JsonValue String(std::string s);
  static JsonValue Array();
  static JsonValue Object();

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_bool() const { return type_ == Type::kBool; }
  bool is_int() const { return type_ == Type::kInt; }
  bool is_number() const { return type_ == Type::kInt || type_ == Type::kDouble; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }

  // Accessors; the caller checks the type first (wrong type returns a default value).
  bool as_bool() const { return bool_; }
  int64_t as_int() const { return int_; }
  double as_double() const { return type_ == Type::kInt ? static_cast<double>(int_) : double_; }
  const std::string& as_string() const { return string_; }
  const std::vector<JsonValue>& array() const { return array_; }
  const std::vector<std::pair<std::string, JsonValue>>& members() const { return members_; }

  // Object member lookup; nullptr when absent or when this is not an object.
  const JsonValue* Find(absl::string_view key) const;

  // Builders (no effect on the wrong type).
  void Append(JsonValue v);
  void Set(std::string key, JsonValue v);  // replaces an existing key

  // Compact JSON text. Strings are escaped; doubles are written with 17 significant
  // digits so they read back exactly; non-finite doubles are written as null.
  std::string Serialize() const;

 private:
  friend class JsonParser;
  Type type_ = Type::kNull;
  bool bool_ = false;
  int64_t int_ = 0;
  double double_ = 0;
  std::string string_;
  std::vector<JsonValue> array_;
  std::vector<std::pair<std::string, JsonValue>> members_;
};

// Parses one JSON value; leading and trailing whitespace is allowed (safetensors pads its
// header with spaces), anything else after the value is an error. Errors are
// InvalidArgument with the byte offset and what was expected. Nesting deeper than
// `max_depth` is an error (bounds the parser's stack on hostile input).
absl::StatusOr<JsonValue> ParseJson(absl::string_view text, int max_depth = 64);

// Appends `s` as a quoted JSON string to `out`.
void AppendJsonString(absl::string_view s, std::string* out);

}  // namespace gradsum

#endif  // GRADSUM_SHARDING_JSON_H_
