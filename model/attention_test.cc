// The CPU attention (model/attention.h) against a plain softmax(q k^T / sqrt(d)) v with the
// document-causal mask, written straightforwardly in double: forward and backward on the
// shapes of model/attention_testing.h (with and without GQA, kv_of_q subsets, one document,
// many short ones, padding, documents across block boundaries, seq_len not a multiple of
// the block, head_dim 16 to 128).
// Then: padding rows are never read; central differences of a loss for a few gradient
// elements; the same bits at 1, 2 and 4 threads, for a subset of heads or one sequence as
// in the full call, and in every instruction-set build; the blocks; the argument errors.
#include "model/attention.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "gtest/gtest.h"
#include "model/attention_kernels.h"
#include "model/attention_testing.h"

namespace gradsum::model {
namespace {

using ::gradsum::model::testing::Dims;
using ::gradsum::model::testing::DocStarts;
using ::gradsum::model::testing::ExpectNear;
using ::gradsum::model::testing::RandomTensor;
using ::gradsum::model::testing::SameBits;

using ::gradsum::model::testing::Grads;
using ::gradsum::model::testing::Reference;

// ---- cases -----------------------------------------------------------------------------

using Case = ::gradsum::model::testing::AttentionCase;

std::vector<Case> Cases() { return ::gradsum::model::testing::AttentionCases(); }

Case CaseNamed(const std::string& name) {
  return ::gradsum::model::testing::AttentionCaseNamed(name);
}

struct Inputs {
  std::vector<float> q, k, v, d_out;
};

Inputs MakeInputs(const AttentionDims& dims, uint32_t seed) {
  const int64_t tokens = dims.num_seqs * dims.seq_len;
  Inputs in;
  in.q = RandomTensor(tokens * dims.q_heads * dims.head_dim, seed);
  in.k = RandomTensor(tokens * dims.kv_heads * dims.head_dim, seed + 1);
  in.v = RandomTensor(tokens * dims.kv_heads * dims.head_dim, seed + 2);
  in.d_out = RandomTensor(tokens * dims.q_heads * dims.head_dim, seed + 3);
  return in;
}

struct Outputs {
  std::vector<float> out, lse, dq, dk, dv;
};

// Forward then backward (the NaN fill checks that every element is written).
Outputs RunBoth(const AttentionDims& dims, const Inputs& in, const std::vector<int32_t>& ds,
                const internal::AttentionKernels* kernels = nullptr) {
  const int64_t tokens = dims.num_seqs * dims.seq_len;
  Outputs o;
  o.out.assign(tokens * dims.q_heads * dims.head_dim, NAN);
  o.lse.assign(tokens * dims.q_heads, NAN);
  o.dq.assign(o.out.size(), NAN);
  o.dk.assign(tokens * dims.kv_heads * dims.head_dim, NAN);
  o.dv.assign(o.dk.size(), NAN);
  const internal::AttentionKernels& k =
      kernels != nullptr ? *kernels : internal::SelectedAttentionKernels();
  absl::Status s = internal::AttentionForwardWith(k, dims, in.q, in.k, in.v, ds,
                                                  absl::MakeSpan(o.out), absl::MakeSpan(o.lse));
  EXPECT_TRUE(s.ok()) << s;
  s = internal::AttentionBackwardWith(k, dims, in.q, in.k, in.v, ds, o.out, o.lse, in.d_out,
                                      absl::MakeSpan(o.dq), absl::MakeSpan(o.dk),
                                      absl::MakeSpan(o.dv));
  EXPECT_TRUE(s.ok()) << s;
  return o;
}

void ExpectSameBits(const Outputs& a, const Outputs& b, const std::string& what) {
  EXPECT_TRUE(SameBits(a.out, b.out)) << what << ": out";
  EXPECT_TRUE(SameBits(a.lse, b.lse)) << what << ": lse";
  EXPECT_TRUE(SameBits(a.dq, b.dq)) << what << ": dq";
  EXPECT_TRUE(SameBits(a.dk, b.dk)) << what << ": dk";
  EXPECT_TRUE(SameBits(a.dv, b.dv)) << what << ": dv";
}

// fp32 against double: the errors measured were below 7e-7 of the largest value.
constexpr double kTol = 1e-5;

TEST(Attention, ForwardAndBackwardMatchTheDoubleReference) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = MakeInputs(c.dims, 7);
    const Outputs o = RunBoth(c.dims, in, c.doc_start);
    const Grads want = Reference(c.dims, in.q, in.k, in.v, c.doc_start, in.d_out);
    ExpectNear(o.out, want.out, kTol, "out");
    ExpectNear(o.lse, want.lse, kTol, "lse");
    ExpectNear(o.dq, want.dq, kTol, "dq");
    ExpectNear(o.dk, want.dk, kTol, "dk");
    ExpectNear(o.dv, want.dv, kTol, "dv");
  }
}

