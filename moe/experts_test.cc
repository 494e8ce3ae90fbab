#include "moe/experts.h"

#include <cmath>
#include <mutex>
#include <utility>
#include <vector>

#include "core/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/reference.h"
#include "moe/test_util.h"

namespace gradsum::moe {
namespace {

using ::testing::HasSubstr;

struct Problem {
  int D = 6, H = 5, E_local = 4;
  std::vector<int64_t> groups = {3, 0, 5, 2};  // an empty group in the middle
  std::vector<double> x, wg, wu, wd;
  explicit Problem(uint32_t seed) {
    int64_t n = 0;
    for (int64_t g : groups) n += g;
    x = test::RandomFp32Values(n * D, 1.0, seed);
    wg = test::RandomFp32Values(E_local * D * H, 0.6, seed + 1);
    wu = test::RandomFp32Values(E_local * D * H, 0.6, seed + 2);
    wd = test::RandomFp32Values(E_local * H * D, 0.6, seed + 3);
  }
  int64_t rows() const { return static_cast<int64_t>(x.size()) / D; }
  ExpertsConfig config() const {
    return ExpertsConfig{.d_model = D, .hidden = H, .num_local_experts = E_local};
  }
  reference::LayerConfig ref_config() const {
    reference::LayerConfig c;
    c.d_model = D;
    c.hidden = H;
    c.num_experts = E_local;
    return c;
  }
  // Reference output rows in double: row i goes through its group's expert.
  std::vector<double> ReferenceForward() const {
    std::vector<double> y(x.size(), 0.0);
    int64_t row = 0;
    for (int j = 0; j < E_local; ++j) {
      for (int64_t i = 0; i < groups[j]; ++i, ++row) {
        reference::AddExpert(ref_config(), j, &x[row * D], wg, wu, wd, 1.0, &y[row * D]);
      }
    }
    return y;
  }
};

TEST(ExpertsTest, ForwardMatchesDoubleReference) {
  Problem p(1);
  const std::vector<float> x = test::ToFloat(p.x), wg = test::ToFloat(p.wg),
                           wu = test::ToFloat(p.wu), wd = test::ToFloat(p.wd);
  std::vector<float> y(x.size(), -7.0f);
  ExpertsSaved saved;
  ASSERT_TRUE(
      ExpertsForward(p.config(), {wg, wu, wd}, x, p.groups, absl::MakeSpan(y), &saved).ok());
  const std::vector<double> ref = p.ReferenceForward();
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], ref[i], 1e-5) << "y[" << i << "]";
  EXPECT_EQ(saved.gate_pre.size(), static_cast<size_t>(p.rows() * p.H));

  // Without saved activations the output is the same.
  std::vector<float> y2(x.size());
  ASSERT_TRUE(
      ExpertsForward(p.config(), {wg, wu, wd}, x, p.groups, absl::MakeSpan(y2), nullptr).ok());
  EXPECT_EQ(y, y2);
}

