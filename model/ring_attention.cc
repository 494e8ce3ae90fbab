// Ring attention over a CP group (model/ring_attention.h): the schedule and the exchanges;
// the pair math is model/attention_kernels.inc, the whole-sequence one model/attention.cc.
#include "model/ring_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/default_init_allocator.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "data/shard.h"
#include "model/attention.h"
#include "model/attention_kernels.h"

namespace gradsum::model {
namespace {

using internal::AttentionKernels;
using internal::AttentionPairBackwardTask;
using internal::AttentionPairForwardTask;
using Clock = std::chrono::steady_clock;
using Scratch = std::vector<float, DefaultInitAllocator<float>>;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Notes a call's working buffers: `floats` floats at once.
void NoteBuffers(RingAttentionTimes* times, int64_t floats) {
  if (times == nullptr) return;
  times->peak_buffer_bytes =
      std::max(times->peak_buffer_bytes, floats * static_cast<int64_t>(sizeof(float)));
}

// Floats of the tasks' scratch that can be live at once (one per compute thread).
int64_t ScratchFloats(int64_t per_task, int64_t tasks) {
  return per_task * std::min<int64_t>(tasks, std::max(1, ComputeThreads()));
}

// What the dims imply for this rank.
struct Layout {
  int cp = 1, rank = 0;
  int64_t chunk = 0;  // c
  int64_t local = 0;  // 2c: a sequence's tokens on one rank
  int64_t rows = 0;   // num_seqs * 2c
  int64_t heads = 0, d = 0, dp = 0;
  int64_t kv_heads = 0, group = 1;  // query heads per kv head
  int64_t floats = 0;               // rows * heads * d
  int64_t kv_floats = 0;            // rows * kv_heads * d
  int64_t padded = 0;               // rows * heads * dp
};

absl::Status CheckSize(const char* name, size_t size, int64_t want, const char* layout) {
  if (static_cast<int64_t>(size) != want) {
    return absl::InvalidArgumentError(absl::StrCat("ring attention: ", name, " holds ", size,
                                                   " values; ", layout, " needs ", want));
  }
  return absl::OkStatus();
}

absl::StatusOr<Layout> CheckLayout(const Communicator& group, const RingAttentionDims& dims,
                                   size_t q, size_t k, size_t v, size_t doc_start, size_t out,
                                   size_t lse) {
  Layout l;
  l.cp = group.size();
  l.rank = group.rank();
  if (dims.num_seqs < 0 || dims.seq_len < 0 || dims.heads < 1 || dims.head_dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring attention: num_seqs = ", dims.num_seqs, ", seq_len = ", dims.seq_len,
                     ", heads = ", dims.heads, ", head_dim = ", dims.head_dim, " out of range"));
  }
  const int kv_heads = dims.kv_heads == 0 ? dims.heads : dims.kv_heads;
  if (kv_heads < 1 || dims.heads % kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ring attention: kv_heads = ", dims.kv_heads,
                                                   " does not divide heads = ", dims.heads));
  }
  if (dims.seq_len % (2 * int64_t{l.cp}) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring attention: seq_len = ", dims.seq_len, " is not a multiple of 2 * cp = ", 2 * l.cp,
        " (each rank holds two chunks of every sequence)"));
  }
  l.chunk = dims.seq_len / (2 * l.cp);
  l.local = 2 * l.chunk;
  l.rows = dims.num_seqs * l.local;
  l.heads = dims.heads;
  l.kv_heads = kv_heads;
  l.group = dims.heads / kv_heads;
  l.d = dims.head_dim;
  l.dp = (l.d + internal::kAttentionColPad - 1) / internal::kAttentionColPad *
         internal::kAttentionColPad;
  l.floats = l.rows * l.heads * l.d;
  l.kv_floats = l.rows * l.kv_heads * l.d;
  l.padded = l.rows * l.heads * l.dp;
  const char* layout = "[num_seqs * seq_len / cp, heads, head_dim]";
  GRADSUM_RETURN_IF_ERROR(CheckSize("q", q, l.floats, layout));
  GRADSUM_RETURN_IF_ERROR(
      CheckSize("k", k, l.kv_floats, "[num_seqs * seq_len / cp, kv_heads, head_dim]"));
  GRADSUM_RETURN_IF_ERROR(
      CheckSize("v", v, l.kv_floats, "[num_seqs * seq_len / cp, kv_heads, head_dim]"));
  GRADSUM_RETURN_IF_ERROR(CheckSize("out", out, l.floats, layout));
  GRADSUM_RETURN_IF_ERROR(
      CheckSize("lse", lse, l.rows * l.heads, "[num_seqs * seq_len / cp, heads]"));
  GRADSUM_RETURN_IF_ERROR(CheckSize("doc_start", doc_start, dims.num_seqs * dims.seq_len,
                                    "the whole sequences [num_seqs * seq_len]"));
  return l;
}

