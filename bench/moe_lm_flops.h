#ifndef GRADSUM_BENCH_MOE_LM_FLOPS_H_
#define GRADSUM_BENCH_MOE_LM_FLOPS_H_

// The matmul FLOP count of one moe_lm token (SEMANTICS.md §10): the physical yardstick the
// step benchmarks divide by. Forward: per layer K experts x 3 GEMMs of D x H (2 FLOPs per
// multiply-add) plus the router's D x E, then the head's D x V; backward = 2x forward.

#include "train/config.pb.h"

namespace gradsum::bench {

inline double MoeLmFlopsPerToken(const train::ModelConfig& m) {
  const double d = m.dim(), h = m.expert_dim(), e = m.experts(), v = m.vocab();
  const double forward = m.layers() * (m.top_k() * 6 * d * h + 2 * d * e) + 2 * d * v;
  return 3 * forward;
}

}  // namespace gradsum::bench

#endif  // GRADSUM_BENCH_MOE_LM_FLOPS_H_