// L = sum_i r_i y_i; gradients against central differences of the double reference.
TEST(ExpertsTest, BackwardMatchesFiniteDifferencesOfReference) {
  Problem p(5);
  const std::vector<double> r = test::RandomFp32Values(p.x.size(), 1.0, 99);
  auto loss = [&] {
    const std::vector<double> y = p.ReferenceForward();
    double l = 0.0;
    for (size_t i = 0; i < y.size(); ++i) l += r[i] * y[i];
    return l;
  };
  const std::vector<float> x = test::ToFloat(p.x), wg = test::ToFloat(p.wg),
                           wu = test::ToFloat(p.wu), wd = test::ToFloat(p.wd),
                           dy = test::ToFloat(r);
  std::vector<float> y(x.size()), dx(x.size(), 123.0f);
  ExpertsSaved saved;
  ASSERT_TRUE(
      ExpertsForward(p.config(), {wg, wu, wd}, x, p.groups, absl::MakeSpan(y), &saved).ok());
  std::vector<float> dwg(wg.size(), 0.0f), dwu(wu.size(), 0.0f), dwd(wd.size(), 0.0f);
  // Two backward calls (two micro-batches with the same data): weight gradients must sum.
  for (int rep = 0; rep < 2; ++rep) {
    ASSERT_TRUE(ExpertsBackward(p.config(), {wg, wu, wd}, x, p.groups, saved, dy,
                                absl::MakeSpan(dx),
                                {absl::MakeSpan(dwg), absl::MakeSpan(dwu), absl::MakeSpan(dwd)})
                    .ok());
  }
  auto check = [&](std::vector<double>& param, const std::vector<float>& grad, double factor,
                   const char* name) {
    for (size_t i = 0; i < param.size(); ++i) {
      const double fd = factor * reference::CentralDifference(loss, &param[i], 1e-6);
      EXPECT_NEAR(grad[i], fd, 1e-4 * (1.0 + std::abs(fd))) << name << "[" << i << "]";
    }
  };
  check(p.wg, dwg, 2.0, "dWg");
  check(p.wu, dwu, 2.0, "dWu");
  check(p.wd, dwd, 2.0, "dWd");
  check(p.x, dx, 1.0, "dx");  // dx is overwritten, not accumulated
}

// The local experts are spread over the caller's compute threads, one expert per task with
// single-threaded GEMMs: the output matches the reference and the bits do not depend on the
// thread count (the trainer's parity checks rely on that).
TEST(ExpertsTest, ComputeThreadsDoNotChangeTheBits) {
  Problem p(3);
  const std::vector<float> x = test::ToFloat(p.x), wg = test::ToFloat(p.wg),
                           wu = test::ToFloat(p.wu), wd = test::ToFloat(p.wd);
  const std::vector<float> dy = test::ToFloat(test::RandomFp32Values(p.x.size(), 1.0, 4));
  struct Out {
    std::vector<float> y, dx, dwg, dwu, dwd;
  };
  auto run = [&](int threads) {
    ScopedComputeThreads budget(threads);
    Out o{std::vector<float>(x.size()), std::vector<float>(x.size()), std::vector<float>(wg.size()),
          std::vector<float>(wu.size()), std::vector<float>(wd.size())};
    ExpertsSaved saved;
    EXPECT_TRUE(
        ExpertsForward(p.config(), {wg, wu, wd}, x, p.groups, absl::MakeSpan(o.y), &saved).ok());
    EXPECT_TRUE(
        ExpertsBackward(p.config(), {wg, wu, wd}, x, p.groups, saved, dy, absl::MakeSpan(o.dx),
                        {absl::MakeSpan(o.dwg), absl::MakeSpan(o.dwu), absl::MakeSpan(o.dwd)})
            .ok());
    return o;
  };
  const Out one = run(1);
  const std::vector<double> ref = p.ReferenceForward();
  for (int threads : {2, 4}) {
    const Out many = run(threads);
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(many.y[i], ref[i], 1e-5) << i;
    EXPECT_EQ(many.y, one.y) << threads;
    EXPECT_EQ(many.dx, one.dx) << threads;
    EXPECT_EQ(many.dwg, one.dwg) << threads;
    EXPECT_EQ(many.dwu, one.dwu) << threads;
    EXPECT_EQ(many.dwd, one.dwd) << threads;
  }
}

