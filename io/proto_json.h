#ifndef GRADSUM_IO_PROTO_JSON_H_
#define GRADSUM_IO_PROTO_JSON_H_

// The JSON files gradsum defines (checkpoint manifests and commit markers,
// checkpoint/checkpoint.proto; the --metrics records, train/metrics.proto) are protobuf
// messages in the proto3 JSON mapping, written and read by protobuf's own JSON code
// (google/protobuf/util/json_util.h).
//
//   GRADSUM_ASSIGN_OR_RETURN(std::string text, ProtoToJson(manifest));
//   GRADSUM_RETURN_IF_ERROR(ProtoFromJson(text, &manifest));
//   if (std::string f = FirstMissingField(manifest); !f.empty()) ...  // "groups[0].numel"
//
// What the mapping means for readers of these files: members carry the proto field names;
// int64 and uint64 values are JSON strings ("step": "1000"; the parser takes numbers
// too), int32 and double values are numbers; a non-finite double is the string "NaN",
// "Infinity" or "-Infinity". Files that tools read as data (the --metrics JSONL) take
// JsonWriteOptions::int64_as_numbers instead: 64-bit integers as JSON numbers.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace gradsum {

struct JsonWriteOptions {
  // Write int64 and uint64 values as JSON numbers ("valid_tokens":4096), not the mapping's
  // strings: for data that pandas, jq or a plotting script reads as numbers. ProtoFromJson
  // reads either. Doubles are then written by nlohmann-json, always with a decimal point or
  // an exponent ("2.0", "1e-05"), so a reader sees floats where the message has doubles
  // (the mapping would write 2.0 as 2); the values are the same doubles.
  bool int64_as_numbers = false;
};

// Compact JSON of `message` on one line: members in field-number order, map keys sorted
// (protobuf's deterministic serialization), so equal messages give equal bytes; fields
// with presence are written when set, also at their default value. Internal if protobuf
// cannot print it (a string field that is not UTF-8, say).
absl::StatusOr<std::string> ProtoToJson(const google::protobuf::Message& message,
                                        const JsonWriteOptions& options = {});

// Parses `text` into `message` (cleared first). Malformed JSON, a member of the wrong type
// or out of range, a repeated member, or a member the message does not define (unless
// `ignore_unknown_fields`) is InvalidArgument with protobuf's description, which names the
// member.
absl::Status ProtoFromJson(absl::string_view text, google::protobuf::Message* message,
                           bool ignore_unknown_fields = false);

// The path of the first singular field with presence that is not set, depth first in
// field order ("groups[1].params[0].offset"); "" when every such field is set. Messages
// whose every field is `optional` are complete exactly when this is "".
std::string FirstMissingField(const google::protobuf::Message& message);

}  // namespace gradsum

#endif  // GRADSUM_IO_PROTO_JSON_H_
