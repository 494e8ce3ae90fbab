// Kernels of model/cuda/attention_cuda.h (launch side: attention_cuda_kernels.h; the
// absl::Status wrappers are in attention_cuda.cc so that nvcc never sees absl).
//
// Work layout, every kernel: 256 threads as 16 x 16 (tx = threadIdx.x % 16, the lane within
// a half-warp; ty = threadIdx.x / 16). A tile pairs 64 queries with 64 keys; thread (ty, tx)
// owns the pairs (query ty + 16 i, key tx + 16 j), i, j < 4, and in the products over the
// head dimension the columns tx + 16 jj. Shared rows of head_dim values are padded to
// kD + 1 floats (kD: head_dim rounded up to 16, 32, 64 or 128), so the 16 threads of a
// half-warp reading 16 different rows hit 16 different banks. Row maxima and sums across
// the 16 threads of a row are xor-shuffle trees: every lane gets the same bits, and so does
// every run. No atomics on floats anywhere: dq is one query tile's sum over the key tiles
// in order, dk / dv one key tile's sum over the query heads and query tiles in order.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "model/cuda/attention_cuda_kernels.h"

namespace gradsum::model::cuda_internal {
namespace {

constexpr int kTile = 64;             // queries and keys per tile
constexpr int kThreads = 256;         // 16 x 16
constexpr int kPStride = kTile + 16;  // probability rows: rows ty, ty + 1 of a warp 16 banks apart

// A token's document start as the kernels use it: past the sequence's end, or a value
// outside [0, i], it counts as padding (-1). Bad values are reported by the check kernel;
// here they only keep every access in bounds.
__device__ __forceinline__ long long DocOf(const int32_t* ds_seq, long long i, long long len) {
  if (i >= len) return -1;
  const long long v = ds_seq[i];
  return v >= 0 && v <= i ? v : -1;
}

// Query t (document q_doc) sees key s (document k_doc): same document, not padding, s <= t.
__device__ __forceinline__ bool Visible(long long q_doc, long long k_doc, long long t,
                                        long long s) {
  return q_doc >= 0 && k_doc == q_doc && s <= t;
}

__device__ __forceinline__ float HalfWarpMax(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float HalfWarpSum(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// dst[r * (kD + 1) + c] = src[r * stride + c] for the tile's tokens r that are not padding
// (doc[r] >= 0, so r is inside the sequence) and c < d; 0 elsewhere in the [kTile, kD]
// tile. Padding rows are never read: whatever they hold (NaN included) stays out.
template <int kD>
__device__ __forceinline__ void LoadTile(float* dst, const float* src, long long stride,
                                         const long long* doc, int d) {
  for (int e = threadIdx.x; e < kTile * kD; e += kThreads) {
    const int r = e / kD, c = e % kD;
    dst[r * (kD + 1) + c] = doc[r] >= 0 && c < d ? src[r * stride + c] : 0.0f;
  }
}

// a[i][j] (+)= sum_kk x[ty + 16 i][kk] y[tx + 16 j][kk] over kk < d: the thread's 4 x 4
// (query, key) pairs of x y^T, both tiles [kTile, kD + 1].
template <int kD>
__device__ __forceinline__ void PairDots(const float* x, const float* y, int d, int tx, int ty,
                                         float (&a)[4][4]) {
  constexpr int kRow = kD + 1;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[i][j] = 0.0f;
  }
#pragma unroll 4
  for (int kk = 0; kk < d; ++kk) {
    float xv[4], yv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) xv[i] = x[(ty + 16 * i) * kRow + kk];
#pragma unroll
    for (int j = 0; j < 4; ++j) yv[j] = y[(tx + 16 * j) * kRow + kk];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) a[i][j] = fmaf(xv[i], yv[j], a[i][j]);
    }
  }
}