// Central differences of the fp32 forward itself against its own backward.
TEST(ExpertsTest, BackwardMatchesFiniteDifferencesOfFp32Forward) {
  Problem p(7);
  std::vector<float> x = test::ToFloat(p.x), wg = test::ToFloat(p.wg), wu = test::ToFloat(p.wu),
                     wd = test::ToFloat(p.wd);
  const std::vector<double> r = test::RandomFp32Values(p.x.size(), 1.0, 8);
  const std::vector<float> dy = test::ToFloat(r);
  auto loss = [&] {
    std::vector<float> y(x.size());
    EXPECT_TRUE(
        ExpertsForward(p.config(), {wg, wu, wd}, x, p.groups, absl::MakeSpan(y), nullptr).ok());
    double l = 0.0;
    for (size_t i = 0; i < y.size(); ++i) l += r[i] * y[i];
    return l;
  };
  std::vector<float> y(x.size()), dx(x.size());
  ExpertsSaved saved;
  ASSERT_TRUE(
      ExpertsForward(p.config(), {wg, wu, wd}, x, p.groups, absl::MakeSpan(y), &saved).ok());
  std::vector<float> dwg(wg.size(), 0.0f), dwu(wu.size(), 0.0f), dwd(wd.size(), 0.0f);
  ASSERT_TRUE(ExpertsBackward(p.config(), {wg, wu, wd}, x, p.groups, saved, dy, absl::MakeSpan(dx),
                              {absl::MakeSpan(dwg), absl::MakeSpan(dwu), absl::MakeSpan(dwd)})
                  .ok());
  auto check = [&](std::vector<float>& param, const std::vector<float>& grad, const char* name) {
    const float h = 1e-2f;
    for (size_t i = 0; i < param.size(); ++i) {
      const float saved_value = param[i];
      param[i] = saved_value + h;
      const double plus = loss();
      param[i] = saved_value - h;
      const double minus = loss();
      param[i] = saved_value;
      const double fd = (plus - minus) / (2.0 * h);
      EXPECT_NEAR(grad[i], fd, 2e-3 * (1.0 + std::abs(fd))) << name << "[" << i << "]";
    }
  };
  check(wg, dwg, "dWg");
  check(wu, dwu, "dWu");
  check(wd, dwd, "dWd");
  check(x, dx, "dx");
}

// Records every contribution an exact sink receives (offset, values), in call order per
// offset (the experts call it from several threads, one expert each).
class RecordingSink : public ExactGradSink {
 public:
  absl::Status Add(int64_t offset, absl::Span<const float> c) override {
    std::lock_guard<std::mutex> lock(mu_);
    adds.push_back({offset, std::vector<float>(c.begin(), c.end())});
    return absl::OkStatus();
  }
  std::vector<std::pair<int64_t, std::vector<float>>> adds;

 private:
  std::mutex mu_;
};

