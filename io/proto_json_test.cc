#include "io/proto_json.h"

#include <cmath>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "io/proto_json_test.pb.h"

namespace gradsum {
namespace {

using ::testing::HasSubstr;
namespace pt = ::gradsum::io_test;

pt::Marker SmallMarker() {
  pt::Marker m;
  m.set_format("f");
  m.set_version(0);  // set at its default: still written
  m.set_world(1);
  m.set_step(int64_t{1} << 40);
  pt::Files* r = m.add_ranks();
  r->set_manifest("00000000000000ff");
  r->set_tensors("0123456789abcdef");
  // Inserted out of order: written sorted.
  (*m.mutable_extra())["zeta"] = "quote \" backslash \\ newline \n";
  (*m.mutable_extra())["alpha"] = "caf\xc3\xa9";
  return m;
}

// The expected text is written out by hand from the proto3 JSON mapping: proto field names,
// int64 as a string, field-number order, map keys sorted, JSON escapes.
TEST(ProtoJsonTest, WritesTheProto3MappingCompactAndDeterministic) {
  absl::StatusOr<std::string> json = ProtoToJson(SmallMarker());
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(*json,
            "{\"format\":\"f\",\"version\":0,\"world\":1,\"step\":\"1099511627776\","
            "\"ranks\":[{\"manifest\":\"00000000000000ff\",\"tensors\":\"0123456789abcdef\"}],"
            "\"extra\":{\"alpha\":\"caf\xc3\xa9\",\"zeta\":\"quote \\\" backslash \\\\ newline "
            "\\n\"}}");
}

TEST(ProtoJsonTest, ReadsWhatItWritesAndInt64AsNumberOrString) {
  const pt::Marker want = SmallMarker();
  absl::StatusOr<std::string> json = ProtoToJson(want);
  ASSERT_TRUE(json.ok());
  pt::Marker got;
  ASSERT_TRUE(ProtoFromJson(*json, &got).ok());
  // Field by field (a map's wire order is unspecified, so byte strings may differ).
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(got, want))
      << got.DebugString() << "\nwant\n"
      << want.DebugString();
  EXPECT_TRUE(got.has_version());  // presence survives a zero
  for (const char* text : {R"({"step": 1099511627776})", R"( {"step":"1099511627776"} )"}) {
    ASSERT_TRUE(ProtoFromJson(text, &got).ok()) << text;
    EXPECT_EQ(got.step(), int64_t{1} << 40) << text;
    EXPECT_FALSE(got.has_world()) << "cleared before parsing";
  }
}

TEST(ProtoJsonTest, MalformedInputIsInvalidArgumentNamingTheMember) {
  struct Case {
    const char* text;
    const char* needle;
  };
  for (const Case& c : {
           Case{R"({"step": 1.5})", "step"},
           Case{R"({"step": "99999999999999999999"})", "step"},
           Case{R"({"world": "two"})", "world"},
           Case{R"({"world": 4294967296})", "world"},
           Case{R"({"ranks": [{"manifest": "a"}, 3]})", "ranks[1]"},
           Case{R"({"extra": {"a": 1}})", "extra"},
           Case{R"({"extra": {"a": "1", "a": "2"}})", "a"},
           Case{R"({"step": "1", "step": "2"})", "step"},
           Case{R"({"format": "f", "bogus": 1})", "bogus"},
           Case{"[1, 2]", "message"},
           Case{"{\"format\"", "Expected"},
           Case{"\x01\x02{{{", "Expected"},
           Case{"", ""},
       }) {
    pt::Marker m;
    absl::Status s = ProtoFromJson(c.text, &m);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.text << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("not a valid Marker in JSON: ")) << c.text;
    EXPECT_THAT(s.message(), HasSubstr(c.needle)) << c.text;
  }
  pt::Marker m;
  EXPECT_TRUE(ProtoFromJson(R"({"format": "f", "bogus": {"x": [1]}})", &m,
                            /*ignore_unknown_fields=*/true)
                  .ok());
  EXPECT_EQ(m.format(), "f");
}

TEST(ProtoJsonTest, FirstMissingFieldNamesThePath) {
  pt::Manifest m;
  EXPECT_EQ(FirstMissingField(m), "format");
  ASSERT_TRUE(ProtoFromJson(R"({"format": "f", "rank": 0,
      "groups": [
        {"name": "a", "numel": 1, "local_numel": 1,
         "params": [{"name": "p", "shape": [1], "offset": 0}]},
        {"name": "b", "numel": 1, "local_numel": null,
         "params": [{"name": "q", "shape": []}]}]})",
                            &m)
                  .ok());
  EXPECT_EQ(FirstMissingField(m), "groups[1].local_numel");  // null is absent
  m.mutable_groups(1)->set_local_numel(1);
  EXPECT_EQ(FirstMissingField(m), "groups[1].params[0].offset");
  m.mutable_groups(1)->mutable_params(0)->set_offset(0);
  EXPECT_EQ(FirstMissingField(m), "");  // an empty repeated field is not missing
}

// For tools: 64-bit integers as JSON numbers wherever they are (nested, repeated, map
// values), everything else as the mapping has it; doubles always look like floats; and
// protobuf reads the result back to the same message.
TEST(ProtoJsonTest, Int64AsNumbersForTools) {
  pt::Record r;
  r.set_step(3);
  r.set_ce(2.0);
  r.set_tokens(int64_t{1} << 40);
  r.set_bytes(uint64_t{18446744073709551615u});
  r.add_counts(-5);
  r.add_counts(7);
  r.add_maxvio(0.25);
  r.set_lr(std::numeric_limits<double>::quiet_NaN());
  r.mutable_param()->set_name("p");
  r.mutable_param()->add_shape(3);
  r.mutable_param()->set_offset(12);
  (*r.mutable_totals())["b"] = 2;
  (*r.mutable_totals())["a"] = 1;
  absl::StatusOr<std::string> strings = ProtoToJson(r);
  ASSERT_TRUE(strings.ok());
  EXPECT_THAT(*strings, HasSubstr("\"tokens\":\"1099511627776\""));
  absl::StatusOr<std::string> json = ProtoToJson(r, {.int64_as_numbers = true});
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(*json,
            "{\"step\":3,\"ce\":2.0,\"tokens\":1099511627776,\"bytes\":18446744073709551615,"
            "\"counts\":[-5,7],\"maxvio\":[0.25],\"param\":{\"name\":\"p\",\"shape\":[3],"
            "\"offset\":12},\"totals\":{\"a\":1,\"b\":2},\"lr\":\"NaN\"}");
  pt::Record back;
  ASSERT_TRUE(ProtoFromJson(*json, &back).ok());
  EXPECT_EQ(back.tokens(), r.tokens());
  EXPECT_EQ(back.bytes(), r.bytes());
  EXPECT_EQ(back.param().shape(0), 3);
  EXPECT_EQ(back.totals().at("b"), 2);
  EXPECT_TRUE(std::isnan(back.lr()));
}

}  // namespace
}  // namespace gradsum