// acc[i][jj] += sum over c < kTile, in order, of coef(ty + 16 i, c) rows[c][tx + 16 jj]:
// coef(a, c) = coef[a * kPStride + c], or coef[c * kPStride + a] when kTransposed (coef
// holds [kTile, kPStride] probabilities or scores; rows a [kTile, kD + 1] tile).
template <int kD, bool kTransposed>
__device__ __forceinline__ void AccumulateTile(const float* coef, const float* rows, int tx, int ty,
                                               float (&acc)[4][kD / 16]) {
  for (int c = 0; c < kTile; ++c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float a =
          kTransposed ? coef[c * kPStride + ty + 16 * i] : coef[(ty + 16 * i) * kPStride + c];
#pragma unroll
      for (int jj = 0; jj < kD / 16; ++jj) {
        acc[i][jj] = fmaf(a, rows[c * (kD + 1) + tx + 16 * jj], acc[i][jj]);
      }
    }
  }
}

// Writes the thread's rows ty + 16 i (< rows) of a tile starting at token `first` (within
// sequence s) of head `head` of a [T, heads, d] tensor: acc / divisor[i], or 0 where
// doc[row] < 0 (padding).
template <int kD>
__device__ __forceinline__ void StoreTile(float* dst, long long s, long long len, long long first,
                                          int rows, int heads, int head, int d,
                                          const long long* doc, const float (&acc)[4][kD / 16],
                                          const float (&divisor)[4], int tx, int ty) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    if (r >= rows) continue;
    const long long row = (s * len + first + r) * heads + head;  // [T, heads] index
#pragma unroll
    for (int jj = 0; jj < kD / 16; ++jj) {
      const int col = tx + 16 * jj;
      if (col < d) dst[row * d + col] = doc[r] >= 0 ? acc[i][jj] / divisor[i] : 0.0f;
    }
  }
}

// What a block works on, from its index: a tile of 64 tokens (queries, or keys for the
// dk / dv kernel) of one sequence and one head, and the thread's place in the 16 x 16 grid.
struct BlockTile {
  int tx = 0, ty = 0;
  long long len = 0;            // seq_len
  long long s = 0;              // sequence
  long long first = 0;          // first token of the tile (within the sequence)
  int rows = 0;                 // tokens of the tile inside the sequence
  int head = 0;                 // blockIdx.y: query head, or kv head for dk / dv
  int d = 0;                    // head_dim
  long long q_stride = 0;       // floats between tokens of q, out, d_out, dq
  long long kv_stride = 0;      // of k, v, dk, dv
  const int32_t* ds = nullptr;  // the sequence's doc_start
};

__device__ __forceinline__ BlockTile TileOfBlock(const AttentionCudaParams& p) {
  BlockTile b;
  b.tx = threadIdx.x % 16;
  b.ty = threadIdx.x / 16;
  b.len = p.seq_len;
  const long long tiles = (b.len + kTile - 1) / kTile;
  b.s = blockIdx.x / tiles;
  b.first = (blockIdx.x % tiles) * kTile;
  b.rows = static_cast<int>(min(static_cast<long long>(kTile), b.len - b.first));
  b.head = blockIdx.y;
  b.d = p.head_dim;
  b.q_stride = static_cast<long long>(p.q_heads) * b.d;
  b.kv_stride = static_cast<long long>(p.kv_heads) * b.d;
  b.ds = p.doc_start + b.s * b.len;
  return b;
}

// Token 0 of sequence s, head h, in a [T, heads, d] tensor with `stride` floats per token.
template <typename T>
__device__ __forceinline__ T* HeadRows(T* base, const BlockTile& b, long long stride, int h) {
  return base + b.s * b.len * stride + static_cast<long long>(h) * b.d;
}

