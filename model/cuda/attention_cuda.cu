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

// The block's query tile: which sequence, first query, how many rows.
struct QueryTile {
  long long s = 0;   // sequence
  long long q0 = 0;  // first query (within the sequence)
  int rows = 0;      // queries of the tile inside the sequence
};

__device__ __forceinline__ QueryTile TileOfBlock(long long len) {
  const long long tiles = (len + kTile - 1) / kTile;
  QueryTile t;
  t.s = blockIdx.x / tiles;
  t.q0 = (blockIdx.x % tiles) * kTile;
  t.rows = static_cast<int>(min(static_cast<long long>(kTile), len - t.q0));
  return t;
}

// Fills q_doc for the query tile and, in range, the keys its queries may see: [earliest
// document start of a visible query, last visible query + 1), or [LLONG_MAX, -1) when the
// tile is all padding. Ends with a barrier.
__device__ __forceinline__ void QueryRange(const int32_t* ds, long long len, long long q0,
                                           long long* q_doc, long long* range) {
  if (threadIdx.x < kTile) q_doc[threadIdx.x] = DocOf(ds, q0 + threadIdx.x, len);
  if (threadIdx.x == 0) {
    range[0] = LLONG_MAX;
    range[1] = -1;
  }
  __syncthreads();
  if (threadIdx.x < kTile && q_doc[threadIdx.x] >= 0) {
    atomicMin(&range[0], q_doc[threadIdx.x]);
    atomicMax(&range[1], q0 + threadIdx.x + 1);
  }
  __syncthreads();
}

// Loads k_doc for the key tile at k0 and says (to every thread; a barrier) whether any of
// the tile's (query, key) pairs is visible.
__device__ __forceinline__ bool KeyTileVisible(const int32_t* ds, long long len, long long q0,
                                               long long k0, const long long* q_doc,
                                               long long* k_doc, int tx, int ty) {
  if (threadIdx.x < kTile) k_doc[threadIdx.x] = DocOf(ds, k0 + threadIdx.x, len);
  __syncthreads();
  bool any = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      any |= Visible(q_doc[ty + 16 * i], k_doc[tx + 16 * j], q0 + ty + 16 * i, k0 + tx + 16 * j);
    }
  }
  return __syncthreads_or(any) != 0;
}

// ---- forward --------------------------------------------------------------------------

template <int kD>
constexpr size_t ForwardSmem() {
  return (3 * kTile * (kD + 1) + kTile * kPStride) * sizeof(float) +
         (2 * kTile + 2) * sizeof(long long);
}