TEST(Attention, PaddingGivesExactZeros) {
  const Case c = CaseNamed("gqa_documents_across_blocks_padding_tail");
  const Inputs in = MakeInputs(c.dims, 3);
  const Outputs o = RunBoth(c.dims, in, c.doc_start);
  const int64_t d = c.dims.head_dim;
  for (int64_t t = 0; t < c.dims.num_seqs * c.dims.seq_len; ++t) {
    if (c.doc_start[t] >= 0) continue;
    for (int h = 0; h < c.dims.q_heads; ++h) {
      EXPECT_EQ(o.lse[t * c.dims.q_heads + h], 0.0f) << t;
      for (int64_t x = 0; x < d; ++x) {
        EXPECT_EQ(o.out[(t * c.dims.q_heads + h) * d + x], 0.0f) << t;
        EXPECT_EQ(o.dq[(t * c.dims.q_heads + h) * d + x], 0.0f) << t;
      }
    }
    for (int64_t x = 0; x < c.dims.kv_heads * d; ++x) {
      EXPECT_EQ(o.dk[t * c.dims.kv_heads * d + x], 0.0f) << t;
      EXPECT_EQ(o.dv[t * c.dims.kv_heads * d + x], 0.0f) << t;
    }
  }
}

// Padding tokens' rows are never read: NaN there changes no bit of the results.
TEST(Attention, PaddingValuesAreNeverRead) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = MakeInputs(c.dims, 19);
    Inputs poisoned = in;
    const int64_t qrow = c.dims.q_heads * c.dims.head_dim,
                  kvrow = c.dims.kv_heads * c.dims.head_dim;
    for (int64_t t = 0; t < c.dims.num_seqs * c.dims.seq_len; ++t) {
      if (c.doc_start[t] >= 0) continue;
      for (int64_t x = t * qrow; x < (t + 1) * qrow; ++x) poisoned.q[x] = poisoned.d_out[x] = NAN;
      for (int64_t x = t * kvrow; x < (t + 1) * kvrow; ++x) poisoned.k[x] = poisoned.v[x] = NAN;
    }
    ExpectSameBits(RunBoth(c.dims, poisoned, c.doc_start), RunBoth(c.dims, in, c.doc_start),
                   "NaN padding");
  }
}

// L = sum(out * w): dL/dx from backward (d_out = w) against central differences of the
// fp32 forward (summed in double).
TEST(Attention, GradientsMatchCentralDifferences) {
  const Case c = CaseNamed("gqa_documents_across_blocks_padding_tail");
  Inputs in = MakeInputs(c.dims, 21);
  const std::vector<float>& w = in.d_out;
  const Outputs o = RunBoth(c.dims, in, c.doc_start);
  auto loss = [&](const Inputs& x) {
    std::vector<float> out(o.out.size()), lse(o.lse.size());
    EXPECT_TRUE(AttentionForward(c.dims, x.q, x.k, x.v, c.doc_start, absl::MakeSpan(out),
                                 absl::MakeSpan(lse))
                    .ok());
    double sum = 0;
    for (size_t i = 0; i < out.size(); ++i) sum += double{out[i]} * w[i];
    return sum;
  };
  const float h = 1e-2f;
  struct Probe {
    std::vector<float> Inputs::*tensor;
    const std::vector<float> Outputs::*grad;
    int64_t index;
    const char* name;
  };
  const int64_t d = c.dims.head_dim;
  // Token 75 (second document of sequence 0), token 150 + 60 (second sequence), a key that
  // many queries see (token 0) and one near a block edge (token 63).
  const std::vector<Probe> probes = {
      {&Inputs::q, &Outputs::dq, (75 * 4 + 1) * d + 3, "q"},
      {&Inputs::q, &Outputs::dq, ((150 + 60) * 4 + 2) * d + 40, "q"},
      {&Inputs::k, &Outputs::dk, (0 * 2 + 0) * d + 5, "k"},
      {&Inputs::k, &Outputs::dk, (63 * 2 + 1) * d + 17, "k"},
      {&Inputs::v, &Outputs::dv, (10 * 2 + 1) * d + 0, "v"},
      {&Inputs::v, &Outputs::dv, ((150 + 100) * 2 + 0) * d + 63, "v"},
  };
  for (const Probe& p : probes) {
    Inputs plus = in, minus = in;
    (plus.*p.tensor)[p.index] += h;
    (minus.*p.tensor)[p.index] -= h;
    const double fd = (loss(plus) - loss(minus)) / (2.0 * h);
    const double analytic = (o.*p.grad)[p.index];
    EXPECT_NEAR(analytic, fd, 2e-4 * (1 + std::abs(fd))) << p.name << "[" << p.index << "]";
  }
}