// A kernel's shared memory (dynamic, `Bytes()` of it): kHeadTiles [kTile, kD + 1] tiles of
// head_dim rows, kProbTiles [kTile, kPStride] tiles of probabilities / scores, the per-row
// lse and dsum, the documents of the query and key tiles, and two words of range.
template <int kD, int kHeadTiles, int kProbTiles>
struct Shared {
  static constexpr size_t Bytes() {
    return (kHeadTiles * kTile * (kD + 1) + kProbTiles * kTile * kPStride + 2 * kTile) *
               sizeof(float) +
           (2 * kTile + 2) * sizeof(long long);
  }
  __device__ explicit Shared(float* base) {
    for (int t = 0; t < kHeadTiles; ++t) head[t] = base + t * kTile * (kD + 1);
    float* next = base + kHeadTiles * kTile * (kD + 1);
    for (int t = 0; t < kProbTiles; ++t) prob[t] = next + t * kTile * kPStride;
    lse = next + kProbTiles * kTile * kPStride;
    dsum = lse + kTile;
    q_doc = reinterpret_cast<long long*>(dsum + kTile);  // a multiple of 64 floats in: aligned
    k_doc = q_doc + kTile;
    range = k_doc + kTile;
  }
  float* head[kHeadTiles];
  float* prob[kProbTiles];
  float* lse;
  float* dsum;
  long long* q_doc;
  long long* k_doc;
  long long* range;
};

// Fills q_doc for the query tile and, in range, the keys its queries may see: [earliest
// document start of a visible query, last visible query + 1), or [LLONG_MAX, -1) when the
// tile is all padding. Ends with a barrier.
__device__ __forceinline__ void QueryRange(const BlockTile& b, long long* q_doc, long long* range) {
  if (threadIdx.x < kTile) q_doc[threadIdx.x] = DocOf(b.ds, b.first + threadIdx.x, b.len);
  if (threadIdx.x == 0) {
    range[0] = LLONG_MAX;
    range[1] = -1;
  }
  __syncthreads();
  if (threadIdx.x < kTile && q_doc[threadIdx.x] >= 0) {
    atomicMin(&range[0], q_doc[threadIdx.x]);
    atomicMax(&range[1], b.first + threadIdx.x + 1);
  }
  __syncthreads();
}

// Whether any of the thread's pairs of the (query tile at q0, key tile at k0) is visible.
__device__ __forceinline__ bool AnyVisible(const BlockTile& b, long long q0, long long k0,
                                           const long long* q_doc, const long long* k_doc) {
  bool any = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      any |= Visible(q_doc[b.ty + 16 * i], k_doc[b.tx + 16 * j], q0 + b.ty + 16 * i,
                     k0 + b.tx + 16 * j);
    }
  }
  return any;
}

// Loads k_doc for the key tile at k0 and says (to every thread; a barrier) whether any of
// the query tile's pairs with it is visible.
__device__ __forceinline__ bool KeyTileVisible(const BlockTile& b, long long k0,
                                               const long long* q_doc, long long* k_doc) {
  if (threadIdx.x < kTile) k_doc[threadIdx.x] = DocOf(b.ds, k0 + threadIdx.x, b.len);
  __syncthreads();
  return __syncthreads_or(AnyVisible(b, b.first, k0, q_doc, k_doc)) != 0;
}

// The k and v rows of kv head g for the key tile at k0 (k_doc published) into ks, vs.
template <int kD>
__device__ __forceinline__ void LoadKvTile(const AttentionCudaParams& p, const BlockTile& b, int g,
                                           long long k0, const long long* k_doc, float* ks,
                                           float* vs) {
  const long long off = k0 * b.kv_stride;
  LoadTile<kD>(ks, HeadRows(p.k, b, b.kv_stride, g) + off, b.kv_stride, k_doc, b.d);
  LoadTile<kD>(vs, HeadRows(p.v, b, b.kv_stride, g) + off, b.kv_stride, k_doc, b.d);
}

// The next key tile of a query-tile kernel: false (every thread) when the mask hides all
// its pairs with the query tile; else its k, v rows of kv head g are in ks, vs, synced.
template <int kD>
__device__ __forceinline__ bool NextKeyTile(const AttentionCudaParams& p, const BlockTile& b, int g,
                                            long long k0, const long long* q_doc, long long* k_doc,
                                            float* ks, float* vs) {
  if (!KeyTileVisible(b, k0, q_doc, k_doc)) return false;
  LoadKvTile<kD>(p, b, g, k0, k_doc, ks, vs);
  __syncthreads();
  return true;
}

