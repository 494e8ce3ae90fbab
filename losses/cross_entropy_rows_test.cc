// Every build of the CE row code this CPU runs (AVX2 + FMA, AVX-512) gives the generic
// build's bits: loss and every gradient element, f32 and bf16, for blocks of rows with vocab
// sizes that exercise the 8- and 16-lane bodies, the scalar tails and several tiles, with
// -inf entries, large logits and a -inf-only tile. Gradients written under the next row's
// forward match those of rows run alone, also around a failing and a zero-weight row. Every
// build's bf16 conversions agree with core/half.h bit for bit. The values themselves are
// checked against references in cross_entropy_test.
#include "losses/cross_entropy_rows.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
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

// Every build, the generic one included.
std::vector<const CeRowKernels*> AllBuilds() {
  std::vector<const CeRowKernels*> builds = WideBuilds();
  builds.insert(builds.begin(), CeRowKernelsFor("generic"));
  return builds;
}

// A block of rows of one vocab size: run as one call, so each row's gradient is written
// under the next row's forward (cross_entropy_rows.h).
struct Block {
  std::vector<float> logits;  // [rows, vocab]
  int64_t vocab = 0;
  std::vector<int64_t> labels;
  std::vector<float> weights;
  int64_t rows() const { return static_cast<int64_t>(labels.size()); }
};

// Per vocab size: a normal row, the same with large logits (the max subtraction matters),
// and above 2100 one with a first tile of -inf only and scattered -inf.
std::vector<Block> Blocks() {
  std::mt19937 gen(3);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<Block> blocks;
  for (int64_t v : {1, 7, 8, 9, 15, 16, 17, 31, 1000, 1024, 1031, 4096 + 5, 32768}) {
    Block b;
    b.vocab = v;
    std::vector<float> row(v);
    for (float& x : row) x = normal(gen);
    auto add = [&b](const std::vector<float>& r, int64_t label) {
      b.logits.insert(b.logits.end(), r.begin(), r.end());
      b.labels.push_back(label);
      b.weights.push_back(0.75f);
    };
    add(row, v / 3);
    std::vector<float> big = row;
    for (float& x : big) x += 3000.0f;
    add(big, v / 3);
    if (v > 2100) {
      std::vector<float> inf = row;
      for (int64_t i = 0; i < 1024; ++i) inf[i] = -std::numeric_limits<float>::infinity();
      for (int64_t i = 1500; i < v; i += 37) inf[i] = -std::numeric_limits<float>::infinity();
      add(inf, 2000);
    }
    blocks.push_back(b);
  }
  return blocks;
}

// Runs `block` (as logits of type T) through fn; the gradient starts as `fill`.
template <typename T, typename Fn>
void RunBlock(Fn fn, const std::vector<T>& logits, const Block& block, std::vector<T>* grad,
              std::vector<double>* loss, std::vector<uint8_t>* codes, T fill = T{}) {
  const int64_t v = block.vocab;
  std::vector<float> exps(2 * v), tile_ref(2 * ((v + kCeTile - 1) / kCeTile));
  const RowScratchView view{exps.data(), tile_ref.data()};
  grad->assign(logits.size(), fill);
  loss->assign(block.rows(), -1.0);
  codes->assign(block.rows(), 255);
  fn(logits.data(), grad->data(), block.rows(), v, block.labels.data(), block.weights.data(), 123.0,
     &view, loss->data(), codes->data());
}

std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = BF16::FromFloat(x[i]).bits;
  return b;
}

