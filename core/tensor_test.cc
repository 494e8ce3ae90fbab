#include "core/tensor.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "core/status.h"
#include "gtest/gtest.h"

namespace gradsum {
namespace {

TEST(TensorView, CreateAndAccess) {
  std::vector<float> buf(6);
  absl::StatusOr<TensorView> t = TensorView::Create(buf.data(), DType::kF32, {2, 3});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->numel(), 6);
  EXPECT_EQ(t->nbytes(), 24u);
  EXPECT_EQ(t->rank(), 2);
  EXPECT_EQ(t->dim(1), 3);
  EXPECT_EQ(t->data<float>(), buf.data());
  EXPECT_EQ(t->DebugString(), "f32[2,3]@cpu");
}

TEST(TensorView, RowsAndReshape) {
  std::vector<int64_t> buf(12);
  TensorView t = *TensorView::Create(buf.data(), DType::kI64, {4, 3});
  absl::StatusOr<TensorView> r = t.Rows(1, 3);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->data<int64_t>(), buf.data() + 3);
  EXPECT_EQ(r->shape(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t.Rows(2, 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Rows(-1, 1).status().code(), absl::StatusCode::kInvalidArgument);
  const int64_t flat[] = {12};
  EXPECT_EQ(t.Reshape(flat)->shape(), (std::vector<int64_t>{12}));
  const int64_t bad[] = {5};
  absl::Status s = t.Reshape(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[5]"), absl::string_view::npos) << s;
}

TEST(TensorView, BadConstructionIsInvalidArgumentNamingTheValue) {
  std::vector<float> buf(4);
  absl::Status neg = TensorView::Create(buf.data(), DType::kF32, {2, -3}).status();
  EXPECT_EQ(neg.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(neg.message().find("-3"), absl::string_view::npos) << neg;

  absl::Status null = TensorView::Create(nullptr, DType::kF32, {4}).status();
  EXPECT_EQ(null.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(null.message().find("null"), absl::string_view::npos) << null;
  EXPECT_TRUE(TensorView::Create(nullptr, DType::kF32, {0, 7}).ok());

  const int64_t big = std::numeric_limits<int64_t>::max() / 2;
  absl::Status overflow = TensorView::Create(buf.data(), DType::kF32, {big, 4}).status();
  EXPECT_EQ(overflow.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(overflow.message().find("overflows"), absl::string_view::npos) << overflow;

  absl::Status bytes = TensorView::Create(buf.data(), DType::kF64, {big}).status();
  EXPECT_EQ(bytes.code(), absl::StatusCode::kInvalidArgument);

  absl::Status dev = TensorView::Create(buf.data(), DType::kF32, {4}, {Device::kCuda, -1}).status();
  EXPECT_EQ(dev.code(), absl::StatusCode::kInvalidArgument);

  absl::Status dt = TensorView::Create(buf.data(), static_cast<DType>(9), {4}).status();
  EXPECT_EQ(dt.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dt.message().find("9"), absl::string_view::npos) << dt;
}

absl::StatusOr<int> ParsePositive(int x) {
  if (x <= 0) return absl::InvalidArgumentError(absl::StrCat("not positive: ", x));
  return x;
}

absl::Status UseMacros(int x, int* out) {
  GRADSUM_ASSIGN_OR_RETURN(int v, ParsePositive(x));
  GRADSUM_RETURN_IF_ERROR(v > 100 ? absl::OutOfRangeError("too big") : absl::OkStatus());
  *out = v;
  return absl::OkStatus();
}

TEST(Status, MacrosPropagateAndAnnotate) {
  int out = 0;
  EXPECT_TRUE(UseMacros(5, &out).ok());
  EXPECT_EQ(out, 5);
  EXPECT_EQ(UseMacros(-2, &out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UseMacros(200, &out).code(), absl::StatusCode::kOutOfRange);
  absl::Status a = Annotate(absl::DataLossError("bad crc"), "loading shard 3");
  EXPECT_EQ(a.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(a.message(), "loading shard 3: bad crc");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "x").ok());
}

}  // namespace
}  // namespace gradsum