// ---- forward --------------------------------------------------------------------------

template <int kD>
using ForwardShared = Shared<kD, 3, 1>;  // q, k, v; p

template <int kD>
__global__ void __launch_bounds__(kThreads) ForwardKernel(const AttentionCudaParams p) {
  extern __shared__ float smem[];
  const ForwardShared<kD> sh(smem);
  float *qs = sh.head[0], *ks = sh.head[1], *vs = sh.head[2], *ps = sh.prob[0];
  const BlockTile b = TileOfBlock(p);
  const int h = b.head, g = p.kv_of_q[h];

  QueryRange(b, sh.q_doc, sh.range);
  // Read after a barrier (KeyTileVisible).
  LoadTile<kD>(qs, HeadRows(p.q, b, b.q_stride, h) + b.first * b.q_stride, b.q_stride, sh.q_doc,
               b.d);
  const long long key_begin = sh.range[0], key_end = sh.range[1];

  float m[4], l[4], acc[4][kD / 16];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int jj = 0; jj < kD / 16; ++jj) acc[i][jj] = 0.0f;
  }
  if (key_end > 0) {
    for (long long k0 = key_begin / kTile * kTile; k0 < key_end; k0 += kTile) {
      if (!NextKeyTile<kD>(p, b, g, k0, sh.q_doc, sh.k_doc, ks, vs)) continue;
      float sc[4][4];
      PairDots<kD>(qs, ks, b.d, b.tx, b.ty, sc);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = b.ty + 16 * i;
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = b.tx + 16 * j;
          sc[i][j] = Visible(sh.q_doc[r], sh.k_doc[c], b.first + r, k0 + c) ? sc[i][j] * p.scale
                                                                            : -INFINITY;
          tile_max = fmaxf(tile_max, sc[i][j]);
        }
        const float m_new = fmaxf(m[i], HalfWarpMax(tile_max));
        // No key seen yet (m_new = -inf): every p is 0 and alpha 0, so nothing changes.
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = expf(m[i] - m_use);
        float row_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float pv = expf(sc[i][j] - m_use);  // 0 where hidden
          ps[r * kPStride + b.tx + 16 * j] = pv;
          row_sum += pv;
        }
        l[i] = l[i] * alpha + HalfWarpSum(row_sum);
        m[i] = m_new;
#pragma unroll
        for (int jj = 0; jj < kD / 16; ++jj) acc[i][jj] *= alpha;
      }
      __syncthreads();
      AccumulateTile<kD, false>(ps, vs, b.tx, b.ty, acc);  // acc += p v, keys in order
      __syncthreads();
    }
  }
  StoreTile<kD>(p.out, b.s, b.len, b.first, b.rows, p.q_heads, h, b.d, sh.q_doc, acc, l, b.tx,
                b.ty);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = b.ty + 16 * i;
    if (r >= b.rows || b.tx != 0) continue;
    const long long row = (b.s * b.len + b.first + r) * p.q_heads + h;  // [T, q_heads] index
    p.lse[row] = sh.q_doc[r] >= 0 ? m[i] + logf(l[i]) : 0.0f;
  }
}

// ---- backward: dsum, dq, dk / dv ------------------------------------------------------

// dsum[row] = sum_c d_out[row, c] out[row, c] for each of the T * q_heads rows, one warp
// per row (lanes stride the columns; a fixed xor tree adds them).
__global__ void DsumKernel(const AttentionCudaParams p) {
  const long long rows = p.num_seqs * p.seq_len * p.q_heads;
  const int lane = threadIdx.x % 32, d = p.head_dim;
  const long long warps = static_cast<long long>(gridDim.x) * blockDim.x / 32;
  for (long long row = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       row < rows; row += warps) {
    float acc = 0.0f;
    for (int c = lane; c < d; c += 32) {
      acc = fmaf(p.d_out[row * d + c], p.fwd_out[row * d + c], acc);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) p.dsum[row] = acc;
  }
}

