// Proves that the protoc rule and libprotobuf work: serialize, parse, text format.
#include <google/protobuf/text_format.h>

#include "gtest/gtest.h"
#include "third_party/smoke/smoke.pb.h"

TEST(ProtobufSmoke, RoundTrip) {
  gradsum::smoke::SmokeMessage m;
  m.set_name("bucket");
  m.add_values(3);
  m.add_values(-5);
  std::string wire;
  ASSERT_TRUE(m.SerializeToString(&wire));
  gradsum::smoke::SmokeMessage back;
  ASSERT_TRUE(back.ParseFromString(wire));
  EXPECT_EQ(back.name(), "bucket");
  ASSERT_EQ(back.values_size(), 2);
  EXPECT_EQ(back.values(1), -5);

  gradsum::smoke::SmokeMessage parsed;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString("name: 'x' values: 9", &parsed));
  EXPECT_EQ(parsed.name(), "x");
  EXPECT_EQ(parsed.values(0), 9);
}
