#ifndef GRADSUM_MODEL_FLOPS_H_
#define GRADSUM_MODEL_FLOPS_H_

// The FLOPs of one moe_lm training step (SEMANTICS.md §10), counted from the model's
// shapes and the step's actual documents: the yardstick of the trainer's MFU
// (StepMetrics.model_flops, flops_per_s, mfu) and of the step benchmarks' pct_of_limit.
//
//   StepFlops f = CountStepFlops(config, document_lengths, /*recompute_full=*/false);
//   mfu = f.model / step_seconds / peak_flops_per_s;
//
// What is counted (2 FLOPs per multiply-add, document tokens only: padding rows carry no
// work of the model):
// - per token, forward: every matmul a token passes through. Per layer (and per MTP
//   depth's layer) the attention projections Wq, Wo (D x D) and Wk, Wv (D x kv_heads *
//   head_dim), the router (D x E), and top_k experts' three D x H matrices (MoE at the
//   routed tokens, dropless: every token has top_k slots); per MTP depth its two D x D
//   projections; the head (D x V) once for the main CE and once per MTP depth.
// - attention's score and value products (q k^T and p v, 2 head_dim FLOPs each per query
//   head and score entry) over the score entries the blocked kernel computes
//   (model/attention.h): each document is cut into blocks of 64 tokens from its first
//   token, query block i computes its document's key blocks 0..i in full, so the causal
//   mask's upper half of the diagonal blocks is counted as computed, and nothing across
//   documents or on padding is.
// - backward = 2x forward (the gradients of both operands of every product).
// model = 3 x forward. hardware = model plus what recomputation adds: the attention
// backward's recomputed scores (2 head_dim per entry and query head, every layer) and,
// with --recompute=full, every layer's second forward (all of it but the router, whose
// decisions are kept).

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "model/moe_lm_spec.h"

namespace gradsum::model {

struct StepFlops {
  double model = 0;     // forward + backward of the model's products
  double hardware = 0;  // model + recomputation (>= model)
};

// The attention score entries (query, key) the blocked kernel computes for one document of
// `length` tokens (blocks of `block` tokens from the document's first token).
int64_t ComputedScoreEntries(int64_t length, int64_t block = 64);

// Forward FLOPs of one document token through the model's matmuls (no attention scores).
double MatmulForwardFlopsPerToken(const MoeLmConfig& m);

// The step's FLOPs over the documents of every sequence of the global batch (their lengths
// in tokens, each <= seq_len). `recompute_full`: --recompute=full.
StepFlops CountStepFlops(const MoeLmConfig& m, absl::Span<const int64_t> document_lengths,
                         bool recompute_full);

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_FLOPS_H_
