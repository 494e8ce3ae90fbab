#ifndef GRADSUM_MODEL_ATTENTION_TESTING_H_
#define GRADSUM_MODEL_ATTENTION_TESTING_H_

// Test inputs for the attention kernels (model/attention.h, model/cuda/attention_cuda.h):
// document layouts of packed sequences, and seeded random tensors.
//
//   // 2 sequences of 100: a 70-token document, 10 padding, a 20-token document
//   std::vector<int32_t> ds = DocStarts({{70, -10, 20}, {100}});
//   std::vector<float> q = RandomTensor(T * q_heads * head_dim, /*seed=*/1);

#include <cstdint>
#include <initializer_list>
#include <random>
#include <vector>

namespace gradsum::model::testing {

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

}  // namespace gradsum::model::testing

#endif  // GRADSUM_MODEL_ATTENTION_TESTING_H_
