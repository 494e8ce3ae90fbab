#ifndef GRADSUM_MODEL_ATTENTION_H_
#define GRADSUM_MODEL_ATTENTION_H_

// The attention of moe_lm's attention block (SEMANTICS.md §10) on the CPU: document-causal
// softmax(q k^T / sqrt(head_dim)) v over packed sequences, with grouped key/value heads,
// forward and backward, fp32. The caller applies RoPE and the projections; this is the part
// between them.
//
//   AttentionDims dims;
//   dims.num_seqs = 2; dims.seq_len = 1024; dims.q_heads = 8; dims.kv_heads = 2;
//   dims.head_dim = 64;
//   GRADSUM_RETURN_IF_ERROR(AttentionForward(dims, q, k, v, doc_start, out, lse));
//   GRADSUM_RETURN_IF_ERROR(AttentionBackward(dims, q, k, v, doc_start, out, lse, d_out,
//                                             dq, dk, dv));
//
// How it computes (flash-attention style, memory linear in seq_len: no [T, T] scores):
// - Each document of a sequence is cut into blocks of up to 64 tokens from its first token
//   (model/attention_kernels.h). Query block i of a document attends the document's key
//   blocks 0..i; only the diagonal block needs the causal mask, blocks of other documents
//   and padding are never computed.
// - Forward: per (sequence, query head), the query blocks in order, each over its key
//   blocks in order with an online softmax. Backward: per (sequence, kv head), document by
//   document, that kv head's query heads in ascending order, for each the query blocks in
//   order and each over its key blocks in order, recomputing the probabilities from lse
//   (dq of a query block sums its key blocks in order; dk / dv of a key block sum the
//   query blocks in order for each head, then the heads in order).
// - The block products are a register-blocked micro-kernel (the BLAS call costs more than
//   the work at these 64-row blocks; docs/BENCHMARKS.md "Attention"), built for baseline,
//   AVX2 + FMA and AVX-512 and picked at run time (core/cpu_isa.h). Every multiply-add is
//   a fused one and every sum has a fixed order, so all builds give the same bits.
// - The tasks run on the shared pool, ParallelFor(ComputeThreads(), ...) (they cannot fail:
//   every check comes before them).
//
// Reproducibility (SEMANTICS.md §11, §12): each output element is computed by one task in
// a fixed order, so its bits do not depend on the thread count, on the CPU's instruction
// set, or on which other sequences and heads are in the call: a call with a subset of the
// heads (kv_of_q) or one sequence gives those heads' / that sequence's slices of the full
// call bit for bit. dk and dv of a kv head are the sum over the call's query heads that
// use it, in ascending order of query head, of each head's own contribution; so a call that
// gives each query head its own kv slot (kv_of_q = 0, 1, ..., kv heads replicated) returns
// exactly the per-head contributions, which a caller may then sum in any fixed way.

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
  // h / (q_heads / kv_heads). (Sequence parallelism gives a rank a subset of heads.)
  std::vector<int> kv_of_q;
};

// Token-major layouts, T = num_seqs * seq_len rows:
//   q, out, d_out, dq: [T, q_heads, head_dim];  k, v, dk, dv: [T, kv_heads, head_dim]
//   lse: [T, q_heads] fp32 log-sum-exp of the scaled scores (what backward needs)
//   doc_start[t]: index within t's sequence of the first token of t's document, or -1 for
//   padding. Query t attends key s of the same sequence iff doc_start[s] == doc_start[t] != -1
//   and s <= t (causal inside the document). A padding query's output (and dq) is 0 and
//   its lse 0; padding keys are never attended (their dk, dv are 0).
// A document is a contiguous run of tokens: doc_start[t] is -1, or t (t starts a
// document), or doc_start[t - 1] (t continues the document of t - 1).
//
// InvalidArgument, naming the value, for: num_seqs or seq_len < 0; q_heads, kv_heads or
// head_dim < 1; q_heads % kv_heads != 0 with kv_of_q empty; kv_of_q of another size than
// q_heads or an entry outside [0, kv_heads); a span of another size than its layout;
// doc_start[t] other than -1 outside [0, t] or breaking the contiguity above. Nothing is
// written then. Spans must not overlap, except the inputs with each other.
absl::Status AttentionForward(const AttentionDims& dims, absl::Span<const float> q,
                              absl::Span<const float> k, absl::Span<const float> v,
                              absl::Span<const int32_t> doc_start, absl::Span<float> out,
                              absl::Span<float> lse);

// Given d_out = dL/dout, writes (does not accumulate) dq, dk, dv. out and lse must be what
// AttentionForward returned for the same inputs (backward recomputes the probabilities
// from lse). The same errors as AttentionForward.
absl::Status AttentionBackward(const AttentionDims& dims, absl::Span<const float> q,
                               absl::Span<const float> k, absl::Span<const float> v,
                               absl::Span<const int32_t> doc_start, absl::Span<const float> out,
                               absl::Span<const float> lse, absl::Span<const float> d_out,
                               absl::Span<float> dq, absl::Span<float> dk, absl::Span<float> dv);

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_ATTENTION_H_
