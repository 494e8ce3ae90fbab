#include "model/flops.h"

#include <algorithm>

#include "model/attention_kernels.h"

namespace gradsum::model {

int64_t ComputedScoreEntries(int64_t length, int64_t block) {
  // Full blocks 0..f-1 of `block` tokens, then a last block of r tokens. Query block i
  // (full) computes (i + 1) full key blocks; the last block computes every full block and
  // itself.
  const int64_t f = length / block, r = length % block;
  return block * block * f * (f + 1) / 2 + r * (f * block + r);
}

namespace {

// Forward FLOPs of one token through one layer's matmuls (attention projections, router,
// top_k experts); `with_router` false for --recompute=full's second forward.
double LayerMatmulForward(const MoeLmConfig& m, bool with_router) {
  const double d = static_cast<double>(m.dim), h = static_cast<double>(m.expert_dim);
  double f = m.top_k * 3 * 2 * d * h;
  if (with_router) f += 2 * d * m.experts;
  if (m.attention) {
    const double kv = static_cast<double>(m.n_kv_heads) * (m.dim / m.n_heads);
    f += 2 * (2 * d * d + 2 * d * kv);
  }
  return f;
}

}  // namespace

double MatmulForwardFlopsPerToken(const MoeLmConfig& m) {
  const double d = static_cast<double>(m.dim), v = static_cast<double>(m.vocab);
  return MoeLayersOf(m) * LayerMatmulForward(m, /*with_router=*/true) +
         2 * static_cast<double>(ExtraBlockProjectionWeights(m)) + LabelStreamsOf(m) * 2 * d * v;
}

StepFlops CountStepFlops(const MoeLmConfig& m, absl::Span<const int64_t> document_lengths,
                         bool recompute_full) {
  double tokens = 0, entries = 0;
  for (int64_t n : document_lengths) {
    tokens += static_cast<double>(n);
    if (m.attention) {
      entries += static_cast<double>(ComputedScoreEntries(n, internal::kAttentionBlock));
    }
  }
  const int layers = MoeLayersOf(m);
  // Per score entry and layer: q k^T and p v, head_dim multiply-adds each per query head;
  // heads x head_dim = D.
  const double score_forward = layers * entries * 2 * 2 * static_cast<double>(m.dim);
  const double forward = tokens * MatmulForwardFlopsPerToken(m) + score_forward;
  StepFlops f;
  f.model = 3 * forward;
  // The attention backward recomputes q k^T (model/attention.h: from lse).
  f.hardware = f.model + score_forward / 2;
  if (recompute_full) {
    f.hardware += tokens * layers * LayerMatmulForward(m, /*with_router=*/false) + score_forward;
  }
  return f;
}

}  // namespace gradsum::model