// The whole sequences' call of model/attention.h that a group of one makes.
AttentionDims WholeDims(const RingAttentionDims& dims) {
  AttentionDims w;
  w.num_seqs = dims.num_seqs;
  w.seq_len = dims.seq_len;
  w.q_heads = dims.heads;
  w.kv_heads = dims.kv_heads == 0 ? dims.heads : dims.kv_heads;
  w.head_dim = dims.head_dim;
  return w;
}

absl::Status CheckDocStart(const RingAttentionDims& dims, absl::Span<const int32_t> doc_start) {
  const AttentionDims w = WholeDims(dims);
  for (int64_t i = 0; i < static_cast<int64_t>(doc_start.size()); ++i) {
    const int32_t previous = i % dims.seq_len == 0 ? -1 : doc_start[i - 1];
    GRADSUM_RETURN_IF_ERROR(internal::CheckDocStartToken(w, i, doc_start[i], previous));
  }
  return absl::OkStatus();
}

// Rank r's token indices [2c] and documents [num_seqs * 2c].
struct RankTokens {
  std::vector<int32_t> index, doc;
};

RankTokens TokensOf(const Layout& l, int r, int64_t num_seqs, int64_t seq_len,
                    absl::Span<const int32_t> doc_start) {
  RankTokens t;
  t.index.resize(l.local);
  for (int64_t u = 0; u < l.local; ++u) {
    t.index[u] = static_cast<int32_t>(data::ZigzagIndex(l.cp, r, l.chunk, u));
  }
  t.doc.resize(num_seqs * l.local);
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t u = 0; u < l.local; ++u) {
      t.doc[s * l.local + u] = doc_start[s * seq_len + t.index[u]];
    }
  }
  return t;
}

// One step of the ring: `count` floats to the next rank, the previous rank's into recv.
class Shift {
 public:
  absl::Status Start(Communicator& group, const float* send, float* recv, int64_t count,
                     RingAttentionTimes* times) {
    // Point-to-point, so that a rank waiting here names the neighbour it waits for in a
    // timeout's where-is-everyone report (an all-to-all-v of the group cannot say which).
    const int C = group.size(), r = group.rank();
    const size_t n = static_cast<size_t>(count);
    GRADSUM_ASSIGN_OR_RETURN(recv_, group.RecvAsync(recv, n, DType::kF32, (r + C - 1) % C));
    GRADSUM_ASSIGN_OR_RETURN(send_, group.SendAsync(send, n, DType::kF32, (r + 1) % C));
    if (times != nullptr) times->bytes_sent += count * static_cast<int64_t>(sizeof(float));
    return absl::OkStatus();
  }
  absl::Status Wait(RingAttentionTimes* times) {
    if (recv_ == nullptr && send_ == nullptr) return absl::OkStatus();
    const Clock::time_point start = Clock::now();
    absl::Status status = recv_ == nullptr ? absl::OkStatus() : recv_->Wait();
    absl::Status sent = send_ == nullptr ? absl::OkStatus() : send_->Wait();
    if (status.ok()) status = std::move(sent);
    if (times != nullptr) times->wait_s += Since(start);
    recv_.reset();
    send_.reset();
    return status;
  }

 private:
  std::unique_ptr<Work> recv_, send_;
};

