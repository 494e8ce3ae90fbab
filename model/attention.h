#ifndef GRADSUM_MODEL_ATTENTION_H_
#define GRADSUM_MODEL_ATTENTION_H_

// Document-causal attention of packed sequences on the CPU (SEMANTICS.md §10), forward and
// backward: query t attends the keys s of its own document with s <= t, scale
// 1 / sqrt(head_dim); padding neither attends nor is attended to.
//
//   AttentionDims dims{.num_seqs = J, .seq_len = S, .q_heads = 8, .kv_heads = 2,
//                      .head_dim = 64};
//   GRADSUM_RETURN_IF_ERROR(AttentionForward(dims, q, k, v, doc_start, out, lse));
//   GRADSUM_RETURN_IF_ERROR(AttentionBackward(dims, q, k, v, doc_start, out, lse, d_out,
//                                             dq, dk, dv));
//
// This is the plain per-query implementation the blocked kernel replaces (same interface,
// same results to rounding): memory linear in the sequence, work quadratic in each
// document. Every output depends only on its own (sequence, head), computed in a fixed
// order, so the bits do not depend on the thread count or on which other heads and
// sequences share the call.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace gradsum::model {

struct AttentionDims {
  int64_t num_seqs = 0;  // sequences (each attends only within itself)
  int64_t seq_len = 0;   // tokens per sequence
  int q_heads = 0;       // query heads held
  int kv_heads = 0;      // key/value heads held
  int64_t head_dim = 0;  // d; scale = 1 / sqrt(d)
  // kv head of each query head (q_heads entries in [0, kv_heads)); empty means GQA grouping
  // h / (q_heads / kv_heads).
  std::vector<int> kv_of_q;
};

// Token-major layouts, T = num_seqs * seq_len rows:
//   q, out, d_out, dq: [T, q_heads, head_dim];  k, v, dk, dv: [T, kv_heads, head_dim]
//   lse: [T, q_heads] fp32 log-sum-exp of the scaled scores (what backward needs)
//   doc_start[t]: index within t's sequence of the first token of t's document, or -1 for
//   padding. Query t attends key s of the same sequence iff doc_start[s] == doc_start[t]
//   != -1 and s <= t. A padding query's output (and dq) is 0 and its lse 0.
// InvalidArgument naming the value for bad sizes, heads that do not divide, kv_of_q out
// of range, or a doc_start that is neither -1 nor in [0, position in the sequence].
absl::Status AttentionForward(const AttentionDims& dims, absl::Span<const float> q,
                              absl::Span<const float> k, absl::Span<const float> v,
                              absl::Span<const int32_t> doc_start, absl::Span<float> out,
                              absl::Span<float> lse);

// Writes (does not accumulate) dq, dk, dv; dk and dv of a kv head shared by several query
// heads sum them in query-head order.
absl::Status AttentionBackward(const AttentionDims& dims, absl::Span<const float> q,
                               absl::Span<const float> k, absl::Span<const float> v,
                               absl::Span<const int32_t> doc_start, absl::Span<const float> out,
                               absl::Span<const float> lse, absl::Span<const float> d_out,
                               absl::Span<float> dq, absl::Span<float> dk, absl::Span<float> dv);

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_ATTENTION_H_
