#ifndef GRADSUM_BENCH_TRANSFORMER_GRADS_H_
#define GRADSUM_BENCH_TRANSFORMER_GRADS_H_

// The gradient set the collectives suites reduce (thread and MPI backends alike):
// 300 f32 tensors of a small transformer, 1 KiB to 4 MiB, about 64 MiB in all.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradsum::bench {

// Sizes in f32 elements: a 4 MiB embedding, then 20 blocks of 15 tensors (d = 256:
// norms and biases of 1-4 KiB, attention projections of 256 KiB, MLP matrices of 1 MiB),
// minus one norm so that there are exactly 300.
inline std::vector<size_t> TransformerGradSizes() {
  constexpr size_t d = 256;
  std::vector<size_t> sizes = {1 << 20};  // embedding: 2^20 f32 = 4 MiB
  for (int layer = 0; layer < 20; ++layer) {
    const std::vector<size_t> block = {d,     d, d * d, d, d * d,     d,     d * d,    d,
                                       d * d, d, d,     d, 4 * d * d, 4 * d, 4 * d * d};
    for (size_t i = (layer == 0 ? 1 : 0); i < block.size(); ++i) sizes.push_back(block[i]);
  }
  return sizes;  // 1 + 14 + 19 * 15 = 300
}

// Total bytes of the set (f32).
inline int64_t TransformerGradBytes() {
  int64_t total = 0;
  for (size_t n : TransformerGradSizes()) total += static_cast<int64_t>(n * sizeof(float));
  return total;
}

}  // namespace gradsum::bench

#endif  // GRADSUM_BENCH_TRANSFORMER_GRADS_H_