TEST(Attention, SameBitsAtEveryThreadCount) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = MakeInputs(c.dims, 5);
    Outputs one;
    {
      ScopedComputeThreads threads(1);
      one = RunBoth(c.dims, in, c.doc_start);
    }
    for (int n : {2, 4}) {
      ScopedComputeThreads threads(n);
      ExpectSameBits(RunBoth(c.dims, in, c.doc_start), one, "threads " + std::to_string(n));
    }
  }
}

// The tensor [T, heads, d] restricted to the listed heads: [T, heads.size(), d].
std::vector<float> Heads(const std::vector<float>& x, int64_t tokens, int heads, int64_t d,
                         const std::vector<int>& keep) {
  std::vector<float> y;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h : keep) {
      y.insert(y.end(), x.begin() + (t * heads + h) * d, x.begin() + (t * heads + h + 1) * d);
    }
  }
  return y;
}

// Sequence parallelism hands a rank some heads of whole sequences: each head's results
// must be the full call's bits.
TEST(Attention, HeadSubsetsGiveTheFullCallsBits) {
  ScopedComputeThreads threads(2);
  const AttentionDims full = Dims(2, 150, 8, 2, 64);  // q heads 0-3 use kv 0, 4-7 kv 1
  const std::vector<int32_t> ds = DocStarts({{70, 61, -19}, {5, 128, 7, -10}});
  const int64_t tokens = 300, d = 64;
  const Inputs in = MakeInputs(full, 9);
  const Outputs all = RunBoth(full, in, ds);
  auto sub_inputs = [&](const std::vector<int>& qh, const std::vector<int>& kvh) {
    Inputs s;
    s.q = Heads(in.q, tokens, 8, d, qh);
    s.d_out = Heads(in.d_out, tokens, 8, d, qh);
    s.k = Heads(in.k, tokens, 2, d, kvh);
    s.v = Heads(in.v, tokens, 2, d, kvh);
    return s;
  };
  auto expect_q_side = [&](const Outputs& o, const std::vector<int>& qh) {
    EXPECT_TRUE(SameBits(o.out, Heads(all.out, tokens, 8, d, qh)));
    EXPECT_TRUE(SameBits(o.lse, Heads(all.lse, tokens, 8, 1, qh)));
    EXPECT_TRUE(SameBits(o.dq, Heads(all.dq, tokens, 8, d, qh)));
  };
  {
    SCOPED_TRACE("the query heads of kv head 1: everything equal");
    const std::vector<int> qh = {4, 5, 6, 7};
    const Outputs o = RunBoth(Dims(2, 150, 4, 1, 64, {0, 0, 0, 0}), sub_inputs(qh, {1}), ds);
    expect_q_side(o, qh);
    EXPECT_TRUE(SameBits(o.dk, Heads(all.dk, tokens, 2, d, {1})));
    EXPECT_TRUE(SameBits(o.dv, Heads(all.dv, tokens, 2, d, {1})));
  }
  {
    SCOPED_TRACE("one query head of each kv head");
    const std::vector<int> qh = {1, 6};
    const Outputs o = RunBoth(Dims(2, 150, 2, 2, 64, {0, 1}), sub_inputs(qh, {0, 1}), ds);
    expect_q_side(o, qh);
  }
  {
    SCOPED_TRACE("every query head with its own kv copy: dk, dv are the per-head terms");
    const std::vector<int> qh = {0, 1, 2, 3, 4, 5, 6, 7};
    const Outputs o =
        RunBoth(Dims(2, 150, 8, 8, 64, qh), sub_inputs(qh, {0, 0, 0, 0, 1, 1, 1, 1}), ds);
    expect_q_side(o, qh);
    // dk of kv head j = ((c_0 + c_1) + c_2) + c_3 over its query heads, in fp32.
    std::vector<float> dk(all.dk.size()), dv(all.dv.size());
    for (int64_t t = 0; t < tokens; ++t) {
      for (int j = 0; j < 2; ++j) {
        for (int64_t x = 0; x < d; ++x) {
          float sk = o.dk[(t * 8 + 4 * j) * d + x], sv = o.dv[(t * 8 + 4 * j) * d + x];
          for (int i = 1; i < 4; ++i) {
            sk += o.dk[(t * 8 + 4 * j + i) * d + x];
            sv += o.dv[(t * 8 + 4 * j + i) * d + x];
          }
          dk[(t * 2 + j) * d + x] = sk;
          dv[(t * 2 + j) * d + x] = sv;
        }
      }
    }
    EXPECT_TRUE(SameBits(dk, all.dk));
    EXPECT_TRUE(SameBits(dv, all.dv));
  }
}