template <int kD>
__global__ void __launch_bounds__(kThreads) ForwardKernel(const AttentionCudaParams p) {
  constexpr int kRow = kD + 1, kCols = kD / 16;
  extern __shared__ float smem[];
  float* qs = smem;
  float* ks = qs + kTile * kRow;
  float* vs = ks + kTile * kRow;
  float* ps = vs + kTile * kRow;
  long long* q_doc = reinterpret_cast<long long*>(ps + kTile * kPStride);  // 256-byte aligned
  long long* k_doc = q_doc + kTile;
  long long* range = k_doc + kTile;

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const long long len = p.seq_len;
  const QueryTile qt = TileOfBlock(len);
  const int h = blockIdx.y, g = p.kv_of_q[h], d = p.head_dim;
  const long long q_stride = static_cast<long long>(p.q_heads) * d;
  const long long kv_stride = static_cast<long long>(p.kv_heads) * d;
  const int32_t* ds = p.doc_start + qt.s * len;
  const float* q_seq = p.q + qt.s * len * q_stride + static_cast<long long>(h) * d;
  const float* k_seq = p.k + qt.s * len * kv_stride + static_cast<long long>(g) * d;
  const float* v_seq = p.v + qt.s * len * kv_stride + static_cast<long long>(g) * d;

  QueryRange(ds, len, qt.q0, q_doc, range);
  LoadTile<kD>(qs, q_seq + qt.q0 * q_stride, q_stride, q_doc, d);  // read after a barrier
  const long long key_begin = range[0], key_end = range[1];

  float m[4], l[4], acc[4][kCols];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int jj = 0; jj < kCols; ++jj) acc[i][jj] = 0.0f;
  }
  if (key_end > 0) {
    for (long long k0 = key_begin / kTile * kTile; k0 < key_end; k0 += kTile) {
      if (!KeyTileVisible(ds, len, qt.q0, k0, q_doc, k_doc, tx, ty)) continue;
      LoadTile<kD>(ks, k_seq + k0 * kv_stride, kv_stride, k_doc, d);
      LoadTile<kD>(vs, v_seq + k0 * kv_stride, kv_stride, k_doc, d);
      __syncthreads();
      float sc[4][4];
      PairDots<kD>(qs, ks, d, tx, ty, sc);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = ty + 16 * i;
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = tx + 16 * j;
          sc[i][j] = Visible(q_doc[r], k_doc[c], qt.q0 + r, k0 + c) ? sc[i][j] * p.scale
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
          ps[r * kPStride + tx + 16 * j] = pv;
          row_sum += pv;
        }
        l[i] = l[i] * alpha + HalfWarpSum(row_sum);
        m[i] = m_new;
#pragma unroll
        for (int jj = 0; jj < kCols; ++jj) acc[i][jj] *= alpha;
      }
      __syncthreads();
      for (int c = 0; c < kTile; ++c) {  // acc += p v, keys in order
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float pv = ps[(ty + 16 * i) * kPStride + c];
#pragma unroll
          for (int jj = 0; jj < kCols; ++jj) {
            acc[i][jj] = fmaf(pv, vs[c * kRow + tx + 16 * jj], acc[i][jj]);
          }
        }
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    if (r >= qt.rows) continue;
    const long long row = (qt.s * len + qt.q0 + r) * p.q_heads + h;  // [T, q_heads] index
    const bool valid = q_doc[r] >= 0;
#pragma unroll
    for (int jj = 0; jj < kCols; ++jj) {
      const int col = tx + 16 * jj;
      if (col < d) p.out[row * d + col] = valid ? acc[i][jj] / l[i] : 0.0f;
    }
    if (tx == 0) p.lse[row] = valid ? m[i] + logf(l[i]) : 0.0f;
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

// Per row of a query tile of head h: lse and dsum into shared memory (0 for padding rows).
__device__ __forceinline__ void LoadRowTerms(const AttentionCudaParams& p, long long s,
                                             long long q0, int rows, int h,
                                             const long long* q_doc, float* lse_s,
                                             float* dsum_s) {
  if (threadIdx.x < kTile) {
    const int r = threadIdx.x;
    const bool valid = r < rows && q_doc[r] >= 0;
    const long long row = (s * p.seq_len + q0 + r) * p.q_heads + h;
    lse_s[r] = valid ? p.fwd_lse[row] : 0.0f;
    dsum_s[r] = valid ? p.dsum[row] : 0.0f;
  }
}

// For the thread's pairs of a (query tile, key tile): p = exp(s - lse) and
// ds = p (dp - dsum) scale, 0 where hidden. qs, dos: the query tile's q and d_out; ks, vs:
// the key tile's k and v.
template <int kD>
__device__ __forceinline__ void ProbabilitiesAndScores(
    const float* qs, const float* dos, const float* ks, const float* vs, const long long* q_doc,
    const long long* k_doc, const float* lse_s, const float* dsum_s, long long q0, long long k0,
    int d, float scale, int tx, int ty, float (&pv)[4][4], float (&dsv)[4][4]) {
  float dp[4][4];
  PairDots<kD>(qs, ks, d, tx, ty, pv);
  PairDots<kD>(dos, vs, d, tx, ty, dp);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = tx + 16 * j;
      const bool vis = Visible(q_doc[r], k_doc[c], q0 + r, k0 + c);
      pv[i][j] = vis ? expf(pv[i][j] * scale - lse_s[r]) : 0.0f;
      dsv[i][j] = vis ? pv[i][j] * (dp[i][j] - dsum_s[r]) * scale : 0.0f;
    }
  }
}