// The query tile at q0 of head h: q and d_out rows into qs, dos, and per row lse and dsum
// (0 for padding rows). q_doc must be published; the caller syncs before reading.
template <int kD>
__device__ __forceinline__ void LoadQueryTile(const AttentionCudaParams& p, const BlockTile& b,
                                              long long q0, int h, const long long* q_doc,
                                              float* qs, float* dos, float* lse_s, float* dsum_s) {
  const long long off = q0 * b.q_stride;
  LoadTile<kD>(qs, HeadRows(p.q, b, b.q_stride, h) + off, b.q_stride, q_doc, b.d);
  LoadTile<kD>(dos, HeadRows(p.d_out, b, b.q_stride, h) + off, b.q_stride, q_doc, b.d);
  if (threadIdx.x < kTile) {
    const int r = threadIdx.x;
    const bool valid = q_doc[r] >= 0;  // padding, or past the sequence's end
    const long long row = (b.s * b.len + q0 + r) * p.q_heads + h;
    lse_s[r] = valid ? p.fwd_lse[row] : 0.0f;
    dsum_s[r] = valid ? p.dsum[row] : 0.0f;
  }
}

// For the thread's pairs of a (query tile at q0, key tile at k0): p = exp(s - lse) and
// ds = p (dp - dsum) scale, 0 where hidden. qs, dos: the query tile's q and d_out; ks, vs:
// the key tile's k and v.
template <int kD>
__device__ __forceinline__ void ProbabilitiesAndScores(
    const BlockTile& b, const float* qs, const float* dos, const float* ks, const float* vs,
    const long long* q_doc, const long long* k_doc, const float* lse_s, const float* dsum_s,
    long long q0, long long k0, float scale, float (&pv)[4][4], float (&dsv)[4][4]) {
  float dp[4][4];
  PairDots<kD>(qs, ks, b.d, b.tx, b.ty, pv);
  PairDots<kD>(dos, vs, b.d, b.tx, b.ty, dp);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = b.ty + 16 * i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = b.tx + 16 * j;
      const bool vis = Visible(q_doc[r], k_doc[c], q0 + r, k0 + c);
      pv[i][j] = vis ? expf(pv[i][j] * scale - lse_s[r]) : 0.0f;
      dsv[i][j] = vis ? pv[i][j] * (dp[i][j] - dsum_s[r]) * scale : 0.0f;
    }
  }
}

template <int kD>
using DqShared = Shared<kD, 4, 1>;  // q, d_out, k, v; ds

// dq of one query tile of one query head: the key tiles in order.
template <int kD>
__global__ void __launch_bounds__(kThreads) DqKernel(const AttentionCudaParams p) {
  extern __shared__ float smem[];
  const DqShared<kD> sh(smem);
  float *qs = sh.head[0], *dos = sh.head[1], *ks = sh.head[2], *vs = sh.head[3];
  float* dss = sh.prob[0];
  const BlockTile b = TileOfBlock(p);
  const int h = b.head, g = p.kv_of_q[h];

  QueryRange(b, sh.q_doc, sh.range);
  // Read after the barriers of KeyTileVisible.
  LoadQueryTile<kD>(p, b, b.first, h, sh.q_doc, qs, dos, sh.lse, sh.dsum);
  const long long key_begin = sh.range[0], key_end = sh.range[1];

  float acc[4][kD / 16];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int jj = 0; jj < kD / 16; ++jj) acc[i][jj] = 0.0f;
  }
  if (key_end > 0) {
    for (long long k0 = key_begin / kTile * kTile; k0 < key_end; k0 += kTile) {
      if (!NextKeyTile<kD>(p, b, g, k0, sh.q_doc, sh.k_doc, ks, vs)) continue;
      float pv[4][4], dsv[4][4];
      ProbabilitiesAndScores<kD>(b, qs, dos, ks, vs, sh.q_doc, sh.k_doc, sh.lse, sh.dsum, b.first,
                                 k0, p.scale, pv, dsv);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) dss[(b.ty + 16 * i) * kPStride + b.tx + 16 * j] = dsv[i][j];
      }
      __syncthreads();
      AccumulateTile<kD, false>(dss, ks, b.tx, b.ty, acc);  // dq += ds k, keys in order
      __syncthreads();
    }
  }
  const float one[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  StoreTile<kD>(p.dq, b.s, b.len, b.first, b.rows, p.q_heads, h, b.d, sh.q_doc, acc, one, b.tx,
                b.ty);
}

