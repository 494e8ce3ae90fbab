#include "core/dtype.h"

#include "gtest/gtest.h"

namespace gradsum {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF64), 8u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeSize(DType::kI64), 8u);
  EXPECT_TRUE(IsFloating(DType::kBF16));
  EXPECT_FALSE(IsFloating(DType::kI64));
  for (DType t : kAllDTypes) {
    absl::StatusOr<DType> back = ParseDType(DTypeName(t));
    ASSERT_TRUE(back.ok()) << DTypeName(t);
    EXPECT_EQ(*back, t);
  }
  EXPECT_EQ(*ParseDType("BFloat16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("fp32"), DType::kF32);
}

TEST(DType, UnknownNameIsInvalidArgumentNamingIt) {
  absl::StatusOr<DType> t = ParseDType("f8e4m3");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("f8e4m3"), absl::string_view::npos);
  EXPECT_FALSE(IsValidDType(6));
  EXPECT_FALSE(IsValidDType(-1));
  EXPECT_TRUE(IsValidDType(2));
}

}  // namespace
}  // namespace gradsum
