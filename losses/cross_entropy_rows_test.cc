// Every build of the CE row code this CPU runs (AVX2 + FMA, AVX-512) gives the generic
// build's bits: loss and every gradient element, f32 and bf16, for vocab sizes that exercise
// the 8- and 16-lane bodies, the scalar tails and several tiles, with -inf entries, large
// logits and a -inf-only tile. Every build's bf16 conversions agree with core/half.h bit for
// bit. The values themselves are checked against references in cross_entropy_test.
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

// The wider builds this CPU can run (the generic build is the reference).
std::vector<const CeRowKernels*> WideBuilds() {
  std::vector<const CeRowKernels*> builds;
  for (const char* isa : {"avx2", "avx512"}) {
    if (const CeRowKernels* k = CeRowKernelsFor(isa); k != nullptr) builds.push_back(k);
  }
  return builds;
}

struct Row {
  std::vector<float> logits;
  int64_t label = 0;
};

std::vector<Row> Rows() {
  std::mt19937 gen(3);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<Row> rows;
  for (int64_t v : {1, 7, 8, 9, 15, 16, 17, 31, 1000, 1024, 1031, 4096 + 5, 32768}) {
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

TEST(CrossEntropyRowsTest, SelectionFollowsTheCpuAndTheEnvironment) {
  ASSERT_NE(CeRowKernelsFor("generic"), nullptr);
  EXPECT_EQ(CeRowKernelsFor("sse9"), nullptr);
  EXPECT_EQ(CeRowKernelsFor("avx2") != nullptr, CpuHasAvx2Fma());
  EXPECT_EQ(CeRowKernelsFor("avx512") != nullptr, CpuHasAvx512());
  const char* forced = std::getenv("GRADSUM_CE_ISA");
  const CeRowKernels* want = forced != nullptr ? CeRowKernelsFor(forced) : nullptr;
  if (want == nullptr) {
    want = CpuHasAvx512() ? CeRowKernelsFor("avx512")
           : CpuHasAvx2Fma() ? CeRowKernelsFor("avx2")
                            : CeRowKernelsFor("generic");
  }
  EXPECT_STREQ(SelectedCeRowKernels().isa, want->isa);
}

TEST(CrossEntropyRowsTest, WiderBuildsGiveTheGenericBuildsBits) {
  const std::vector<const CeRowKernels*> wide = WideBuilds();
  if (wide.empty()) GTEST_SKIP() << "this CPU has no AVX2 + FMA: only the generic build runs";
  const CeRowKernels& generic = *CeRowKernelsFor("generic");
  for (const CeRowKernels* build : wide) {
    SCOPED_TRACE(build->isa);
    for (const Row& r : Rows()) {
      {
        std::vector<float> ga, gb;
        double la = -1, lb = -2;
        uint8_t ca, cb;
        RunRow<float>(generic.f32, r.logits, r.label, &ga, &la, &ca);
        RunRow<float>(build->f32, r.logits, r.label, &gb, &lb, &cb);
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
        RunRow<uint16_t>(build->bf16, row, r.label, &gb, &lb, &cb);
        ASSERT_EQ(ca, kRowOk);
        ASSERT_EQ(cb, ca);
        EXPECT_EQ(std::memcmp(&la, &lb, sizeof(la)), 0) << la << " vs " << lb;
        EXPECT_EQ(ga, gb) << "bf16 gradient differs, vocab " << row.size();
      }
    }
  }
}

// Every build, the generic one included.
std::vector<const CeRowKernels*> AllBuilds() {
  std::vector<const CeRowKernels*> builds = WideBuilds();
  builds.insert(builds.begin(), CeRowKernelsFor("generic"));
  return builds;
}

TEST(CrossEntropyRowsTest, Bf16WideningMatchesHalfHForEveryPattern) {
  std::vector<uint16_t> in(65536);
  for (uint32_t b = 0; b < 65536; ++b) in[b] = static_cast<uint16_t>(b);
  for (const CeRowKernels* build : AllBuilds()) {
    // Odd offsets and lengths, so the vector bodies, tails and unaligned starts all run.
    for (int64_t start : {0, 1, 7}) {
      const int64_t n = 65536 - start - (start == 0 ? 0 : 3);
      std::vector<float> out(n, -1.0f);
      build->bf16_to_f32(in.data() + start, out.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const float want = BF16::FromBits(in[start + i]).ToFloat();
        ASSERT_EQ(std::memcmp(&out[i], &want, 4), 0)
            << build->isa << ": bf16 0x" << std::hex << in[start + i];
      }
    }
  }
}

TEST(CrossEntropyRowsTest, Bf16NarrowingMatchesHalfHOnAStrideOfFloatsAndEveryTie) {
  std::vector<uint32_t> bits;
  // A stride through all 2^32 patterns (every exponent, both signs, NaN payloads, Inf,
  // subnormals), plus, for every bf16 value, the exact tie halfway to the next one and its
  // two neighbours (round to even decides the ties).
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 65521) bits.push_back(static_cast<uint32_t>(u));
  for (uint32_t b = 0; b < 65536; ++b) {
    for (uint32_t low : {0x7fffu, 0x8000u, 0x8001u, 0x0000u, 0xffffu}) bits.push_back((b << 16) | low);
  }
  for (uint32_t u : {0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x7f7f8000u, 0x7fc00000u, 0x7f800001u,
                     0xffffffffu, 0x00000001u, 0x80008000u}) {
    bits.push_back(u);
  }
  std::vector<float> in(bits.size());
  std::memcpy(in.data(), bits.data(), bits.size() * 4);
  for (const CeRowKernels* build : AllBuilds()) {
    for (int64_t start : {0, 3}) {
      const int64_t n = static_cast<int64_t>(in.size()) - start;
      std::vector<uint16_t> out(n, 0x1234);
      build->f32_to_bf16(in.data() + start, out.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(out[i], BF16::FromFloat(in[start + i]).bits)
            << build->isa << ": float bits 0x" << std::hex << bits[start + i];
      }
    }
  }
}

TEST(CrossEntropyRowsTest, EveryBuildReportsBadRowsAlike) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const CeRowKernels* build : AllBuilds()) {
    const CeRowKernels& k = *build;
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
