// The CPU attention's driver (model/attention.h): argument checks, the blocks of each
// sequence, and the tasks on the shared pool; the block math is model/attention_kernels.inc.
#include "model/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/cpu_isa.h"
#include "core/default_init_allocator.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "model/attention_kernels.h"

namespace gradsum::model {
namespace internal {

std::vector<AttentionBlock> AttentionBlocks(absl::Span<const int32_t> doc_start) {
  const int64_t len = static_cast<int64_t>(doc_start.size());
  std::vector<AttentionBlock> blocks;
  int64_t t = 0;
  while (t < len) {
    if (doc_start[t] < 0) {
      ++t;
      continue;
    }
    // A document starts at t (contiguity: doc_start[t] == t) and runs while tokens say so.
    int64_t end = t + 1;
    while (end < len && doc_start[end] == doc_start[t]) ++end;
    const int64_t first = static_cast<int64_t>(blocks.size());
    for (int64_t b = t; b < end; b += kAttentionBlock) {
      AttentionBlock block;
      block.begin = b;
      block.end = std::min(b + kAttentionBlock, end);
      block.first = first;
      blocks.push_back(block);
    }
    for (int64_t i = first; i < static_cast<int64_t>(blocks.size()); ++i) {
      blocks[i].last = static_cast<int64_t>(blocks.size()) - 1;
    }
    t = end;
  }
  return blocks;
}

float AttentionScale(int64_t head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

const AttentionKernels* AttentionKernelsFor(const char* isa) {
  static const IsaBuilds<AttentionKernels> builds(GRADSUM_ISA_BUILDS(internal::attention, Kernels));
  return builds.For(isa);
}

const AttentionKernels& SelectedAttentionKernels() {
  static const AttentionKernels& kernels =
      PickIsaBuild<AttentionKernels>("GRADSUM_ATTENTION_ISA", &AttentionKernelsFor);
  return kernels;
}

namespace {

bool MulOverflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

absl::Status CheckSize(const char* name, size_t size, int64_t want, const char* layout) {
  if (static_cast<int64_t>(size) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: ", name, " holds ", size, " values; ", layout, " needs ", want));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttentionShape> CheckAttentionDims(const AttentionDims& dims) {
  if (dims.num_seqs < 0 || dims.seq_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention: num_seqs = ", dims.num_seqs, " and seq_len = ", dims.seq_len, " must be >= 0"));
  }
  if (dims.q_heads < 1 || dims.kv_heads < 1 || dims.head_dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: q_heads = ", dims.q_heads, ", kv_heads = ", dims.kv_heads,
                     " and head_dim = ", dims.head_dim, " must be >= 1"));
  }
  AttentionShape shape;
  if (dims.kv_of_q.empty()) {
    if (dims.q_heads % dims.kv_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention: q_heads = ", dims.q_heads, " is not a multiple of kv_heads = ", dims.kv_heads,
          " (kv_of_q is empty, so query heads are grouped)"));
    }
    const int group = dims.q_heads / dims.kv_heads;
    for (int h = 0; h < dims.q_heads; ++h) shape.kv_of_q.push_back(h / group);
  } else {
    if (static_cast<int64_t>(dims.kv_of_q.size()) != dims.q_heads) {
      return absl::InvalidArgumentError(absl::StrCat("attention: kv_of_q has ", dims.kv_of_q.size(),
                                                     " entries; q_heads = ", dims.q_heads));
    }
    for (int h = 0; h < dims.q_heads; ++h) {
      if (dims.kv_of_q[h] < 0 || dims.kv_of_q[h] >= dims.kv_heads) {
        return absl::InvalidArgumentError(absl::StrCat("attention: kv_of_q[", h,
                                                       "] = ", dims.kv_of_q[h], " is outside [0, ",
                                                       dims.kv_heads, ")"));
      }
    }
    shape.kv_of_q = dims.kv_of_q;
  }
  int64_t q_rows = 0, kv_rows = 0;
  if (MulOverflows(dims.num_seqs, dims.seq_len, &shape.tokens) ||
      MulOverflows(shape.tokens, dims.q_heads, &q_rows) ||
      MulOverflows(q_rows, dims.head_dim, &shape.q_floats) ||
      MulOverflows(shape.tokens, dims.kv_heads, &kv_rows) ||
      MulOverflows(kv_rows, dims.head_dim, &shape.kv_floats)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: num_seqs = ", dims.num_seqs, ", seq_len = ", dims.seq_len,
                     ", q_heads = ", dims.q_heads, ", kv_heads = ", dims.kv_heads,
                     ", head_dim = ", dims.head_dim, " overflow the tensor sizes"));
  }
  shape.lse_floats = q_rows;
  return shape;
}