TEST(CrossEntropyRowsTest, SelectionFollowsTheCpuAndTheEnvironment) {
  ASSERT_NE(CeRowKernelsFor("generic"), nullptr);
  EXPECT_EQ(CeRowKernelsFor("sse9"), nullptr);
  EXPECT_EQ(CeRowKernelsFor("avx2") != nullptr, CpuHasAvx2Fma());
  EXPECT_EQ(CeRowKernelsFor("avx512") != nullptr, CpuHasAvx512());
  const char* forced = std::getenv("GRADSUM_CE_ISA");
  const CeRowKernels* want = forced != nullptr ? CeRowKernelsFor(forced) : nullptr;
  if (want == nullptr) {
    want = CpuHasAvx512()    ? CeRowKernelsFor("avx512")
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
    for (const Block& b : Blocks()) {
      std::vector<double> la, lb;
      std::vector<uint8_t> ca, cb;
      {
        std::vector<float> ga, gb;
        RunBlock<float>(generic.f32, b.logits, b, &ga, &la, &ca);
        RunBlock<float>(build->f32, b.logits, b, &gb, &lb, &cb);
        ASSERT_EQ(ca, std::vector<uint8_t>(b.rows(), kRowOk)) << "vocab " << b.vocab;
        ASSERT_EQ(cb, ca);
        EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * 8), 0) << la[0] << " vs " << lb[0];
        EXPECT_EQ(std::memcmp(ga.data(), gb.data(), ga.size() * 4), 0)
            << "f32 gradient differs, vocab " << b.vocab;
      }
      {
        const std::vector<uint16_t> logits = ToBf16(b.logits);
        std::vector<uint16_t> ga, gb;
        RunBlock<uint16_t>(generic.bf16, logits, b, &ga, &la, &ca);
        RunBlock<uint16_t>(build->bf16, logits, b, &gb, &lb, &cb);
        ASSERT_EQ(ca, std::vector<uint8_t>(b.rows(), kRowOk));
        ASSERT_EQ(cb, ca);
        EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * 8), 0) << la[0] << " vs " << lb[0];
        EXPECT_EQ(ga, gb) << "bf16 gradient differs, vocab " << b.vocab;
      }
    }
  }
}

// A block whose rows' gradients are written under the next row's forward gives each row
// what a block of that row alone gives (there nothing is interleaved), also around a row
// that fails part way (its gradient is left as it was, the pending row's is finished) and a
// zero-weight row (zeros, no forward).
TEST(CrossEntropyRowsTest, InterleavedGradientsMatchOneRowAtATime) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t v = 3 * kCeTile + 100;
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  Block block;
  block.vocab = v;
  for (int r = 0; r < 6; ++r) {
    for (int64_t i = 0; i < v; ++i) block.logits.push_back(normal(gen));
    block.labels.push_back(r * 500 + 5);
    block.weights.push_back(r == 3 ? 0.0f : 0.5f + r);
  }
  block.logits[2 * v + kCeTile + 7] = nan;  // row 2 fails in its second tile
  const std::vector<uint8_t> want_codes = {kRowOk, kRowOk, kRowNaN, kRowOk, kRowOk, kRowOk};
  for (const CeRowKernels* build : AllBuilds()) {
    SCOPED_TRACE(build->isa);
    std::vector<float> grad;
    std::vector<double> loss;
    std::vector<uint8_t> codes;
    RunBlock<float>(build->f32, block.logits, block, &grad, &loss, &codes, 9.0f);
    EXPECT_EQ(codes, want_codes);
    for (int64_t r = 0; r < block.rows(); ++r) {
      Block one;
      one.vocab = v;
      one.logits.assign(block.logits.begin() + r * v, block.logits.begin() + (r + 1) * v);
      one.labels = {block.labels[r]};
      one.weights = {block.weights[r]};
      std::vector<float> g1;
      std::vector<double> l1;
      std::vector<uint8_t> c1;
      RunBlock<float>(build->f32, one.logits, one, &g1, &l1, &c1, 9.0f);
      EXPECT_EQ(c1[0], codes[r]) << "row " << r;
      EXPECT_EQ(l1[0], loss[r]) << "row " << r;
      EXPECT_EQ(std::memcmp(g1.data(), grad.data() + r * v, v * 4), 0) << "row " << r;
    }
    EXPECT_EQ(grad[2 * v], 9.0f);  // the failed row's gradient is untouched
    EXPECT_EQ(grad[2 * v + v - 1], 9.0f);
    EXPECT_EQ(grad[3 * v + 17], 0.0f);  // the zero-weight row's is zero
    EXPECT_EQ(loss[3], 0.0);
  }
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
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 65521)
    bits.push_back(static_cast<uint32_t>(u));
  for (uint32_t b = 0; b < 65536; ++b) {
    for (uint32_t low : {0x7fffu, 0x8000u, 0x8001u, 0x0000u, 0xffffu})
      bits.push_back((b << 16) | low);
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
  auto code_of = [](const CeRowKernels& k, const std::vector<float>& row, int64_t label) {
    Block b;
    b.vocab = static_cast<int64_t>(row.size());
    b.logits = row;
    b.labels = {label};
    b.weights = {0.75f};
    std::vector<float> g;
    std::vector<double> loss;
    std::vector<uint8_t> codes;
    RunBlock<float>(k.f32, b.logits, b, &g, &loss, &codes);
    return codes[0];
  };
  for (const CeRowKernels* build : AllBuilds()) {
    const CeRowKernels& k = *build;
    EXPECT_EQ(code_of(k, std::vector<float>(20, -inf), 3), kRowAllNegInf) << k.isa;
    std::vector<float> nan_row(1500, 1.0f);
    nan_row[1200] = std::nanf("");
    EXPECT_EQ(code_of(k, nan_row, 3), kRowNaN) << k.isa;
    std::vector<float> pinf(33, 0.5f);
    pinf[32] = inf;
    EXPECT_EQ(code_of(k, pinf, 3), kRowPosInf) << k.isa;
    std::vector<float> target(9, 0.5f);
    target[4] = -inf;
    EXPECT_EQ(code_of(k, target, 4), kRowTargetNegInf) << k.isa;
  }
}

