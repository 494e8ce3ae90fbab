#ifndef GRADSUM_BENCH_MOE_LM_FLOPS_H_
#define GRADSUM_BENCH_MOE_LM_FLOPS_H_

// The matmul FLOP count of one moe_lm token (SEMANTICS.md §10): the physical yardstick the
// step benchmarks divide by. Forward: per layer K experts x 3 GEMMs of D x H (2 FLOPs per
// multiply-add) plus the router's D x E and, with attention, the projections Wq, Wo (D x D)
// and Wk, Wv (D x kv_heads * head_dim); then the head's D x V; backward = 2x forward. The
// attention scores and their weighted sum are not counted: they depend on the documents'
// lengths (here about 10% of the projections), so with attention the rate is a lower bound.

#include "train/config.pb.h"

namespace gradsum::bench {

inline double MoeLmFlopsPerToken(const train::ModelConfig& m) {
  const double d = m.dim(), h = m.expert_dim(), e = m.experts(), v = m.vocab();
  const double kv_width = d / m.heads() * m.kv_heads();
  const double attention =
      m.attention() == train::ModelConfig::none ? 0 : 2 * (2 * d * d + 2 * d * kv_width);
  const double forward = m.layers() * (m.top_k() * 6 * d * h + 2 * d * e + attention) + 2 * d * v;
  return 3 * forward;
}

}  // namespace gradsum::bench

#endif  // GRADSUM_BENCH_MOE_LM_FLOPS_H_