// Reproducible mode (ExpertsConfig::row_blocks): every row block is computed as if it were
// alone in the call, so a row's output, its input gradient and its block's weight-gradient
// contribution are the same bits whatever other blocks share the call (their number, sizes
// and positions differ from mesh to mesh). Each block is run alone as the comparison, and
// the blocks' summed contributions must still be the weight gradient (against the double
// reference's finite differences).
TEST(ExpertsTest, RowBlocksComputeEachBlockAsIfAlone) {
  Problem p(7);
  p.D = 40;
  p.H = 36;
  p.E_local = 2;
  p.groups = {21, 23};
  const std::vector<std::vector<int64_t>> blocks = {{7, 13, 0, 1}, {20, 3}};
  int64_t n = 0;
  for (int64_t g : p.groups) n += g;
  p.x = test::RandomFp32Values(n * p.D, 1.0, 70);
  p.wg = test::RandomFp32Values(p.E_local * p.D * p.H, 0.3, 71);
  p.wu = test::RandomFp32Values(p.E_local * p.D * p.H, 0.3, 72);
  p.wd = test::RandomFp32Values(p.E_local * p.H * p.D, 0.3, 73);
  const int64_t D = p.D, H = p.H, El = p.E_local;
  const std::vector<float> x = test::ToFloat(p.x), wg = test::ToFloat(p.wg),
                           wu = test::ToFloat(p.wu), wd = test::ToFloat(p.wd);
  const std::vector<float> dy = test::ToFloat(test::RandomFp32Values(n * D, 1.0, 74));
  ExpertsConfig config = p.config();
  config.row_blocks = &blocks;
  ScopedComputeThreads budget(2);
  std::vector<float> y(n * D), dx(n * D);
  ExpertsSaved saved;
  ASSERT_TRUE(ExpertsForward(config, {wg, wu, wd}, x, p.groups, absl::MakeSpan(y), &saved).ok());
  RecordingSink sink;
  ExpertWeightGrads grads;
  grads.exact = &sink;
  ASSERT_TRUE(
      ExpertsBackward(config, {wg, wu, wd}, x, p.groups, saved, dy, absl::MakeSpan(dx), grads)
          .ok());
  const std::vector<double> ref = p.ReferenceForward();
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], ref[i], 1e-5) << "y[" << i << "]";

  // Each block alone: expert j gets only the block's rows.
  std::vector<double> dw_sum(3 * El * D * H, 0.0);
  int64_t row = 0;
  for (int j = 0; j < El; ++j) {
    for (int64_t b : blocks[j]) {
      if (b == 0) continue;
      std::vector<int64_t> groups(El, 0);
      groups[j] = b;
      const auto xb = absl::MakeConstSpan(x).subspan(row * D, b * D);
      const auto dyb = absl::MakeConstSpan(dy).subspan(row * D, b * D);
      std::vector<float> yb(b * D), dxb(b * D);
      ExpertsSaved sb;
      ASSERT_TRUE(
          ExpertsForward(p.config(), {wg, wu, wd}, xb, groups, absl::MakeSpan(yb), &sb).ok());
      RecordingSink alone;
      ExpertWeightGrads g;
      g.exact = &alone;
      ASSERT_TRUE(
          ExpertsBackward(p.config(), {wg, wu, wd}, xb, groups, sb, dyb, absl::MakeSpan(dxb), g)
              .ok());
      for (int64_t i = 0; i < b * D; ++i) {
        ASSERT_EQ(yb[i], y[row * D + i]) << "expert " << j << " row " << row + i / D;
        ASSERT_EQ(dxb[i], dx[row * D + i]) << "expert " << j << " row " << row + i / D;
      }
      // The block's three contributions (Wd, Wg, Wu) are among the recorded ones, bit for bit.
      ASSERT_EQ(alone.adds.size(), 3u);
      for (const auto& [offset, values] : alone.adds) {
        EXPECT_EQ(offset % (El * D * H), j * D * H);
        int found = 0;
        for (const auto& rec : sink.adds) found += rec.first == offset && rec.second == values;
        EXPECT_EQ(found, 1) << "block of expert " << j << " at row " << row;
        for (size_t i = 0; i < values.size(); ++i) dw_sum[offset + i] += values[i];
      }
      row += b;
    }
  }
  EXPECT_EQ(sink.adds.size(), 3u * 5);  // 5 non-empty blocks, 3 matrices each
  // The summed contributions are the weight gradients of L = sum_i dy_i y_i.
  const std::vector<double> r(dy.begin(), dy.end());
  auto loss = [&] {
    const std::vector<double> yr = p.ReferenceForward();
    double l = 0.0;
    for (size_t i = 0; i < yr.size(); ++i) l += r[i] * yr[i];
    return l;
  };
  for (int which = 0; which < 3; ++which) {
    std::vector<double>& w = which == 0 ? p.wg : which == 1 ? p.wu : p.wd;
    for (size_t i = 0; i < w.size(); i += 37) {  // a sample of every matrix
      const double fd = reference::CentralDifference(loss, &w[i], 1e-6);
      EXPECT_NEAR(dw_sum[which * El * D * H + i], fd, 1e-4 * (1.0 + std::abs(fd)))
          << "matrix " << which << " element " << i;
    }
  }
}

TEST(ExpertsTest, RowBlocksThatDoNotSumToTheGroupAreInvalidArgument) {
  const ExpertsConfig base{.d_model = 2, .hidden = 2, .num_local_experts = 2};
  const std::vector<std::vector<int64_t>> bad = {{1, 1}, {3}};
  ExpertsConfig config = base;
  config.row_blocks = &bad;
  const std::vector<float> w(8, 0.1f), x(4 * 2, 1.0f);
  const std::vector<int64_t> groups = {2, 2};
  std::vector<float> y4(4 * 2);
  absl::Status s = ExpertsForward(config, {w, w, w}, x, groups, absl::MakeSpan(y4), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("row_blocks[1] sum to 3 rows, group_sizes[1] is 2"));
}

