// The two builds of the CE row code (generic and AVX2 + FMA) give the same bits: loss and
// every gradient element, f32 and bf16, for vocab sizes that exercise the 8-lane body, the
// scalar tail and several tiles, with -inf entries, large logits and a -inf-only tile. The
// values themselves are checked against references in cross_entropy_test.
#include "losses/cross_entropy_rows.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>
#include <random>
#include <vector>

#include "core/half.h"
#include "gtest/gtest.h"

namespace gradsum::losses::internal {
namespace {

bool CpuHasAvx2Fma() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

struct Row {
  std::vector<float> logits;
  int64_t label = 0;
};

std::vector<Row> Rows() {
  std::mt19937 gen(3);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<Row> rows;
  for (int64_t v : {1, 7, 8, 9, 1000, 1024, 1031, 4096 + 5, 32768}) {
    Row r;
    r.logits.resize(v);
    for (float& x : r.logits) x = normal(gen);
    r.label = v / 3;
    rows.push_back(r);
    Row big = r;  // large logits: the max subtraction matters
    for (float& x : big.logits) x += 3000.0f;
    rows.push_back(big);
    if (v > 2100) {  // a first tile of -inf only, and scattered -inf
      Row inf = r;
      for (int64_t i = 0; i < 1024; ++i) inf.logits[i] = -std::numeric_limits<float>::infinity();
      for (int64_t i = 1500; i < v; i += 37) inf.logits[i] = -std::numeric_limits<float>::infinity();
      inf.label = 2000;
      rows.push_back(inf);
    }
  }
  return rows;
}

template <typename T, typename Fn>
void RunRow(Fn fn, const std::vector<T>& row, int64_t label, std::vector<T>* grad, double* loss,
            uint8_t* code) {
  const int64_t v = static_cast<int64_t>(row.size());
  std::vector<float> exps(v), tile_ref((v + kCeTile - 1) / kCeTile);
  const RowScratchView view{exps.data(), tile_ref.data()};
  grad->assign(v, T{});
  *code = fn(row.data(), grad->data(), v, label, 0.75f, 123.0, &view, loss);
}

TEST(CrossEntropyRowsTest, Avx2BuildGivesTheGenericBuildsBits) {
  if (!CpuHasAvx2Fma()) GTEST_SKIP() << "this CPU has no AVX2 + FMA: only the generic build runs";
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const CeRowKernels generic = rows_generic::Kernels();
  const CeRowKernels avx2 = rows_avx2::Kernels();
  const char* forced = std::getenv("GRADSUM_CE_ISA");
  EXPECT_STREQ(SelectedCeRowKernels().isa,
               forced != nullptr && std::string(forced) == "generic" ? "generic" : "avx2+fma");
  for (const Row& r : Rows()) {
    {
      std::vector<float> ga, gb;
      double la = -1, lb = -2;
      uint8_t ca, cb;
      RunRow<float>(generic.f32, r.logits, r.label, &ga, &la, &ca);
      RunRow<float>(avx2.f32, r.logits, r.label, &gb, &lb, &cb);
      ASSERT_EQ(ca, kRowOk) << "vocab " << r.logits.size();
      ASSERT_EQ(cb, ca);
      EXPECT_EQ(std::memcmp(&la, &lb, sizeof(la)), 0) << la << " vs " << lb;
      EXPECT_EQ(std::memcmp(ga.data(), gb.data(), ga.size() * 4), 0)
          << "f32 gradient differs, vocab " << r.logits.size();
    }
    {
      std::vector<uint16_t> row(r.logits.size());
      for (size_t i = 0; i < row.size(); ++i) row[i] = BF16::FromFloat(r.logits[i]).bits;
      std::vector<uint16_t> ga, gb;
      double la = -1, lb = -2;
      uint8_t ca, cb;
      RunRow<uint16_t>(generic.bf16, row, r.label, &ga, &la, &ca);
      RunRow<uint16_t>(avx2.bf16, row, r.label, &gb, &lb, &cb);
      ASSERT_EQ(ca, kRowOk);
      ASSERT_EQ(cb, ca);
      EXPECT_EQ(std::memcmp(&la, &lb, sizeof(la)), 0) << la << " vs " << lb;
      EXPECT_EQ(ga, gb) << "bf16 gradient differs, vocab " << row.size();
    }
  }
#endif
}

TEST(CrossEntropyRowsTest, BothBuildsReportBadRowsAlike) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<CeRowKernels> builds = {rows_generic::Kernels()};
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (CpuHasAvx2Fma()) builds.push_back(rows_avx2::Kernels());
#endif
  for (const CeRowKernels& k : builds) {
    std::vector<float> g;
    double loss = 0;
    uint8_t code;
    RunRow<float>(k.f32, std::vector<float>(20, -inf), 3, &g, &loss, &code);
    EXPECT_EQ(code, kRowAllNegInf) << k.isa;
    std::vector<float> nan_row(1500, 1.0f);
    nan_row[1200] = std::nanf("");
    RunRow<float>(k.f32, nan_row, 3, &g, &loss, &code);
    EXPECT_EQ(code, kRowNaN) << k.isa;
    std::vector<float> pinf(33, 0.5f);
    pinf[32] = inf;
    RunRow<float>(k.f32, pinf, 3, &g, &loss, &code);
    EXPECT_EQ(code, kRowPosInf) << k.isa;
    std::vector<float> target(9, 0.5f);
    target[4] = -inf;
    RunRow<float>(k.f32, target, 4, &g, &loss, &code);
    EXPECT_EQ(code, kRowTargetNegInf) << k.isa;
  }
}

}  // namespace
}  // namespace gradsum::losses::internal