// The block the ring passes on: this rank's k, then its v ([2, rows, kv_heads, d]).
std::vector<float> KvBlock(const Layout& l, absl::Span<const float> k, absl::Span<const float> v) {
  std::vector<float> kv(2 * l.kv_floats);
  std::copy(k.begin(), k.end(), kv.begin());
  std::copy(v.begin(), v.end(), kv.begin() + l.kv_floats);
  return kv;
}

// The ring's schedule, written once for both directions. `kv` holds this rank's k then v
// ([2, rows, kv_heads, d]); at step s = 0..C-1 it holds rank (rank - s) mod C's (the next
// step's exchange starts before the step's work and is waited for after it). pair(s, h, j,
// a, b, theirs, kv, scratch) runs for every (query chunk a, key chunk b) pair that
// causality leaves non-empty and every query head h of kv head j, one task per (sequence,
// kv head) with its pairs, then its query heads, in order (so a kv head's dK/dV sum has one
// writer and one order); after_step() runs after each step's pairs (backward passes its
// accumulators on there).
template <typename Pair, typename AfterStep>
absl::Status RunRing(Communicator& group, const Layout& l, int64_t num_seqs, int64_t seq_len,
                     absl::Span<const int32_t> doc_start, std::vector<float> kv,
                     int64_t scratch_floats, RingAttentionTimes* times, Pair pair,
                     AfterStep after_step) {
  std::vector<float> kv_next(kv.size());
  for (int step = 0; step < l.cp; ++step) {
    const int owner = (l.rank - step + l.cp) % l.cp;
    Shift shift;
    if (step + 1 < l.cp) {
      GRADSUM_RETURN_IF_ERROR(
          shift.Start(group, kv.data(), kv_next.data(), static_cast<int64_t>(kv.size()), times));
    }
    const RankTokens theirs = TokensOf(l, owner, num_seqs, seq_len, doc_start);
    const Clock::time_point start = Clock::now();
    ParallelFor(ComputeThreads(), num_seqs * l.kv_heads, [&](int64_t task) {
      Scratch scratch(scratch_floats);
      const int64_t s = task / l.kv_heads, j = task % l.kv_heads;
      for (int a = 0; a < 2; ++a) {
        for (int b = 0; b < 2; ++b) {
          // A key chunk after the query chunk is after every query in it.
          if (data::ZigzagChunk(l.cp, owner, b) > data::ZigzagChunk(l.cp, l.rank, a)) continue;
          for (int64_t h = j * l.group; h < (j + 1) * l.group; ++h) {
            pair(s, h, j, a, b, theirs, kv.data(), scratch.data());
          }
        }
      }
    });
    if (times != nullptr) times->compute_s += Since(start);
    GRADSUM_RETURN_IF_ERROR(after_step());
    GRADSUM_RETURN_IF_ERROR(shift.Wait(times));
    if (step + 1 < l.cp) std::swap(kv, kv_next);
  }
  return absl::OkStatus();
}

// ---- kGathered: the whole sequences on every rank --------------------------------------

// Every rank's [rows, width] block of `local` gathered and put in sequence order:
// whole [num_seqs * seq_len, width].
absl::Status GatherWhole(Communicator& group, const Layout& l, int64_t num_seqs, int64_t seq_len,
                         int64_t width, absl::Span<const float> local, std::vector<float>* whole,
                         RingAttentionTimes* times) {
  std::vector<float> all(static_cast<size_t>(l.cp) * l.rows * width);
  const Clock::time_point start = Clock::now();
  GRADSUM_RETURN_IF_ERROR(
      group.AllGather(local.data(), all.data(), static_cast<size_t>(l.rows * width), DType::kF32));
  if (times != nullptr) {
    times->wait_s += Since(start);
    times->bytes_sent += l.rows * width * static_cast<int64_t>(sizeof(float));
  }
  whole->resize(num_seqs * seq_len * width);
  for (int r = 0; r < l.cp; ++r) {
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t u = 0; u < l.local; ++u) {
        const float* src = all.data() + ((int64_t{r} * num_seqs + s) * l.local + u) * width;
        std::copy(src, src + width,
                  whole->data() + (s * seq_len + data::ZigzagIndex(l.cp, r, l.chunk, u)) * width);
      }
    }
  }
  return absl::OkStatus();
}