template <int kD>
using DkDvShared = Shared<kD, 4, 2>;  // k, v, q, d_out; p, ds

// dk, dv of one key tile of one kv head: its query heads in ascending order, for each the
// query tiles from the one holding the tile's first visible key, in order, until a tile
// reaches past the key tile's last document.
template <int kD>
__global__ void __launch_bounds__(kThreads) DkDvKernel(const AttentionCudaParams p) {
  extern __shared__ float smem[];
  const DkDvShared<kD> sh(smem);
  float *ks = sh.head[0], *vs = sh.head[1], *qs = sh.head[2], *dos = sh.head[3];
  float *ps = sh.prob[0], *dss = sh.prob[1];
  const BlockTile b = TileOfBlock(p);  // the key tile
  const long long k0 = b.first;
  const int g = b.head;

  if (threadIdx.x < kTile) sh.k_doc[threadIdx.x] = DocOf(b.ds, k0 + threadIdx.x, b.len);
  if (threadIdx.x == 0) {
    sh.range[0] = LLONG_MAX;  // the first visible key
    sh.range[1] = -1;         // the last key document
  }
  __syncthreads();
  if (threadIdx.x < kTile && sh.k_doc[threadIdx.x] >= 0) {
    atomicMin(&sh.range[0], k0 + threadIdx.x);
    atomicMax(&sh.range[1], sh.k_doc[threadIdx.x]);
  }
  __syncthreads();
  const long long first_key = sh.range[0], last_doc = sh.range[1];
  LoadKvTile<kD>(p, b, g, k0, sh.k_doc, ks, vs);  // read after the first query tile's barriers

  float acc_k[4][kD / 16], acc_v[4][kD / 16];  // keys ty + 16 i, columns tx + 16 jj
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int jj = 0; jj < kD / 16; ++jj) acc_k[i][jj] = acc_v[i][jj] = 0.0f;
  }
  if (last_doc >= 0) {
    for (int hh = p.heads_begin[g]; hh < p.heads_begin[g + 1]; ++hh) {
      const int h = p.heads[hh];
      for (long long q0 = first_key / kTile * kTile; q0 < b.len; q0 += kTile) {
        // Queries of later documents than the key tile's last one see none of its keys,
        // and (documents being contiguous and in order) neither do later tiles.
        const long long my_doc = threadIdx.x < kTile ? DocOf(b.ds, q0 + threadIdx.x, b.len) : -1;
        if (threadIdx.x < kTile) sh.q_doc[threadIdx.x] = my_doc;
        const bool past = __syncthreads_or(my_doc > last_doc) != 0;  // publishes q_doc
        if (__syncthreads_or(AnyVisible(b, q0, k0, sh.q_doc, sh.k_doc))) {
          LoadQueryTile<kD>(p, b, q0, h, sh.q_doc, qs, dos, sh.lse, sh.dsum);
          __syncthreads();
          float pv[4][4], dsv[4][4];
          ProbabilitiesAndScores<kD>(b, qs, dos, ks, vs, sh.q_doc, sh.k_doc, sh.lse, sh.dsum, q0,
                                     k0, p.scale, pv, dsv);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              ps[(b.ty + 16 * i) * kPStride + b.tx + 16 * j] = pv[i][j];
              dss[(b.ty + 16 * i) * kPStride + b.tx + 16 * j] = dsv[i][j];
            }
          }
          __syncthreads();
          // dv += p^T d_out, dk += ds^T q, queries in order.
          AccumulateTile<kD, true>(ps, dos, b.tx, b.ty, acc_v);
          AccumulateTile<kD, true>(dss, qs, b.tx, b.ty, acc_k);
          __syncthreads();
        }
        if (past) break;
      }
    }
  }
  // Padding keys: zeros (their sums stayed 0 anyway).
  const float one[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  StoreTile<kD>(p.dk, b.s, b.len, k0, b.rows, p.kv_heads, g, b.d, sh.k_doc, acc_k, one, b.tx, b.ty);
  StoreTile<kD>(p.dv, b.s, b.len, k0, b.rows, p.kv_heads, g, b.d, sh.k_doc, acc_v, one, b.tx, b.ty);
}

