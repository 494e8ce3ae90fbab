#ifndef GRADSUM_MODEL_ATTENTION_TESTING_H_
#define GRADSUM_MODEL_ATTENTION_TESTING_H_

// Test helpers for the attention kernels (model/attention.h, model/cuda/attention_cuda.h):
// dims, document layouts of packed sequences, seeded random tensors, comparisons.
//
//   // 2 sequences of 100: a 70-token document, 10 padding, a 20-token document
//   std::vector<int32_t> ds = DocStarts({{70, -10, 20}, {100}});
//   std::vector<float> q = RandomTensor(T * q_heads * head_dim, /*seed=*/1);

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "model/attention.h"
#include "model/moe_lm_spec.h"

namespace gradsum::model::testing {

// A one-layer model with attention of `heads` query and `kv_heads` key/value heads of
// head_dim 4 and a tiny MoE (the ops' and the attention block's tests).
inline MoeLmConfig AttentionConfig(int heads, int kv_heads) {
  MoeLmConfig c;
  c.vocab = 16;
  c.dim = heads * 4;  // head_dim 4
  c.layers = 1;
  c.experts = 4;
  c.top_k = 1;
  c.expert_dim = 4;
  c.attention = true;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  return c;
}

inline AttentionDims Dims(int64_t num_seqs, int64_t seq_len, int q_heads, int kv_heads,
                          int64_t head_dim, std::vector<int> kv_of_q = {}) {
  AttentionDims dims;
  dims.num_seqs = num_seqs;
  dims.seq_len = seq_len;
  dims.q_heads = q_heads;
  dims.kv_heads = kv_heads;
  dims.head_dim = head_dim;
  dims.kv_of_q = std::move(kv_of_q);
  return dims;
}

// doc_start of one sequence from its pieces in order: n > 0 a document of n tokens, n < 0
// -n padding tokens.
inline std::vector<int32_t> SequenceDocStarts(const std::vector<int64_t>& pieces) {
  std::vector<int32_t> ds;
  for (int64_t n : pieces) {
    const int32_t start = static_cast<int32_t>(ds.size());
    for (int64_t i = 0; i < (n > 0 ? n : -n); ++i) ds.push_back(n > 0 ? start : -1);
  }
  return ds;
}

// The sequences' doc_starts concatenated (each sequence's pieces must sum to seq_len).
inline std::vector<int32_t> DocStarts(const std::vector<std::vector<int64_t>>& sequences) {
  std::vector<int32_t> ds;
  for (const std::vector<int64_t>& pieces : sequences) {
    const std::vector<int32_t> one = SequenceDocStarts(pieces);
    ds.insert(ds.end(), one.begin(), one.end());
  }
  return ds;
}

// A sequence of `len` tokens cut into documents of random lengths in [1, max_doc]
// (the last one cut to fit), then `padding` tokens of padding at the end.
inline std::vector<int64_t> RandomPieces(int64_t len, int64_t max_doc, int64_t padding,
                                         uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> doc_len(1, max_doc);
  std::vector<int64_t> pieces;
  int64_t left = len - padding;
  while (left > 0) {
    const int64_t drawn = doc_len(gen);
    const int64_t n = drawn < left ? drawn : left;
    pieces.push_back(n);
    left -= n;
  }
  if (padding > 0) pieces.push_back(-padding);
  return pieces;
}

// n normal(0, scale) floats from a fixed seed.
inline std::vector<float> RandomTensor(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

struct AttentionCase {
  std::string name;
  AttentionDims dims;
  std::vector<int32_t> doc_start;
};

// The shapes both devices' tests run: with and without GQA, kv_of_q subsets and an unused
// kv head, head_dim 16 / 24 / 32 / 64 / 128, one document, many short ones, padding (at
// the end, inside, a whole sequence), documents across 64-token blocks, seq_len not a
// multiple of 64, single-token sequences, and the benchmark's T = 1024 layout.
inline std::vector<AttentionCase> AttentionCases() {
  return {
      {"one_document", Dims(1, 100, 2, 2, 16), DocStarts({{100}})},
      {"one_document_three_blocks_d64", Dims(1, 150, 2, 1, 64), DocStarts({{150}})},
      {"gqa_documents_across_blocks_padding_tail", Dims(2, 150, 4, 2, 64),
       DocStarts({{70, 61, -19}, {5, 128, 7, -10}})},
      {"many_short_documents", Dims(1, 97, 2, 1, 16), DocStarts({RandomPieces(97, 5, 3, 11)})},
      {"kv_of_q_head_dim_24", Dims(2, 80, 3, 2, 24, {1, 0, 1}), DocStarts({{64, 16}, {-3, 77}})},
      {"unused_kv_head_and_padding_inside", Dims(1, 130, 2, 3, 16, {2, 0}),
       DocStarts({{65, -5, 60}})},
      {"random_documents_d64_mqa", Dims(3, 200, 4, 1, 64),
       DocStarts({RandomPieces(200, 90, 0, 1), RandomPieces(200, 40, 13, 2),
                  RandomPieces(200, 200, 0, 3)})},
      {"all_padding_sequence", Dims(2, 20, 2, 2, 16), DocStarts({{-20}, {20}})},
      {"long_documents_d128", Dims(2, 300, 4, 1, 128),
       DocStarts({RandomPieces(300, 250, 0, 4), RandomPieces(300, 40, 13, 5)})},
      {"bench_layout_t1024", Dims(1, 1024, 8, 2, 64), DocStarts({{355, 269, 146, 254}})},
      {"single_token_sequences_d32", Dims(3, 1, 2, 1, 32), DocStarts({{1}, {-1}, {1}})},
  };
}

// The case of that name (a test failure and an empty case if there is none).
inline AttentionCase AttentionCaseNamed(const std::string& name) {
  for (AttentionCase& c : AttentionCases()) {
    if (c.name == name) return c;
  }
  ADD_FAILURE() << "no attention case " << name;
  return {};
}

// ---- the reference, in double ----------------------------------------------------------
// Written straightforwardly: for every query, the list of keys it sees, then the textbook
// softmax and its backward in double (the CPU, CUDA and ring attention tests compare to it).

struct Grads {
  std::vector<double> out, lse, dq, dk, dv;
};

inline int KvOf(const AttentionDims& dims, int h) {
  return dims.kv_of_q.empty() ? h / (dims.q_heads / dims.kv_heads) : dims.kv_of_q[h];
}

// softmax(q k^T / sqrt(d)) v over each query's visible keys, and its backward for d_out.
inline Grads Reference(const AttentionDims& dims, const std::vector<float>& q,
                       const std::vector<float>& k, const std::vector<float>& v,
                       const std::vector<int32_t>& ds, const std::vector<float>& d_out) {
  const int64_t len = dims.seq_len, d = dims.head_dim, hq = dims.q_heads, hkv = dims.kv_heads;
  const int64_t tokens = dims.num_seqs * len;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Grads g;
  g.out.assign(tokens * hq * d, 0.0);
  g.lse.assign(tokens * hq, 0.0);
  g.dq.assign(tokens * hq * d, 0.0);
  g.dk.assign(tokens * hkv * d, 0.0);
  g.dv.assign(tokens * hkv * d, 0.0);
  auto qi = [&](int64_t t, int64_t h) { return (t * hq + h) * d; };
  auto ki = [&](int64_t t, int64_t j) { return (t * hkv + j) * d; };
  for (int64_t s = 0; s < dims.num_seqs; ++s) {
    for (int h = 0; h < hq; ++h) {
      const int j = KvOf(dims, h);
      for (int64_t a = 0; a < len; ++a) {
        const int64_t t = s * len + a;
        if (ds[t] < 0) continue;
        std::vector<int64_t> keys;
        for (int64_t b = 0; b <= a; ++b) {
          if (ds[s * len + b] == ds[t]) keys.push_back(s * len + b);
        }
        std::vector<double> z(keys.size());
        double mx = -INFINITY;
        for (size_t x = 0; x < keys.size(); ++x) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) {
            dot += double{q[qi(t, h) + c]} * k[ki(keys[x], j) + c];
          }
          z[x] = dot * scale;
          mx = std::max(mx, z[x]);
        }
        double sum = 0;
        for (double zx : z) sum += std::exp(zx - mx);
        g.lse[t * hq + h] = mx + std::log(sum);
        std::vector<double> p(keys.size());
        for (size_t x = 0; x < keys.size(); ++x) p[x] = std::exp(z[x] - mx) / sum;
        for (size_t x = 0; x < keys.size(); ++x) {
          for (int64_t c = 0; c < d; ++c) g.out[qi(t, h) + c] += p[x] * v[ki(keys[x], j) + c];
        }
        // Backward: dp_x = d_out . v_x; ds_x = p_x (dp_x - sum_y p_y dp_y).
        std::vector<double> dp(keys.size());
        double row = 0;
        for (size_t x = 0; x < keys.size(); ++x) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) {
            dot += double{d_out[qi(t, h) + c]} * v[ki(keys[x], j) + c];
          }
          dp[x] = dot;
          row += p[x] * dot;
        }
        for (size_t x = 0; x < keys.size(); ++x) {
          const double dsx = p[x] * (dp[x] - row) * scale;
          for (int64_t c = 0; c < d; ++c) {
            g.dv[ki(keys[x], j) + c] += p[x] * d_out[qi(t, h) + c];
            g.dq[qi(t, h) + c] += dsx * k[ki(keys[x], j) + c];
            g.dk[ki(keys[x], j) + c] += dsx * q[qi(t, h) + c];
          }
        }
      }
    }
  }
  return g;
}

// |got - want| <= tol * (1 + max |want|) everywhere (NaN fails); reports the first miss.
template <typename Want>
void ExpectNear(const std::vector<float>& got, const std::vector<Want>& want, double tol,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1;
  for (Want w : want) scale = std::max(scale, std::abs(static_cast<double>(w)));
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i])), tol * scale)
        << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
  }
}

inline bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace gradsum::model::testing

#endif  // GRADSUM_MODEL_ATTENTION_TESTING_H_