// This rank's rows of whole [num_seqs * seq_len, width] into local [rows, width].
void TakeOwn(const Layout& l, int64_t num_seqs, int64_t seq_len, int64_t width,
             const std::vector<float>& whole, absl::Span<float> local) {
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t u = 0; u < l.local; ++u) {
      const float* src =
          whole.data() + (s * seq_len + data::ZigzagIndex(l.cp, l.rank, l.chunk, u)) * width;
      std::copy(src, src + width, local.data() + (s * l.local + u) * width);
    }
  }
}

// Heads [h0, h0 + n) of x [rows, heads, width] into a contiguous [rows, n, width].
std::vector<float> TakeHeads(absl::Span<const float> x, int64_t heads, int64_t width, int64_t h0,
                             int64_t n) {
  const int64_t rows = static_cast<int64_t>(x.size()) / (heads * width);
  std::vector<float> part(rows * n * width);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(x.data() + (r * heads + h0) * width, n * width, part.data() + r * n * width);
  }
  return part;
}

// Their inverse: part [rows, n, width] into heads [h0, h0 + n) of x [rows, heads, width].
void PutHeads(const std::vector<float>& part, int64_t heads, int64_t width, int64_t h0, int64_t n,
              absl::Span<float> x) {
  const int64_t rows = static_cast<int64_t>(x.size()) / (heads * width);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(part.data() + r * n * width, n * width, x.data() + (r * heads + h0) * width);
  }
}

// The gathered schedule works one kv head at a time, with its `group` query heads: the
// whole-sequence kernel's results are per (sequence, kv head) and its query heads, so a
// call over one such group gives that group's bits of the call over every head, and the
// whole sequences held at once are one group's (1 / kv_heads of the rank's heads).
AttentionDims GroupDims(const RingAttentionDims& dims, int64_t group) {
  AttentionDims w = WholeDims(dims);
  w.q_heads = static_cast<int>(group);
  w.kv_heads = 1;
  return w;
}

// The whole sequences' q of kv head j's query heads, and its k and v (GatherWhole).
absl::Status GatherGroupQkv(Communicator& cp_group, const Layout& l, int64_t S, int64_t L,
                            int64_t j, absl::Span<const float> q, absl::Span<const float> k,
                            absl::Span<const float> v, std::vector<float>* qw,
                            std::vector<float>* kw, std::vector<float>* vw,
                            RingAttentionTimes* times) {
  const int64_t H = l.heads, Hk = l.kv_heads, d = l.d, g = l.group;
  GRADSUM_RETURN_IF_ERROR(
      GatherWhole(cp_group, l, S, L, g * d, TakeHeads(q, H, d, j * g, g), qw, times));
  GRADSUM_RETURN_IF_ERROR(GatherWhole(cp_group, l, S, L, d, TakeHeads(k, Hk, d, j, 1), kw, times));
  return GatherWhole(cp_group, l, S, L, d, TakeHeads(v, Hk, d, j, 1), vw, times);
}