template <int kD>
constexpr size_t DqSmem() {
  return (4 * kTile * (kD + 1) + kTile * kPStride + 2 * kTile) * sizeof(float) +
         (2 * kTile + 2) * sizeof(long long);
}

// dq of one query tile of one query head: the key tiles in order.
template <int kD>
__global__ void __launch_bounds__(kThreads) DqKernel(const AttentionCudaParams p) {
  constexpr int kRow = kD + 1, kCols = kD / 16;
  extern __shared__ float smem[];
  float* qs = smem;
  float* dos = qs + kTile * kRow;
  float* ks = dos + kTile * kRow;
  float* vs = ks + kTile * kRow;
  float* dss = vs + kTile * kRow;
  float* lse_s = dss + kTile * kPStride;
  float* dsum_s = lse_s + kTile;
  long long* q_doc = reinterpret_cast<long long*>(dsum_s + kTile);  // 256-byte aligned
  long long* k_doc = q_doc + kTile;
  long long* range = k_doc + kTile;

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const long long len = p.seq_len;
  const QueryTile qt = TileOfBlock(len);
  const int h = blockIdx.y, g = p.kv_of_q[h], d = p.head_dim;
  const long long q_stride = static_cast<long long>(p.q_heads) * d;
  const long long kv_stride = static_cast<long long>(p.kv_heads) * d;
  const int32_t* ds = p.doc_start + qt.s * len;
  const long long q_off = qt.s * len * q_stride + static_cast<long long>(h) * d;
  const float* k_seq = p.k + qt.s * len * kv_stride + static_cast<long long>(g) * d;
  const float* v_seq = p.v + qt.s * len * kv_stride + static_cast<long long>(g) * d;

  QueryRange(ds, len, qt.q0, q_doc, range);
  // Read after the barriers of KeyTileVisible.
  LoadTile<kD>(qs, p.q + q_off + qt.q0 * q_stride, q_stride, q_doc, d);
  LoadTile<kD>(dos, p.d_out + q_off + qt.q0 * q_stride, q_stride, q_doc, d);
  LoadRowTerms(p, qt.s, qt.q0, qt.rows, h, q_doc, lse_s, dsum_s);
  const long long key_begin = range[0], key_end = range[1];

  float acc[4][kCols];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int jj = 0; jj < kCols; ++jj) acc[i][jj] = 0.0f;
  }
  if (key_end > 0) {
    for (long long k0 = key_begin / kTile * kTile; k0 < key_end; k0 += kTile) {
      if (!KeyTileVisible(ds, len, qt.q0, k0, q_doc, k_doc, tx, ty)) continue;
      LoadTile<kD>(ks, k_seq + k0 * kv_stride, kv_stride, k_doc, d);
      LoadTile<kD>(vs, v_seq + k0 * kv_stride, kv_stride, k_doc, d);
      __syncthreads();
      float pv[4][4], dsv[4][4];
      ProbabilitiesAndScores<kD>(qs, dos, ks, vs, q_doc, k_doc, lse_s, dsum_s, qt.q0, k0, d,
                                 p.scale, tx, ty, pv, dsv);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) dss[(ty + 16 * i) * kPStride + tx + 16 * j] = dsv[i][j];
      }
      __syncthreads();
      for (int c = 0; c < kTile; ++c) {  // dq += ds k, keys in order
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float dv = dss[(ty + 16 * i) * kPStride + c];
#pragma unroll
          for (int jj = 0; jj < kCols; ++jj) {
            acc[i][jj] = fmaf(dv, ks[c * kRow + tx + 16 * jj], acc[i][jj]);
          }
        }
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    if (r >= qt.rows) continue;
    const long long row = (qt.s * len + qt.q0 + r) * p.q_heads + h;
