#include "io/proto_json.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/message.h>
#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/type_resolver.h>
#include <google/protobuf/util/type_resolver_util.h>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace gradsum {
namespace {

namespace pb = google::protobuf;

constexpr absl::string_view kTypeUrlPrefix = "type.googleapis.com";

// Resolves the types of the generated messages; built once, read-only after (protobuf's
// own MessageToJsonString shares one the same way).
pb::util::TypeResolver* GeneratedTypes() {
  static pb::util::TypeResolver* const resolver = pb::util::NewTypeResolverForDescriptorPool(
      std::string(kTypeUrlPrefix), pb::DescriptorPool::generated_pool());
  return resolver;
}

using Json = nlohmann::ordered_json;  // keeps the members in protobuf's order

void Int64ToNumbers(const pb::Descriptor* type, Json& object);

// One value of field `f` (an element, for a repeated field): a 64-bit integer written as a
// string becomes a number, a double a JSON float; a message is walked.
void ValueToNumber(const pb::FieldDescriptor* f, Json& value) {
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT64: {
      int64_t v;
      if (value.is_string() && absl::SimpleAtoi(value.get<std::string>(), &v)) value = v;
      return;
    }
    case pb::FieldDescriptor::CPPTYPE_UINT64: {
      uint64_t v;
      if (value.is_string() && absl::SimpleAtoi(value.get<std::string>(), &v)) value = v;
      return;
    }
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
      // The mapping writes 2.0 as 2, which a reader would take for an integer.
      if (value.is_number()) value = value.get<double>();
      return;
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      if (value.is_object()) Int64ToNumbers(f->message_type(), value);
      return;
    default:
      return;
  }
}

// The members of `object`, a message of `type` as the mapping wrote it (proto field names).
void Int64ToNumbers(const pb::Descriptor* type, Json& object) {
  for (auto& [name, value] : object.items()) {
    const pb::FieldDescriptor* f = type->FindFieldByName(name);
    if (f == nullptr) continue;
    if (f->is_map()) {
      const pb::FieldDescriptor* map_value = f->message_type()->map_value();
      for (auto& [key, element] : value.items()) ValueToNumber(map_value, element);
    } else if (f->is_repeated()) {
      for (Json& element : value) ValueToNumber(f, element);
    } else {
      ValueToNumber(f, value);
    }
  }
}

}  // namespace

absl::StatusOr<std::string> ProtoToJson(const pb::Message& message,
                                        const JsonWriteOptions& write_options) {
  // MessageToJsonString would print map entries in hash order; the binary form with
  // deterministic serialization sorts them, and the converter keeps that order.
  std::string binary;
  {
    pb::io::StringOutputStream stream(&binary);
    pb::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    if (!message.SerializeToCodedStream(&coded)) {
      return absl::InternalError(
          absl::StrCat("cannot serialize a ", message.GetDescriptor()->full_name()));
    }
  }
  pb::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  std::string json;
  const pb::util::Status s = pb::util::BinaryToJsonString(
      GeneratedTypes(), absl::StrCat(kTypeUrlPrefix, "/", message.GetDescriptor()->full_name()),
      binary, &json, options);
  if (!s.ok()) {
    return absl::InternalError(absl::StrCat("cannot write a ", message.GetDescriptor()->full_name(),
                                            " as JSON: ", s.message().as_string()));
  }
  if (!write_options.int64_as_numbers) return json;
  // The mapping has no option for numbers: protobuf's text, re-read and rewritten. Parsing
  // protobuf's own output cannot fail; dump() could only throw on invalid UTF-8, which
  // protobuf has refused above.
  Json tree = Json::parse(json, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (tree.is_discarded()) {
    return absl::InternalError(
        absl::StrCat("cannot re-read the JSON of a ", message.GetDescriptor()->full_name()));
  }
  Int64ToNumbers(message.GetDescriptor(), tree);
  return tree.dump();
}

absl::Status ProtoFromJson(absl::string_view text, pb::Message* message,
                           bool ignore_unknown_fields) {
  message->Clear();
  pb::util::JsonParseOptions options;
  options.ignore_unknown_fields = ignore_unknown_fields;
  const pb::util::Status s =
      pb::util::JsonStringToMessage(pb::StringPiece(text.data(), text.size()), message, options);
  if (s.ok()) return absl::OkStatus();
  message->Clear();
  return absl::InvalidArgumentError(absl::StrCat("not a valid ", message->GetDescriptor()->name(),
                                                 " in JSON: ", s.message().as_string()));
}

std::string FirstMissingField(const pb::Message& message) {
  const pb::Descriptor* d = message.GetDescriptor();
  const pb::Reflection* r = message.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    const bool is_message = f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE;
    if (f->is_repeated()) {
      if (!is_message || f->is_map()) continue;
      for (int j = 0; j < r->FieldSize(message, f); ++j) {
        std::string missing = FirstMissingField(r->GetRepeatedMessage(message, f, j));
        if (!missing.empty()) return absl::StrCat(f->name(), "[", j, "].", missing);
      }
      continue;
    }
    if (f->has_presence() && !r->HasField(message, f)) return f->name();
    if (is_message) {
      std::string missing = FirstMissingField(r->GetMessage(message, f));
      if (!missing.empty()) return absl::StrCat(f->name(), ".", missing);
    }
  }
  return "";
}

}  // namespace gradsum