// RingAttentionForward's kGathered schedule: per kv head j, gather the whole sequences'
// q, k, v of its query heads, run the whole-sequence kernel, keep this rank's rows.
absl::Status GatheredForward(Communicator& cp_group, const RingAttentionDims& dims, const Layout& l,
                             absl::Span<const float> q, absl::Span<const float> k,
                             absl::Span<const float> v, absl::Span<const int32_t> doc_start,
                             absl::Span<float> out, absl::Span<float> lse,
                             RingAttentionTimes* times) {
  const int64_t S = dims.num_seqs, L = dims.seq_len, H = l.heads, d = l.d, dp = l.dp;
  const int64_t Hk = l.kv_heads;
  const int64_t g = l.group, gw = g * d;  // one kv head's query heads, their row width
  const internal::AttentionKernels& whole = internal::SelectedAttentionKernels();
  // One group's: its local q, k, v; the whole sequences' q, k, v, out, lse; one gather's
  // receive buffer; its own out and lse rows; the kernel's scratch.
  NoteBuffers(times, l.rows * (gw + 2 * d) + S * L * (2 * gw + 2 * d + g) +
                         int64_t{l.cp} * l.rows * gw + l.rows * (gw + g) +
                         ScratchFloats(whole.forward_scratch_floats(L, dp), S * g));
  for (int64_t j = 0; j < Hk; ++j) {
    std::vector<float> qw, kw, vw;
    GRADSUM_RETURN_IF_ERROR(GatherGroupQkv(cp_group, l, S, L, j, q, k, v, &qw, &kw, &vw, times));
    std::vector<float> ow(qw.size()), lw(S * L * g);
    const Clock::time_point start = Clock::now();
    GRADSUM_RETURN_IF_ERROR(AttentionForward(GroupDims(dims, g), qw, kw, vw, doc_start,
                                             absl::MakeSpan(ow), absl::MakeSpan(lw)));
    if (times != nullptr) times->compute_s += Since(start);
    std::vector<float> own_out(l.rows * gw), own_lse(l.rows * g);
    TakeOwn(l, S, L, gw, ow, absl::MakeSpan(own_out));
    TakeOwn(l, S, L, g, lw, absl::MakeSpan(own_lse));
    PutHeads(own_out, H, d, j * g, g, out);
    PutHeads(own_lse, H, 1, j * g, g, lse);
  }
  return absl::OkStatus();
}

// RingAttentionBackward's kGathered schedule: per kv head j, as GatheredForward with the
// backward's inputs, and this rank's rows of dq, dk, dv.
absl::Status GatheredBackward(Communicator& cp_group, const RingAttentionDims& dims,
                              const Layout& l, absl::Span<const float> q, absl::Span<const float> k,
                              absl::Span<const float> v, absl::Span<const int32_t> doc_start,
                              absl::Span<const float> out, absl::Span<const float> lse,
                              absl::Span<const float> d_out, absl::Span<float> dq,
                              absl::Span<float> dk, absl::Span<float> dv,
                              RingAttentionTimes* times) {
  const int64_t S = dims.num_seqs, L = dims.seq_len, H = l.heads, d = l.d, dp = l.dp;
  const int64_t Hk = l.kv_heads;
  const int64_t g = l.group, gw = g * d;  // as forward: one kv head and its query heads
  const internal::AttentionKernels& whole = internal::SelectedAttentionKernels();
  // One group's: its local inputs; the whole sequences' q, k, v, out, lse, d_out and dq,
  // dk, dv; one gather's receive buffer; its own dq, dk, dv rows; the kernel's scratch.
  NoteBuffers(times, l.rows * (3 * gw + 2 * d + g) + S * L * (4 * gw + 4 * d + g) +
                         int64_t{l.cp} * l.rows * gw + l.rows * (gw + 2 * d) +
                         ScratchFloats(whole.backward_scratch_floats(L, dp), S * g));
  for (int64_t j = 0; j < Hk; ++j) {
    std::vector<float> qw, kw, vw, ow, lw, gw_out;
    GRADSUM_RETURN_IF_ERROR(GatherGroupQkv(cp_group, l, S, L, j, q, k, v, &qw, &kw, &vw, times));
    GRADSUM_RETURN_IF_ERROR(
        GatherWhole(cp_group, l, S, L, gw, TakeHeads(out, H, d, j * g, g), &ow, times));
    GRADSUM_RETURN_IF_ERROR(
        GatherWhole(cp_group, l, S, L, g, TakeHeads(lse, H, 1, j * g, g), &lw, times));
    GRADSUM_RETURN_IF_ERROR(
        GatherWhole(cp_group, l, S, L, gw, TakeHeads(d_out, H, d, j * g, g), &gw_out, times));
    std::vector<float> dqw(qw.size()), dkw(kw.size()), dvw(kw.size());
    const Clock::time_point start = Clock::now();
    GRADSUM_RETURN_IF_ERROR(AttentionBackward(GroupDims(dims, g), qw, kw, vw, doc_start, ow, lw,
                                              gw_out, absl::MakeSpan(dqw), absl::MakeSpan(dkw),
                                              absl::MakeSpan(dvw)));
    if (times != nullptr) times->compute_s += Since(start);
    std::vector<float> own_dq(l.rows * gw), own_dk(l.rows * d), own_dv(l.rows * d);
    TakeOwn(l, S, L, gw, dqw, absl::MakeSpan(own_dq));
    TakeOwn(l, S, L, d, dkw, absl::MakeSpan(own_dk));
    TakeOwn(l, S, L, d, dvw, absl::MakeSpan(own_dv));
    PutHeads(own_dq, H, d, j * g, g, dq);
    PutHeads(own_dk, Hk, d, j, 1, dk);
    PutHeads(own_dv, Hk, d, j, 1, dv);
  }
  return absl::OkStatus();
}

