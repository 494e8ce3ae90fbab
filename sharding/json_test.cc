#include "sharding/json.h"

#include <string>

#include "gtest/gtest.h"

namespace gradsum {
namespace {

TEST(JsonTest, ParsesNestedValues) {
  absl::StatusOr<JsonValue> v = ParseJson(
      R"(  {"a": [1, -2, 3.5, 1e3], "b": {"c": "x\"y\\z\u00e9\ud83d\ude00"}, "t": true,
           "f": false, "n": null, "big": 9223372036854775807, "neg": -9223372036854775808} )");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_TRUE(v->is_object());
  const JsonValue* a = v->Find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->array().size(), 4u);
  EXPECT_TRUE(a->array()[0].is_int());
  EXPECT_EQ(a->array()[0].as_int(), 1);
  EXPECT_EQ(a->array()[1].as_int(), -2);
  EXPECT_FALSE(a->array()[2].is_int());
  EXPECT_EQ(a->array()[2].as_double(), 3.5);
  EXPECT_EQ(a->array()[3].as_double(), 1000.0);
  EXPECT_EQ(v->Find("b")->Find("c")->as_string(), "x\"y\\z\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_TRUE(v->Find("t")->as_bool());
  EXPECT_FALSE(v->Find("f")->as_bool());
  EXPECT_TRUE(v->Find("n")->is_null());
  EXPECT_EQ(v->Find("big")->as_int(), INT64_MAX);
  EXPECT_EQ(v->Find("neg")->as_int(), INT64_MIN);
  EXPECT_EQ(v->Find("missing"), nullptr);
}

TEST(JsonTest, IntegerBeyondInt64BecomesDouble) {
  absl::StatusOr<JsonValue> v = ParseJson("18446744073709551616");
  ASSERT_TRUE(v.ok());
  EXPECT_FALSE(v->is_int());
  EXPECT_EQ(v->as_double(), 18446744073709551616.0);
}

TEST(JsonTest, SerializeRoundTrips) {
  JsonValue o = JsonValue::Object();
  o.Set("name", JsonValue::String("a\"b\n\x01"));
  JsonValue arr = JsonValue::Array();
  arr.Append(JsonValue::Int(-7));
  arr.Append(JsonValue::Double(0.1));
  arr.Append(JsonValue::Bool(true));
  arr.Append(JsonValue());
  o.Set("arr", std::move(arr));
  const std::string text = o.Serialize();
  EXPECT_EQ(text, R"({"name":"a\"b\n\u0001","arr":[-7,0.10000000000000001,true,null]})");
  absl::StatusOr<JsonValue> back = ParseJson(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->Find("name")->as_string(), "a\"b\n\x01");
  EXPECT_EQ(back->Find("arr")->array()[1].as_double(), 0.1);
  EXPECT_EQ(back->Serialize(), text);
}

TEST(JsonTest, RejectsMalformedInput) {
  const char* bad[] = {
      "",          "{",          "}",           "[1,]",          "{\"a\":}",  "{\"a\" 1}",
      "{a:1}",     "\"abc",      "\"\\x\"",     "\"\\u12\"",     "01",        "1.",
      "-",         "1e",         "tru",         "[1 2]",         "{} x",      "\"\x01\"",
      "\"\\ud800\"", "\"\\udc00\"", "{\"a\":1,\"a\":2}", "nul", "[\"a\",]", "{,}",
  };
  for (const char* text : bad) {
    absl::StatusOr<JsonValue> v = ParseJson(text);
    EXPECT_FALSE(v.ok()) << "accepted: " << text;
    if (!v.ok()) {
      EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << text;
    }
  }
}

TEST(JsonTest, DeepNestingIsAnErrorNotAStackOverflow) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  absl::StatusOr<JsonValue> v = ParseJson(deep);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("nesting deeper than 64"), std::string::npos)
      << v.status();
  EXPECT_TRUE(ParseJson("[[[[1]]]]").ok());
}

TEST(JsonTest, GarbageNeverCrashes) {
  // Deterministic pseudo-random byte strings and mutations of a valid document.
  const std::string valid = R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})";
  uint64_t state = 12345;
  int rejected = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string s = valid;
    for (int k = 0; k < 3; ++k) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      s[(state >> 33) % s.size()] = static_cast<char>(state >> 56);
    }
    if (!ParseJson(s).ok()) ++rejected;
  }
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace gradsum