#pragma unroll
    for (int jj = 0; jj < kCols; ++jj) {
      const int col = tx + 16 * jj;
      if (col < d) p.dq[row * d + col] = q_doc[r] >= 0 ? acc[i][jj] : 0.0f;
    }
  }
}

template <int kD>
constexpr size_t DkDvSmem() {
  return (4 * kTile * (kD + 1) + 2 * kTile * kPStride + 2 * kTile) * sizeof(float) +
         (2 * kTile + 2) * sizeof(long long);
}

// dk, dv of one key tile of one kv head: its query heads in ascending order, for each the
// query tiles from the one holding the tile's first visible key, in order, until a tile
// reaches past the key tile's last document.
template <int kD>
__global__ void __launch_bounds__(kThreads) DkDvKernel(const AttentionCudaParams p) {
  constexpr int kRow = kD + 1, kCols = kD / 16;
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = ks + kTile * kRow;
  float* qs = vs + kTile * kRow;
  float* dos = qs + kTile * kRow;
  float* ps = dos + kTile * kRow;
  float* dss = ps + kTile * kPStride;
  float* lse_s = dss + kTile * kPStride;
  float* dsum_s = lse_s + kTile;
  long long* q_doc = reinterpret_cast<long long*>(dsum_s + kTile);  // 256-byte aligned
  long long* k_doc = q_doc + kTile;
  long long* key_info = k_doc + kTile;  // first visible key, last key document

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const long long len = p.seq_len;
  const QueryTile kt = TileOfBlock(len);  // here: the key tile
  const long long k0 = kt.q0;
  const int g = blockIdx.y, d = p.head_dim;
  const long long q_stride = static_cast<long long>(p.q_heads) * d;
  const long long kv_stride = static_cast<long long>(p.kv_heads) * d;
  const int32_t* ds = p.doc_start + kt.s * len;
  const long long kv_off = kt.s * len * kv_stride + static_cast<long long>(g) * d;

  if (threadIdx.x < kTile) k_doc[threadIdx.x] = DocOf(ds, k0 + threadIdx.x, len);
  if (threadIdx.x == 0) {
    key_info[0] = LLONG_MAX;
    key_info[1] = -1;
  }
  __syncthreads();
  if (threadIdx.x < kTile && k_doc[threadIdx.x] >= 0) {
    atomicMin(&key_info[0], k0 + threadIdx.x);
    atomicMax(&key_info[1], k_doc[threadIdx.x]);
  }
  __syncthreads();
  const long long first_key = key_info[0], last_doc = key_info[1];
  // Read after the first query tile's barriers.
  LoadTile<kD>(ks, p.k + kv_off + k0 * kv_stride, kv_stride, k_doc, d);
  LoadTile<kD>(vs, p.v + kv_off + k0 * kv_stride, kv_stride, k_doc, d);

  float acc_k[4][kCols], acc_v[4][kCols];  // keys ty + 16 i, columns tx + 16 jj
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int jj = 0; jj < kCols; ++jj) acc_k[i][jj] = acc_v[i][jj] = 0.0f;
  }
  if (last_doc >= 0) {
    for (int hh = p.heads_begin[g]; hh < p.heads_begin[g + 1]; ++hh) {
      const int h = p.heads[hh];
      const long long q_off = kt.s * len * q_stride + static_cast<long long>(h) * d;
      for (long long q0 = first_key / kTile * kTile; q0 < len; q0 += kTile) {
        // Queries of later documents than the key tile's last one see none of its keys,
        // and (documents being contiguous and in order) neither do later tiles.
        const long long my_doc = threadIdx.x < kTile ? DocOf(ds, q0 + threadIdx.x, len) : -1;
        if (threadIdx.x < kTile) q_doc[threadIdx.x] = my_doc;
        const bool past = __syncthreads_or(my_doc > last_doc) != 0;  // publishes q_doc
        bool any = false;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            any |= Visible(q_doc[ty + 16 * i], k_doc[tx + 16 * j], q0 + ty + 16 * i,
                           k0 + tx + 16 * j);
          }
        }
        if (__syncthreads_or(any)) {
          const int q_rows = static_cast<int>(min(static_cast<long long>(kTile), len - q0));
          LoadTile<kD>(qs, p.q + q_off + q0 * q_stride, q_stride, q_doc, d);
          LoadTile<kD>(dos, p.d_out + q_off + q0 * q_stride, q_stride, q_doc, d);
          LoadRowTerms(p, kt.s, q0, q_rows, h, q_doc, lse_s, dsum_s);
          __syncthreads();
          float pv[4][4], dsv[4][4];
          ProbabilitiesAndScores<kD>(qs, dos, ks, vs, q_doc, k_doc, lse_s, dsum_s, q0, k0, d,
                                     p.scale, tx, ty, pv, dsv);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              ps[(ty + 16 * i) * kPStride + tx + 16 * j] = pv[i][j];
              dss[(ty + 16 * i) * kPStride + tx + 16 * j] = dsv[i][j];
            }
          }
          __syncthreads();
          for (int r = 0; r < kTile; ++r) {  // dv += p^T d_out, dk += ds^T q, queries in order
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float pr = ps[r * kPStride + ty + 16 * i];
              const float dr = dss[r * kPStride + ty + 16 * i];
#pragma unroll
              for (int jj = 0; jj < kCols; ++jj) {
                acc_v[i][jj] = fmaf(pr, dos[r * kRow + tx + 16 * jj], acc_v[i][jj]);
                acc_k[i][jj] = fmaf(dr, qs[r * kRow + tx + 16 * jj], acc_k[i][jj]);
              }
            }
          }
          __syncthreads();
        }
        if (past) break;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = ty + 16 * i;
    if (c >= kt.rows) continue;
    const long long row = (kt.s * len + k0 + c) * p.kv_heads + g;  // [T, kv_heads] index