TEST(Attention, OneSequenceGivesTheFullCallsBits) {
  const Case c = CaseNamed("random_documents_d64_mqa");  // three sequences
  const Inputs in = MakeInputs(c.dims, 13);
  const Outputs all = RunBoth(c.dims, in, c.doc_start);
  const int64_t len = c.dims.seq_len, qrow = c.dims.q_heads * c.dims.head_dim,
                kvrow = c.dims.kv_heads * c.dims.head_dim;
  auto rows = [&](const std::vector<float>& x, int64_t s, int64_t width) {
    return std::vector<float>(x.begin() + s * len * width, x.begin() + (s + 1) * len * width);
  };
  for (int64_t s = 0; s < c.dims.num_seqs; ++s) {
    AttentionDims one = c.dims;
    one.num_seqs = 1;
    Inputs x;
    x.q = rows(in.q, s, qrow);
    x.d_out = rows(in.d_out, s, qrow);
    x.k = rows(in.k, s, kvrow);
    x.v = rows(in.v, s, kvrow);
    const std::vector<int32_t> ds(c.doc_start.begin() + s * len,
                                  c.doc_start.begin() + (s + 1) * len);
    const Outputs o = RunBoth(one, x, ds);
    EXPECT_TRUE(SameBits(o.out, rows(all.out, s, qrow))) << s;
    EXPECT_TRUE(SameBits(o.lse, rows(all.lse, s, c.dims.q_heads))) << s;
    EXPECT_TRUE(SameBits(o.dq, rows(all.dq, s, qrow))) << s;
    EXPECT_TRUE(SameBits(o.dk, rows(all.dk, s, kvrow))) << s;
    EXPECT_TRUE(SameBits(o.dv, rows(all.dv, s, kvrow))) << s;
  }
}

TEST(Attention, EveryInstructionSetBuildGivesTheSameBits) {
  const internal::AttentionKernels* generic = internal::AttentionKernelsFor("generic");
  ASSERT_NE(generic, nullptr);
  for (const char* isa : {"avx2", "avx512"}) {
    const internal::AttentionKernels* wide = internal::AttentionKernelsFor(isa);
    if (wide == nullptr) continue;  // this CPU does not run it
    for (const Case& c : Cases()) {
      SCOPED_TRACE(c.name);
      const Inputs in = MakeInputs(c.dims, 17);
      ExpectSameBits(RunBoth(c.dims, in, c.doc_start, wide),
                     RunBoth(c.dims, in, c.doc_start, generic), wide->isa);
    }
  }
}

TEST(Attention, BlocksFollowTheDocuments) {
  // 10 padding, a 150-token document (blocks 64, 64, 22), a 3-token one, 7 padding.
  const std::vector<int32_t> ds = DocStarts({{-10, 150, 3, -7}});
  const std::vector<internal::AttentionBlock> blocks = internal::AttentionBlocks(ds);
  ASSERT_EQ(blocks.size(), 4u);
  const int64_t want[4][4] = {{10, 74, 0, 2}, {74, 138, 0, 2}, {138, 160, 0, 2}, {160, 163, 3, 3}};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(blocks[i].begin, want[i][0]) << i;
    EXPECT_EQ(blocks[i].end, want[i][1]) << i;
    EXPECT_EQ(blocks[i].first, want[i][2]) << i;
    EXPECT_EQ(blocks[i].last, want[i][3]) << i;
  }
  EXPECT_TRUE(internal::AttentionBlocks(DocStarts({{-5}})).empty());
}

