#ifndef GRADSUM_MODEL_ATTENTION_KERNELS_H_
#define GRADSUM_MODEL_ATTENTION_KERNELS_H_

// Internal to model/attention: the blocks a sequence is cut into, and the per-task block
// math of the CPU attention (model/attention_kernels.inc), built for three instruction sets
// and picked once per process at run time (core/cpu_isa.h): baseline, AVX2 + FMA and
// AVX-512. Every build gives the same bits: the products are chains of fused multiply-adds
// in a fixed order (an exact emulation of the fused operation where the baseline x86-64
// target has none, which makes that build several times slower), the exp is
// core/fast_exp.inc's, the softmax sums run over the keys in order (elementwise across the
// queries), the backward's d_out . out row sums in 16 fixed lanes added in a fixed tree,
// and nothing is contracted or reassociated. GRADSUM_ATTENTION_ISA=generic|avx2|avx512 forces
// a build (for comparison).
//
// Blocks: each document is cut into blocks of at most kAttentionBlock tokens from its first
// token, so query block i of a document attends exactly the key blocks first..i of the
// same document, the off-diagonal ones fully and the diagonal one causally. Padding tokens
// are in no block.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/cpu_isa.h"
#include "model/attention.h"

namespace gradsum::model::internal {

inline constexpr int64_t kAttentionBlock = 64;   // tokens per block, at most
inline constexpr int64_t kAttentionColPad = 16;  // padded widths are multiples of this

// Tokens [begin, end) of one sequence (indices within the sequence), all of one document;
// first / last: the indices (in the sequence's block list) of that document's first and
// last block.
struct AttentionBlock {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t first = 0;
  int64_t last = 0;
};

// What AttentionDims implies, once checked.
struct AttentionShape {
  int64_t tokens = 0;        // T = num_seqs * seq_len
  int64_t q_floats = 0;      // T * q_heads * head_dim
  int64_t kv_floats = 0;     // T * kv_heads * head_dim
  int64_t lse_floats = 0;    // T * q_heads
  std::vector<int> kv_of_q;  // q_heads entries (the GQA grouping where dims.kv_of_q is empty)
};

// The checks of model/attention.h on dims alone (sizes, head counts, kv_of_q), shared by
// the CPU and CUDA kernels; InvalidArgument naming the value.
absl::StatusOr<AttentionShape> CheckAttentionDims(const AttentionDims& dims);

// The doc_start check of one token: `index` in [0, T) with `value` = doc_start[index] and
// `previous` = doc_start[index - 1] (-1 for a sequence's first token). OK, or the
// InvalidArgument (naming the value, its sequence and token) the attention returns.
absl::Status CheckDocStartToken(const AttentionDims& dims, int64_t index, int32_t value,
                                int32_t previous);

// 1 / sqrt(head_dim) rounded once to fp32: the scale of every device's kernel.
float AttentionScale(int64_t head_dim);

// The blocks of one sequence, given its doc_start (already validated: contiguous
// documents, model/attention.h), in token order.
std::vector<AttentionBlock> AttentionBlocks(absl::Span<const int32_t> doc_start);

// One (sequence, query head) of the forward. Pointers are at the sequence's token 0:
// query row t at q + t * q_stride (head_dim floats), key / value row t at k, v + t *
// kv_stride, output row at out + t * q_stride, lse at lse[t * lse_stride]. Writes every
// row of the sequence (padding rows: 0, lse 0).
struct AttentionForwardTask {
  const AttentionBlock* blocks = nullptr;
  int64_t num_blocks = 0;
  int64_t seq_len = 0;
  int64_t head_dim = 0;
  int64_t padded_dim = 0;  // head_dim rounded up to kAttentionColPad
  float scale = 0;
  const float* q = nullptr;
  int64_t q_stride = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t kv_stride = 0;
  float* out = nullptr;
  float* lse = nullptr;
  int64_t lse_stride = 0;
  float* scratch = nullptr;  // forward_scratch_floats(seq_len, padded_dim) floats
};

// One (sequence, kv head) of the backward, with the query heads that use the kv head.
// Query head heads[i]'s row t is at q + t * q_stride + heads[i] * head_dim (likewise out,
// d_out, dq), its lse at lse[t * lse_stride + heads[i]]; the kv head's rows at k, v, dk,
// dv + t * kv_stride. Writes every dq row of those heads and every dk / dv row of the kv
// head in the sequence.
struct AttentionBackwardTask {
  const AttentionBlock* blocks = nullptr;
  int64_t num_blocks = 0;
  int64_t seq_len = 0;
  int64_t head_dim = 0;
  int64_t padded_dim = 0;
  float scale = 0;
  const int* heads = nullptr;  // ascending
  int num_heads = 0;
  const float* q = nullptr;
  const float* out = nullptr;
  const float* d_out = nullptr;
  float* dq = nullptr;
  int64_t q_stride = 0;
  const float* lse = nullptr;
  int64_t lse_stride = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  int64_t kv_stride = 0;
  float* scratch = nullptr;  // backward_scratch_floats(seq_len, padded_dim) floats
};

// One (query segment, key segment) pair of one query head, for ring attention
// (model/ring_attention.h): rows of two arbitrary pieces of one sequence. Query row r < m
// is at q + r * q_stride, with its index within the sequence q_index[r] and its document
// q_doc[r] (the document's first token, -1 for padding); key / value row c < n at k, v + c
// * kv_stride with k_index[c], k_doc[c]. Key c is attended by query r iff k_doc[c] ==
// q_doc[r] != -1 and k_index[c] <= q_index[r]; indices ascend within each segment. Blocks
// of kAttentionBlock rows on each side that the mask leaves empty are skipped.
//
// The forward carries an online softmax across calls: run_max[r], run_sum[r] (start at
// -inf and 0) and acc[r * acc_stride + 0..padded_dim) (starts at 0), the unnormalised
// output, are updated with this pair's keys in order (a row none of them attends keeps its
// state). The attention of the keys of several calls is acc / run_sum, lse = run_max +
// log(run_sum).
struct AttentionPairForwardTask {
  int64_t m = 0, n = 0;
  int64_t head_dim = 0;
  int64_t padded_dim = 0;
  float scale = 0;
  const float* q = nullptr;
  int64_t q_stride = 0;
  const int32_t* q_index = nullptr;
  const int32_t* q_doc = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t kv_stride = 0;
  const int32_t* k_index = nullptr;
  const int32_t* k_doc = nullptr;
  float* run_max = nullptr;  // [m], stride 1
  float* run_sum = nullptr;  // [m]
  float* acc = nullptr;      // [m, padded_dim] rows acc_stride apart
  int64_t acc_stride = 0;
  float* scratch = nullptr;  // pair_forward_scratch_floats(padded_dim) floats
};

// The backward of one pair, given each query row's final lse[r] (over every key of the
// sequence) and dsum[r] = d_out[r] . out[r]: ADDS the pair's contributions into dq[r *
// grad_q_stride + 0..padded_dim), dk and dv[c * grad_kv_stride + 0..padded_dim) (padded
// columns get zeros added). Query row r's d_out row is at d_out + r * q_stride.
struct AttentionPairBackwardTask {
  int64_t m = 0, n = 0;
  int64_t head_dim = 0;
  int64_t padded_dim = 0;
  float scale = 0;
  const float* q = nullptr;
  const float* d_out = nullptr;
  int64_t q_stride = 0;
  const int32_t* q_index = nullptr;
  const int32_t* q_doc = nullptr;
  const float* lse = nullptr;   // [m], stride 1
  const float* dsum = nullptr;  // [m]
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t kv_stride = 0;
  const int32_t* k_index = nullptr;
  const int32_t* k_doc = nullptr;
  float* dq = nullptr;
  int64_t grad_q_stride = 0;
  float* dk = nullptr;
  float* dv = nullptr;
  int64_t grad_kv_stride = 0;
  float* scratch = nullptr;  // pair_backward_scratch_floats(padded_dim) floats
};

struct AttentionKernels {
  void (*forward)(const AttentionForwardTask& task) = nullptr;
  void (*pair_forward)(const AttentionPairForwardTask& task) = nullptr;
  void (*pair_backward)(const AttentionPairBackwardTask& task) = nullptr;
  int64_t (*pair_forward_scratch_floats)(int64_t padded_dim) = nullptr;
  int64_t (*pair_backward_scratch_floats)(int64_t padded_dim) = nullptr;
  void (*backward)(const AttentionBackwardTask& task) = nullptr;
  // Scratch of one task (linear in seq_len; need not be initialised).
  int64_t (*forward_scratch_floats)(int64_t seq_len, int64_t padded_dim) = nullptr;
  int64_t (*backward_scratch_floats)(int64_t seq_len, int64_t padded_dim) = nullptr;
  // The micro-kernel alone, for the benchmark's comparison with the BLAS:
  // c[m, n] = a[m, k] b[k, n], row-major with row strides lda, ldb, ldc; n % 16 == 0.
  void (*product)(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float* c, int64_t ldc) = nullptr;
  const char* isa = "";  // "generic", "avx2+fma" or "avx512"
};

namespace attention_generic {
AttentionKernels Kernels();
}
#if defined(GRADSUM_ISA_X86)
namespace attention_avx2 {
AttentionKernels Kernels();  // only through AttentionKernelsFor: needs AVX2 + FMA
}
namespace attention_avx512 {
AttentionKernels Kernels();  // only through AttentionKernelsFor: needs AVX-512
}
#endif

// The build for "generic", "avx2" or "avx512" if this CPU runs it, else nullptr.
const AttentionKernels* AttentionKernelsFor(const char* isa);

// The build this process uses (chosen once; GRADSUM_ATTENTION_ISA may force one).
const AttentionKernels& SelectedAttentionKernels();

// AttentionForward / AttentionBackward (model/attention.h) with the given build.
absl::Status AttentionForwardWith(const AttentionKernels& kernels, const AttentionDims& dims,
                                  absl::Span<const float> q, absl::Span<const float> k,
                                  absl::Span<const float> v, absl::Span<const int32_t> doc_start,
                                  absl::Span<float> out, absl::Span<float> lse);
absl::Status AttentionBackwardWith(const AttentionKernels& kernels, const AttentionDims& dims,
                                   absl::Span<const float> q, absl::Span<const float> k,
                                   absl::Span<const float> v, absl::Span<const int32_t> doc_start,
                                   absl::Span<const float> out, absl::Span<const float> lse,
                                   absl::Span<const float> d_out, absl::Span<float> dq,
                                   absl::Span<float> dk, absl::Span<float> dv);

}  // namespace gradsum::model::internal

#endif  // GRADSUM_MODEL_ATTENTION_KERNELS_H_