// The ring backward's per-row inputs, per (sequence, head, local token) and contiguous for
// the kernel: lse, and dsum = d_out . out.
void RowStatistics(const Layout& l, int64_t S, absl::Span<const float> out,
                   absl::Span<const float> lse, absl::Span<const float> d_out,
                   std::vector<float>* lse_t, std::vector<float>* dsum) {
  const int64_t H = l.heads, d = l.d;
  lse_t->resize(S * H * l.local);
  dsum->resize(S * H * l.local);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t u = 0; u < l.local; ++u) {
        const int64_t r = s * l.local + u, st = (s * H + h) * l.local + u;
        (*lse_t)[st] = lse[r * H + h];
        const float* go = d_out.data() + (r * H + h) * d;
        const float* o = out.data() + (r * H + h) * d;
        float sum = 0.0f;
        for (int64_t c = 0; c < d; ++c) sum += go[c] * o[c];
        (*dsum)[st] = sum;
      }
    }
  }
}

// The ring backward's accumulators (dq_acc [S, H, local, dp]; dkv = dK then dV, each
// [S, Hk, local, dp]), home after the ring, into dq, dk, dv rows of head_dim floats.
void CopyRingGradients(const Layout& l, int64_t S, const std::vector<float>& dq_acc,
                       const std::vector<float>& dkv, absl::Span<float> dq, absl::Span<float> dk,
                       absl::Span<float> dv) {
  const int64_t H = l.heads, Hk = l.kv_heads, d = l.d, dp = l.dp;
  const int64_t kv_state = S * Hk * l.local;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t u = 0; u < l.local; ++u) {
      const int64_t r = s * l.local + u;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t st = (s * H + h) * l.local + u;
        std::copy_n(dq_acc.data() + st * dp, d, dq.data() + (r * H + h) * d);
      }
      for (int64_t j = 0; j < Hk; ++j) {
        const int64_t st = (s * Hk + j) * l.local + u, o = (r * Hk + j) * d;
        std::copy_n(dkv.data() + st * dp, d, dk.data() + o);
        std::copy_n(dkv.data() + kv_state * dp + st * dp, d, dv.data() + o);
      }
    }
  }
}

}  // namespace