TEST(ExpertsTest, AllGroupsEmptyIsANoOp) {
  ExpertsConfig config{.d_model = 2, .hidden = 3, .num_local_experts = 2};
  std::vector<float> w(12, 1.0f), dw(12, 0.0f);
  std::vector<int64_t> groups = {0, 0};
  ExpertsSaved saved;
  EXPECT_TRUE(ExpertsForward(config, {w, w, w}, {}, groups, {}, &saved).ok());
  EXPECT_TRUE(ExpertsBackward(config, {w, w, w}, {}, groups, saved, {}, {},
                              {absl::MakeSpan(dw), absl::MakeSpan(dw), absl::MakeSpan(dw)})
                  .ok());
  for (float v : dw) EXPECT_EQ(v, 0.0f);
}

TEST(ExpertsTest, BadArgumentsAreInvalidArgument) {
  ExpertsConfig config{.d_model = 2, .hidden = 3, .num_local_experts = 2};
  std::vector<float> w(12, 1.0f), x(6, 1.0f), y(6);
  std::vector<int64_t> groups = {1, 2};
  auto forward = [&](const ExpertsConfig& c, const ExpertWeights& weights,
                     absl::Span<const float> xx, absl::Span<const int64_t> g,
                     absl::Span<float> yy) {
    return ExpertsForward(c, weights, xx, g, yy, nullptr);
  };
  EXPECT_THAT(forward({.d_model = 2, .hidden = 0, .num_local_experts = 2}, {w, w, w}, x, groups,
                      absl::MakeSpan(y))
                  .message(),
              HasSubstr("H=0"));
  EXPECT_THAT(
      forward(config, {std::vector<float>(11), w, w}, x, groups, absl::MakeSpan(y)).message(),
      HasSubstr("Wg has 11"));
  EXPECT_THAT(
      forward(config, {w, w, std::vector<float>(13)}, x, groups, absl::MakeSpan(y)).message(),
      HasSubstr("Wd has 13"));
  EXPECT_THAT(
      forward(config, {w, w, w}, x, std::vector<int64_t>{1, 2, 0}, absl::MakeSpan(y)).message(),
      HasSubstr("group_sizes has 3"));
  EXPECT_THAT(
      forward(config, {w, w, w}, x, std::vector<int64_t>{4, -1}, absl::MakeSpan(y)).message(),
      HasSubstr("group_sizes[1] is negative"));
  EXPECT_THAT(
      forward(config, {w, w, w}, std::vector<float>(5), groups, absl::MakeSpan(y)).message(),
      HasSubstr("x has 5"));
  std::vector<float> short_y(4);
  absl::Status s = forward(config, {w, w, w}, x, groups, absl::MakeSpan(short_y));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("y has 4"));

  ExpertsSaved saved;
  ASSERT_TRUE(ExpertsForward(config, {w, w, w}, x, groups, absl::MakeSpan(y), &saved).ok());
  std::vector<float> dw(12), dx(6), bad(5);
  EXPECT_THAT(ExpertsBackward(config, {w, w, w}, x, groups, saved, bad, absl::MakeSpan(dx),
                              {absl::MakeSpan(dw), absl::MakeSpan(dw), absl::MakeSpan(dw)})
                  .message(),
              HasSubstr("dy has 5"));
  EXPECT_THAT(ExpertsBackward(config, {w, w, w}, x, groups, saved, y, absl::MakeSpan(dx),
                              {absl::MakeSpan(bad), absl::MakeSpan(dw), absl::MakeSpan(dw)})
                  .message(),
              HasSubstr("dWg has 5"));
  ExpertsSaved wrong;
  EXPECT_THAT(ExpertsBackward(config, {w, w, w}, x, groups, wrong, y, absl::MakeSpan(dx),
                              {absl::MakeSpan(dw), absl::MakeSpan(dw), absl::MakeSpan(dw)})
                  .message(),
              HasSubstr("gate_pre has 0"));
}

}  // namespace
}  // namespace gradsum::moe