// The vocab-parallel row passes (VpLocalRowsF32Fn, VpGradRowsF32Fn) give the generic
// build's bits in every build too: max, exp sum, z sum, target and every gradient element,
// kept exps in place over the logits, with a row of weight 0 and a shard row of -inf only.
TEST(CrossEntropyRowsTest, VocabParallelPassesGiveTheGenericBuildsBits) {
  for (const Block& b : Blocks()) {
    const int64_t rows = b.rows() + 2, v = b.vocab, tiles = (v + kCeTile - 1) / kCeTile;
    std::vector<float> logits = b.logits;
    logits.insert(logits.end(), b.logits.begin(), b.logits.begin() + v);  // weight 0 below
    logits.insert(logits.end(), v, -std::numeric_limits<float>::infinity());
    std::vector<float> weights = b.weights;
    weights.push_back(0.0f);
    weights.push_back(1.0f);
    std::vector<int64_t> local_labels = b.labels;
    local_labels.push_back(-1);
    local_labels.push_back(-1);
    local_labels[0] = -1;  // row 0's label lies in another shard
    struct Out {
      std::vector<float> grad, tile_ref, max, target;
      std::vector<double> sum, zsum;
      std::vector<uint8_t> codes;
    };
    auto run = [&](const CeRowKernels& k) {
      Out o;
      o.grad = logits;  // in place: the exps overwrite the logits
      o.tile_ref.assign(rows * tiles, 0.0f);
      o.max.assign(rows, 0.0f);
      o.target.assign(rows, 0.0f);
      o.sum.assign(rows, 0.0);
      o.zsum.assign(rows, 0.0);
      o.codes.assign(rows, 9);
      k.vp_local_f32(o.grad.data(), o.grad.data(), o.tile_ref.data(), rows, v, weights.data(),
                     local_labels.data(), o.max.data(), o.sum.data(), o.zsum.data(),
                     o.target.data(), o.codes.data());
      std::vector<VpGradRow> params(rows);
      for (int64_t r = 0; r < rows; ++r) {
        if (weights[r] == 0.0f || o.max[r] == -std::numeric_limits<float>::infinity()) continue;
        params[r].scale = 0.01 * weights[r];
        params[r].global_max = o.max[r] + 0.5f;  // as if another shard held a larger max
        params[r].log_sum = std::log(o.sum[r] + 2.0);
        params[r].offset = -1e-5f;
        params[r].local_label = local_labels[r];
        params[r].target_grad = -0.25f;
      }
      k.vp_grad_f32(o.grad.data(), o.tile_ref.data(), rows, v, params.data());
      return o;
    };
    const Out ref = run(*CeRowKernelsFor("generic"));
    for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(ref.codes[r], kRowOk) << "vocab " << v;
    EXPECT_EQ(ref.max[rows - 1], -std::numeric_limits<float>::infinity());
    EXPECT_EQ(ref.sum[rows - 1], 0.0);
    for (const CeRowKernels* k : WideBuilds()) {
      const Out got = run(*k);
      SCOPED_TRACE(std::string(k->isa) + " vocab " + std::to_string(v));
      EXPECT_EQ(got.codes, ref.codes);
      EXPECT_EQ(0, std::memcmp(got.max.data(), ref.max.data(), rows * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(got.target.data(), ref.target.data(), rows * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(got.sum.data(), ref.sum.data(), rows * sizeof(double)));
      EXPECT_EQ(0, std::memcmp(got.zsum.data(), ref.zsum.data(), rows * sizeof(double)));
      EXPECT_EQ(0, std::memcmp(got.grad.data(), ref.grad.data(), got.grad.size() * 4));
    }
  }
}

}  // namespace
}  // namespace gradsum::losses::internal