absl::Status RingAttentionForward(Communicator& cp_group, const RingAttentionDims& dims,
                                  RingSchedule schedule, absl::Span<const float> q,
                                  absl::Span<const float> k, absl::Span<const float> v,
                                  absl::Span<const int32_t> doc_start, absl::Span<float> out,
                                  absl::Span<float> lse, RingAttentionTimes* times) {
  GRADSUM_ASSIGN_OR_RETURN(const Layout l, CheckLayout(cp_group, dims, q.size(), k.size(), v.size(),
                                                       doc_start.size(), out.size(), lse.size()));
  GRADSUM_RETURN_IF_ERROR(CheckDocStart(dims, doc_start));
  const int64_t S = dims.num_seqs, L = dims.seq_len, H = l.heads, d = l.d, dp = l.dp;
  const int64_t Hk = l.kv_heads, row = H * d, kv_row = Hk * d;

  if (schedule == RingSchedule::kGathered) {
    return GatheredForward(cp_group, dims, l, q, k, v, doc_start, out, lse, times);
  }

  const AttentionKernels& kernels = internal::SelectedAttentionKernels();
  const RankTokens mine = TokensOf(l, l.rank, S, L, doc_start);
  const int64_t state = S * H * l.local;  // per (sequence, head, local token)
  std::vector<float> run_max(state, -INFINITY), run_sum(state, 0.0f);
  std::vector<float> acc(state * dp, 0.0f);
  std::vector<float> kv = KvBlock(l, k, v);
  const float scale = internal::AttentionScale(d);
  NoteBuffers(times, 2 * state + state * dp + 4 * l.kv_floats +
                         ScratchFloats(kernels.pair_forward_scratch_floats(dp), S * Hk));
  GRADSUM_RETURN_IF_ERROR(RunRing(
      cp_group, l, S, L, doc_start, std::move(kv), kernels.pair_forward_scratch_floats(dp), times,
      [&](int64_t s, int64_t h, int64_t j, int a, int b, const RankTokens& theirs,
          const float* kv_held, float* scratch) {
        const int64_t q_row = s * l.local + a * l.chunk, k_row = s * l.local + b * l.chunk;
        const int64_t st = (s * H + h) * l.local + a * l.chunk;
        AttentionPairForwardTask t;
        t.m = t.n = l.chunk;
        t.head_dim = d;
        t.padded_dim = dp;
        t.scale = scale;
        t.q = q.data() + (q_row * H + h) * d;
        t.q_stride = row;
        t.q_index = mine.index.data() + a * l.chunk;
        t.q_doc = mine.doc.data() + q_row;
        t.k = kv_held + (k_row * Hk + j) * d;
        t.v = kv_held + l.kv_floats + (k_row * Hk + j) * d;
        t.kv_stride = kv_row;
        t.k_index = theirs.index.data() + b * l.chunk;
        t.k_doc = theirs.doc.data() + k_row;
        t.run_max = run_max.data() + st;
        t.run_sum = run_sum.data() + st;
        t.acc = acc.data() + st * dp;
        t.acc_stride = dp;
        t.scratch = scratch;
        kernels.pair_forward(t);
      },
      [] { return absl::OkStatus(); }));

  // out = acc / l, lse = max + log l; a padding row attended nothing: 0 and 0.
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t u = 0; u < l.local; ++u) {
        const int64_t st = (s * H + h) * l.local + u, r = s * l.local + u;
        float* o = out.data() + (r * H + h) * d;
        const float sum = run_sum[st];
        if (sum == 0.0f) {
          std::fill(o, o + d, 0.0f);
          lse[r * H + h] = 0.0f;
          continue;
        }
        for (int64_t c = 0; c < d; ++c) o[c] = acc[st * dp + c] / sum;
        lse[r * H + h] = run_max[st] + std::log(sum);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status RingAttentionBackward(Communicator& cp_group, const RingAttentionDims& dims,
                                   RingSchedule schedule, absl::Span<const float> q,
                                   absl::Span<const float> k, absl::Span<const float> v,
                                   absl::Span<const int32_t> doc_start, absl::Span<const float> out,
                                   absl::Span<const float> lse, absl::Span<const float> d_out,
                                   absl::Span<float> dq, absl::Span<float> dk, absl::Span<float> dv,
                                   RingAttentionTimes* times) {
  GRADSUM_ASSIGN_OR_RETURN(const Layout l, CheckLayout(cp_group, dims, q.size(), k.size(), v.size(),
                                                       doc_start.size(), out.size(), lse.size()));
  const char* layout = "[num_seqs * seq_len / cp, heads, head_dim]";
  GRADSUM_RETURN_IF_ERROR(CheckSize("d_out", d_out.size(), l.floats, layout));
  GRADSUM_RETURN_IF_ERROR(CheckSize("dq", dq.size(), l.floats, layout));
  const char* kv_layout = "[num_seqs * seq_len / cp, kv_heads, head_dim]";
  GRADSUM_RETURN_IF_ERROR(CheckSize("dk", dk.size(), l.kv_floats, kv_layout));
  GRADSUM_RETURN_IF_ERROR(CheckSize("dv", dv.size(), l.kv_floats, kv_layout));
  GRADSUM_RETURN_IF_ERROR(CheckDocStart(dims, doc_start));
  const int64_t S = dims.num_seqs, L = dims.seq_len, H = l.heads, d = l.d, dp = l.dp;
  const int64_t Hk = l.kv_heads, row = H * d, kv_row = Hk * d;

  if (schedule == RingSchedule::kGathered) {
    return GatheredBackward(cp_group, dims, l, q, k, v, doc_start, out, lse, d_out, dq, dk, dv,
                            times);
  }

  const AttentionKernels& kernels = internal::SelectedAttentionKernels();
  const RankTokens mine = TokensOf(l, l.rank, S, L, doc_start);
  const int64_t state = S * H * l.local;
  std::vector<float> lse_t, dsum;
  RowStatistics(l, S, out, lse, d_out, &lse_t, &dsum);
  std::vector<float> dq_acc(state * dp, 0.0f);
  std::vector<float> kv = KvBlock(l, k, v);
  // The travelling dK, dV accumulators of the key/value block held: [S, Hk, 2c, dp] each.
  const int64_t kv_state = S * Hk * l.local;
  std::vector<float> dkv_cur(2 * kv_state * dp, 0.0f), dkv_next(2 * kv_state * dp);
  const float scale = internal::AttentionScale(d);
  NoteBuffers(times, 2 * state + state * dp + 4 * l.kv_floats + 4 * kv_state * dp +
                         ScratchFloats(kernels.pair_backward_scratch_floats(dp), S * Hk));
  GRADSUM_RETURN_IF_ERROR(RunRing(
      cp_group, l, S, L, doc_start, std::move(kv), kernels.pair_backward_scratch_floats(dp), times,
      [&](int64_t s, int64_t h, int64_t j, int a, int b, const RankTokens& theirs,
          const float* kv_held, float* scratch) {
        const int64_t q_row = s * l.local + a * l.chunk, k_row = s * l.local + b * l.chunk;
        const int64_t qs = (s * H + h) * l.local + a * l.chunk;
        const int64_t ks = (s * Hk + j) * l.local + b * l.chunk;
        AttentionPairBackwardTask t;
        t.m = t.n = l.chunk;
        t.head_dim = d;
        t.padded_dim = dp;
        t.scale = scale;
        t.q = q.data() + (q_row * H + h) * d;
        t.d_out = d_out.data() + (q_row * H + h) * d;
        t.q_stride = row;
        t.q_index = mine.index.data() + a * l.chunk;
        t.q_doc = mine.doc.data() + q_row;
        t.lse = lse_t.data() + qs;
        t.dsum = dsum.data() + qs;
        t.k = kv_held + (k_row * Hk + j) * d;
        t.v = kv_held + l.kv_floats + (k_row * Hk + j) * d;
        t.kv_stride = kv_row;
        t.k_index = theirs.index.data() + b * l.chunk;
        t.k_doc = theirs.doc.data() + k_row;
        t.dq = dq_acc.data() + qs * dp;
        t.grad_q_stride = dp;
        t.dk = dkv_cur.data() + ks * dp;
        t.dv = dkv_cur.data() + kv_state * dp + ks * dp;
        t.grad_kv_stride = dp;
        t.scratch = scratch;
        kernels.pair_backward(t);
      },
      [&]() -> absl::Status {
        // The accumulators move on with their block; after the last step they are home.
        if (l.cp == 1) return absl::OkStatus();
        Shift dkv_shift;
        GRADSUM_RETURN_IF_ERROR(
            dkv_shift.Start(cp_group, dkv_cur.data(), dkv_next.data(), 2 * kv_state * dp, times));
        GRADSUM_RETURN_IF_ERROR(dkv_shift.Wait(times));
        std::swap(dkv_cur, dkv_next);
        return absl::OkStatus();
      }));

  CopyRingGradients(l, S, dq_acc, dkv_cur, dq, dk, dv);
  return absl::OkStatus();
}

}  // namespace gradsum::model