TEST(Attention, EmptyCallsAreFine) {
  std::vector<float> none;
  EXPECT_TRUE(AttentionForward(Dims(0, 10, 2, 1, 16), none, none, none, {}, absl::MakeSpan(none),
                               absl::MakeSpan(none))
                  .ok());
  EXPECT_TRUE(AttentionBackward(Dims(3, 0, 2, 1, 16), none, none, none, {}, none, none, none,
                                absl::MakeSpan(none), absl::MakeSpan(none), absl::MakeSpan(none))
                  .ok());
}

// A bad argument is InvalidArgument naming the value, and nothing is written.
TEST(Attention, BadArgumentsAreInvalidArgument) {
  const AttentionDims good = Dims(1, 8, 4, 2, 16);
  const Inputs in = MakeInputs(good, 1);
  const std::vector<int32_t> ds = DocStarts({{5, -3}});
  std::vector<float> out(in.q.size(), 7.0f), lse(8 * 4, 7.0f), dq(in.q.size(), 7.0f),
      dk(in.k.size(), 7.0f), dv(in.k.size(), 7.0f);
  struct Bad {
    AttentionDims dims;
    std::vector<int32_t> doc_start;
    std::vector<float> q;
    std::string message;
  };
  std::vector<Bad> bad = {
      {Dims(-1, 8, 4, 2, 16), ds, in.q, "num_seqs = -1"},
      {Dims(1, -8, 4, 2, 16), ds, in.q, "seq_len = -8"},
      {Dims(1, 8, 0, 2, 16), ds, in.q, "q_heads = 0"},
      {Dims(1, 8, 4, 2, 0), ds, in.q, "head_dim = 0"},
      {Dims(1, 8, 4, 3, 16), ds, in.q, "q_heads = 4 is not a multiple of kv_heads = 3"},
      {Dims(1, 8, 4, 2, 16, {0, 1, 1}), ds, in.q, "kv_of_q has 3 entries"},
      {Dims(1, 8, 4, 2, 16, {0, 1, 2, 1}), ds, in.q, "kv_of_q[2] = 2"},
      {Dims(1, 8, 4, 2, 16, {0, -1, 1, 1}), ds, in.q, "kv_of_q[1] = -1"},
      {Dims(int64_t{1} << 40, int64_t{1} << 40, 4, 2, 16), ds, in.q, "overflow"},
      {good, ds, std::vector<float>(in.q.size() - 1), "q holds 511 values"},
      {good, {0, 0, 0, 0, 0, -1, -1}, in.q, "doc_start holds 7 values"},
      {good, {0, 0, 0, 4, 0, -1, -1, -1}, in.q, "doc_start[3] = 4"},
      {good, {0, 0, 0, 0, 0, -1, -2, -1}, in.q, "doc_start[6] = -2"},
      {good, {0, 0, 0, 0, 0, -1, 0, -1}, in.q, "doc_start[6] = 0"},   // across padding
      {good, {0, 0, 2, 2, 0, -1, -1, -1}, in.q, "doc_start[4] = 0"},  // back to an old doc
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.message);
    absl::Status s = AttentionForward(b.dims, b.q, in.k, in.v, b.doc_start, absl::MakeSpan(out),
                                      absl::MakeSpan(lse));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(b.message), std::string::npos) << s;
    s = AttentionBackward(b.dims, b.q, in.k, in.v, b.doc_start, out, lse, in.d_out,
                          absl::MakeSpan(dq), absl::MakeSpan(dk), absl::MakeSpan(dv));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(b.message), std::string::npos) << s;
  }
  // Output and gradient sizes.
  std::vector<float> short_out(out.size() - 1);
  absl::Status s =
      AttentionForward(good, in.q, in.k, in.v, ds, absl::MakeSpan(short_out), absl::MakeSpan(lse));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("out holds 511"), std::string::npos) << s;
  std::vector<float> short_dv(dv.size() + 1);
  s = AttentionBackward(good, in.q, in.k, in.v, ds, out, lse, in.d_out, absl::MakeSpan(dq),
                        absl::MakeSpan(dk), absl::MakeSpan(short_dv));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("dv holds 257"), std::string::npos) << s;
  for (float x : out) ASSERT_EQ(x, 7.0f);
  for (float x : lse) ASSERT_EQ(x, 7.0f);
  for (float x : dq) ASSERT_EQ(x, 7.0f);
  for (float x : dk) ASSERT_EQ(x, 7.0f);
  for (float x : dv) ASSERT_EQ(x, 7.0f);
}

}  // namespace
}  // namespace gradsum::model