absl::Status CheckDocStartToken(const AttentionDims& dims, int64_t index, int32_t value,
                                int32_t previous) {
  const int64_t s = dims.seq_len > 0 ? index / dims.seq_len : 0;
  const int64_t t = index - s * dims.seq_len;
  const int64_t v = value;
  if (v == -1) return absl::OkStatus();
  if (v < 0 || v > t) {
    return absl::InvalidArgumentError(absl::StrCat("attention: doc_start[", index, "] = ", v,
                                                   " (sequence ", s, ", token ", t,
                                                   ") must be -1 or in [0, ", t, "]"));
  }
  if (v != t && previous != v) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: doc_start[", index, "] = ", v, " (sequence ", s, ", token ", t,
                     ") continues a document that token ", t - 1, " (doc_start ", previous,
                     ") is not in: documents must be contiguous"));
  }
  return absl::OkStatus();
}

namespace {

// The first bad doc_start, in token order.
absl::Status CheckDocStart(const AttentionDims& dims, absl::Span<const int32_t> doc_start) {
  for (int64_t i = 0; i < static_cast<int64_t>(doc_start.size()); ++i) {
    const int32_t previous = i % dims.seq_len == 0 ? -1 : doc_start[i - 1];
    GRADSUM_RETURN_IF_ERROR(CheckDocStartToken(dims, i, doc_start[i], previous));
  }
  return absl::OkStatus();
}

// Checks everything the two directions share; returns the shape.
absl::StatusOr<AttentionShape> CheckCommon(const AttentionDims& dims, size_t q, size_t k, size_t v,
                                           size_t doc_start, size_t out, size_t lse) {
  GRADSUM_ASSIGN_OR_RETURN(AttentionShape shape, CheckAttentionDims(dims));
  GRADSUM_RETURN_IF_ERROR(CheckSize("q", q, shape.q_floats, "[T, q_heads, head_dim]"));
  GRADSUM_RETURN_IF_ERROR(CheckSize("k", k, shape.kv_floats, "[T, kv_heads, head_dim]"));
  GRADSUM_RETURN_IF_ERROR(CheckSize("v", v, shape.kv_floats, "[T, kv_heads, head_dim]"));
  GRADSUM_RETURN_IF_ERROR(CheckSize("doc_start", doc_start, shape.tokens, "[T]"));
  GRADSUM_RETURN_IF_ERROR(CheckSize("out", out, shape.q_floats, "[T, q_heads, head_dim]"));
  GRADSUM_RETURN_IF_ERROR(CheckSize("lse", lse, shape.lse_floats, "[T, q_heads]"));
  return shape;
}

// Every sequence's blocks, one list each.
std::vector<std::vector<AttentionBlock>> SequenceBlocks(const AttentionDims& dims,
                                                        absl::Span<const int32_t> doc_start) {
  std::vector<std::vector<AttentionBlock>> blocks(dims.num_seqs);
  for (int64_t s = 0; s < dims.num_seqs; ++s) {
    blocks[s] = AttentionBlocks(doc_start.subspan(s * dims.seq_len, dims.seq_len));
  }
  return blocks;
}

int64_t PaddedDim(int64_t d) {
  return (d + kAttentionColPad - 1) / kAttentionColPad * kAttentionColPad;
}

// A task's scratch: every float is written before it is read, so it is not zeroed.
using Scratch = std::vector<float, DefaultInitAllocator<float>>;

// The fields both task kinds share: the sequence's blocks and the head sizes.
template <typename Task>
void SetSequence(const std::vector<AttentionBlock>& blocks, const AttentionDims& dims, Task* t) {
  t->blocks = blocks.data();
  t->num_blocks = static_cast<int64_t>(blocks.size());
  t->seq_len = dims.seq_len;
  t->head_dim = dims.head_dim;
  t->padded_dim = PaddedDim(dims.head_dim);
  t->scale = AttentionScale(dims.head_dim);
}

}  // namespace

absl::Status AttentionForwardWith(const AttentionKernels& kernels, const AttentionDims& dims,
                                  absl::Span<const float> q, absl::Span<const float> k,
                                  absl::Span<const float> v, absl::Span<const int32_t> doc_start,
                                  absl::Span<float> out, absl::Span<float> lse) {
  GRADSUM_ASSIGN_OR_RETURN(
      AttentionShape shape,
      CheckCommon(dims, q.size(), k.size(), v.size(), doc_start.size(), out.size(), lse.size()));
  GRADSUM_RETURN_IF_ERROR(CheckDocStart(dims, doc_start));
  if (shape.tokens == 0) return absl::OkStatus();
  const std::vector<std::vector<AttentionBlock>> blocks = SequenceBlocks(dims, doc_start);
  const int64_t d = dims.head_dim, dp = PaddedDim(d), len = dims.seq_len;
  const int64_t hq = dims.q_heads, hkv = dims.kv_heads;
  // One task per (sequence, query head): its rows depend on nothing else.
  ParallelFor(ComputeThreads(), dims.num_seqs * hq, [&](int64_t task) {
    const int64_t s = task / hq, h = task % hq, g = shape.kv_of_q[h];
    Scratch scratch(kernels.forward_scratch_floats(len, dp));
    AttentionForwardTask t;
    SetSequence(blocks[s], dims, &t);
    t.q = q.data() + (s * len * hq + h) * d;
    t.q_stride = hq * d;
    t.k = k.data() + (s * len * hkv + g) * d;
    t.v = v.data() + (s * len * hkv + g) * d;
    t.kv_stride = hkv * d;
    t.out = out.data() + (s * len * hq + h) * d;
    t.lse = lse.data() + s * len * hq + h;
    t.lse_stride = hq;
    t.scratch = scratch.data();
    kernels.forward(t);
  });
  return absl::OkStatus();
}