#pragma unroll
    for (int jj = 0; jj < kCols; ++jj) {
      const int col = tx + 16 * jj;
      if (col < d) {
        p.dk[row * d + col] = acc_k[i][jj];
        p.dv[row * d + col] = acc_v[i][jj];
      }
    }
  }
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
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int kD>
cudaError_t Forward(const AttentionCudaParams& p, cudaStream_t stream) {
  return LaunchWithSmem(ForwardKernel<kD>, Grid(p, p.q_heads), ForwardSmem<kD>(), p, stream);
}

template <int kD>
cudaError_t Backward(const AttentionCudaParams& p, cudaStream_t stream) {
  const long long rows = p.num_seqs * p.seq_len * p.q_heads;
  const long long blocks = std::min((rows * 32 + kThreads - 1) / kThreads, 65536LL);
  DsumKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = LaunchWithSmem(DqKernel<kD>, Grid(p, p.q_heads), DqSmem<kD>(), p, stream);
  if (err != cudaSuccess) return err;
  return LaunchWithSmem(DkDvKernel<kD>, Grid(p, p.kv_heads), DkDvSmem<kD>(), p, stream);
}

}  // namespace

cudaError_t LaunchAttentionCheckDocStart(const int32_t* doc_start, int64_t num_seqs,
                                         int64_t seq_len, unsigned long long* flag,
                                         cudaStream_t stream) {
  const long long n = num_seqs * seq_len;
  if (n == 0) return cudaSuccess;
  const long long blocks = std::min((n + kThreads - 1) / kThreads, 4096LL);
  CheckDocStartKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      doc_start, num_seqs, seq_len, flag);
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