__global__ void CheckDocStartKernel(const int32_t* doc_start, long long num_seqs, long long len,
                                    unsigned long long* flag) {
  const long long n = num_seqs * len;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long t = i % len, v = doc_start[i];
    // t == 0 never reads doc_start[i - 1]: there v is -1, or v == t, or out of range.
    const bool bad = v != -1 && (v < 0 || v > t || (v != t && doc_start[i - 1] != v));
    if (bad) atomicMin(flag, static_cast<unsigned long long>(i));
  }
}

dim3 Grid(const AttentionCudaParams& p, int heads) {
  const long long tiles = (p.seq_len + kTile - 1) / kTile;
  return dim3(static_cast<unsigned>(p.num_seqs * tiles), static_cast<unsigned>(heads));
}

template <typename Kernel>
cudaError_t LaunchWithSmem(Kernel kernel, dim3 grid, size_t smem, const AttentionCudaParams& p,
                           cudaStream_t stream) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int kD>
cudaError_t Forward(const AttentionCudaParams& p, cudaStream_t stream) {
  return LaunchWithSmem(ForwardKernel<kD>, Grid(p, p.q_heads), ForwardShared<kD>::Bytes(), p,
                        stream);
}

template <int kD>
cudaError_t Backward(const AttentionCudaParams& p, cudaStream_t stream) {
  const long long rows = p.num_seqs * p.seq_len * p.q_heads;
  const long long blocks = std::min((rows * 32 + kThreads - 1) / kThreads, 65536LL);
  DsumKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = LaunchWithSmem(DqKernel<kD>, Grid(p, p.q_heads), DqShared<kD>::Bytes(), p, stream);
  if (err != cudaSuccess) return err;
  return LaunchWithSmem(DkDvKernel<kD>, Grid(p, p.kv_heads), DkDvShared<kD>::Bytes(), p, stream);
}

}  // namespace

cudaError_t LaunchAttentionCheckDocStart(const int32_t* doc_start, int64_t num_seqs,
                                         int64_t seq_len, unsigned long long* flag,
                                         cudaStream_t stream) {
  const long long n = num_seqs * seq_len;
  if (n == 0) return cudaSuccess;
  const long long blocks = std::min((n + kThreads - 1) / kThreads, 4096LL);
  CheckDocStartKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(doc_start, num_seqs,
                                                                              seq_len, flag);
  return cudaGetLastError();
}

cudaError_t LaunchAttentionForward(const AttentionCudaParams& p, cudaStream_t stream) {
  if (p.num_seqs * p.seq_len == 0) return cudaSuccess;
  if (p.head_dim <= 16) return Forward<16>(p, stream);
  if (p.head_dim <= 32) return Forward<32>(p, stream);
  if (p.head_dim <= 64) return Forward<64>(p, stream);
  return Forward<128>(p, stream);
}

cudaError_t LaunchAttentionBackward(const AttentionCudaParams& p, cudaStream_t stream) {
  if (p.num_seqs * p.seq_len == 0) return cudaSuccess;
  if (p.head_dim <= 16) return Backward<16>(p, stream);
  if (p.head_dim <= 32) return Backward<32>(p, stream);
  if (p.head_dim <= 64) return Backward<64>(p, stream);
  return Backward<128>(p, stream);
}

}  // namespace gradsum::model::cuda_internal