absl::Status AttentionBackwardWith(const AttentionKernels& kernels, const AttentionDims& dims,
                                   absl::Span<const float> q, absl::Span<const float> k,
                                   absl::Span<const float> v, absl::Span<const int32_t> doc_start,
                                   absl::Span<const float> out, absl::Span<const float> lse,
                                   absl::Span<const float> d_out, absl::Span<float> dq,
                                   absl::Span<float> dk, absl::Span<float> dv) {
  GRADSUM_ASSIGN_OR_RETURN(
      AttentionShape shape,
      CheckCommon(dims, q.size(), k.size(), v.size(), doc_start.size(), out.size(), lse.size()));
  GRADSUM_RETURN_IF_ERROR(
      CheckSize("d_out", d_out.size(), shape.q_floats, "[T, q_heads, head_dim]"));
  GRADSUM_RETURN_IF_ERROR(CheckSize("dq", dq.size(), shape.q_floats, "[T, q_heads, head_dim]"));
  GRADSUM_RETURN_IF_ERROR(CheckSize("dk", dk.size(), shape.kv_floats, "[T, kv_heads, head_dim]"));
  GRADSUM_RETURN_IF_ERROR(CheckSize("dv", dv.size(), shape.kv_floats, "[T, kv_heads, head_dim]"));
  GRADSUM_RETURN_IF_ERROR(CheckDocStart(dims, doc_start));
  if (shape.tokens == 0) return absl::OkStatus();
  const std::vector<std::vector<AttentionBlock>> blocks = SequenceBlocks(dims, doc_start);
  const int64_t d = dims.head_dim, dp = PaddedDim(d), len = dims.seq_len;
  const int64_t hq = dims.q_heads, hkv = dims.kv_heads;
  std::vector<std::vector<int>> heads_of_kv(hkv);
  for (int h = 0; h < dims.q_heads; ++h) heads_of_kv[shape.kv_of_q[h]].push_back(h);
  // One task per (sequence, kv head): dk / dv sum over its query heads in a fixed order,
  // and the dq rows of those heads belong to it alone.
  ParallelFor(ComputeThreads(), dims.num_seqs * hkv, [&](int64_t task) {
    const int64_t s = task / hkv, g = task % hkv;
    const std::vector<int>& heads = heads_of_kv[g];
    const int num_heads = static_cast<int>(heads.size());
    Scratch scratch(kernels.backward_scratch_floats(len, dp));
    AttentionBackwardTask t;
    SetSequence(blocks[s], dims, &t);
    t.heads = heads.data();
    t.num_heads = num_heads;
    t.q = q.data() + s * len * hq * d;
    t.out = out.data() + s * len * hq * d;
    t.d_out = d_out.data() + s * len * hq * d;
    t.dq = dq.data() + s * len * hq * d;
    t.q_stride = hq * d;
    t.lse = lse.data() + s * len * hq;
    t.lse_stride = hq;
    t.k = k.data() + (s * len * hkv + g) * d;
    t.v = v.data() + (s * len * hkv + g) * d;
    t.dk = dk.data() + (s * len * hkv + g) * d;
    t.dv = dv.data() + (s * len * hkv + g) * d;
    t.kv_stride = hkv * d;
    t.scratch = scratch.data();
    kernels.backward(t);
  });
  return absl::OkStatus();
}

}  // namespace internal

absl::Status AttentionForward(const AttentionDims& dims, absl::Span<const float> q,
                              absl::Span<const float> k, absl::Span<const float> v,
                              absl::Span<const int32_t> doc_start, absl::Span<float> out,
                              absl::Span<float> lse) {
  return internal::AttentionForwardWith(internal::SelectedAttentionKernels(), dims, q, k, v,
                                        doc_start, out, lse);
}

absl::Status AttentionBackward(const AttentionDims& dims, absl::Span<const float> q,
                               absl::Span<const float> k, absl::Span<const float> v,
                               absl::Span<const int32_t> doc_start, absl::Span<const float> out,
                               absl::Span<const float> lse, absl::Span<const float> d_out,
                               absl::Span<float> dq, absl::Span<float> dk, absl::Span<float> dv) {
  return internal::AttentionBackwardWith(internal::SelectedAttentionKernels(), dims, q, k, v,
                                         doc_start, out, lse, d_out, dq, dk, dv);
}

}  // namespace gradsum::model
