#include "model/attention.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/thread_pool.h"

namespace gradsum::model {
namespace {

absl::Status CheckDims(const AttentionDims& d, size_t q, size_t kv, size_t doc_start,
                       std::vector<int>* kv_of_q) {
  if (d.num_seqs < 0 || d.seq_len < 0 || d.q_heads < 1 || d.kv_heads < 1 || d.head_dim < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention: num_seqs=", d.num_seqs, " seq_len=", d.seq_len, " q_heads=", d.q_heads,
        " kv_heads=", d.kv_heads, " head_dim=", d.head_dim, ": sizes must be positive"));
  }
  if (d.kv_of_q.empty()) {
    if (d.q_heads % d.kv_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("attention: q_heads=", d.q_heads,
                                                     " is not divisible by kv_heads=",
                                                     d.kv_heads));
    }
    const int g = d.q_heads / d.kv_heads;
    kv_of_q->resize(d.q_heads);
    for (int h = 0; h < d.q_heads; ++h) (*kv_of_q)[h] = h / g;
  } else {
    if (static_cast<int>(d.kv_of_q.size()) != d.q_heads) {
      return absl::InvalidArgumentError(absl::StrCat("attention: kv_of_q has ", d.kv_of_q.size(),
                                                     " entries for ", d.q_heads, " query heads"));
    }
    for (int h = 0; h < d.q_heads; ++h) {
      if (d.kv_of_q[h] < 0 || d.kv_of_q[h] >= d.kv_heads) {
        return absl::InvalidArgumentError(absl::StrCat("attention: kv_of_q[", h, "]=",
                                                       d.kv_of_q[h], " outside [0, ",
                                                       d.kv_heads, ")"));
      }
    }
    *kv_of_q = d.kv_of_q;
  }
  const int64_t T = d.num_seqs * d.seq_len;
  if (q != static_cast<size_t>(T * d.q_heads * d.head_dim) ||
      kv != static_cast<size_t>(T * d.kv_heads * d.head_dim) || doc_start != static_cast<size_t>(T)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention: ", T, " tokens need q of ", T * d.q_heads * d.head_dim, ", k and v of ",
        T * d.kv_heads * d.head_dim, " and doc_start of ", T, " values; got ", q, ", ", kv,
        ", ", doc_start));
  }
  return absl::OkStatus();
}

absl::Status CheckDocStarts(const AttentionDims& d, absl::Span<const int32_t> doc_start) {
  for (int64_t t = 0; t < d.num_seqs * d.seq_len; ++t) {
    const int64_t pos = t % d.seq_len;
    if (doc_start[t] != -1 && (doc_start[t] < 0 || doc_start[t] > pos)) {
      return absl::InvalidArgumentError(absl::StrCat("attention: doc_start[", t, "]=", doc_start[t],
                                                     " is neither -1 nor in [0, ", pos, "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AttentionForward(const AttentionDims& dims, absl::Span<const float> q,
                              absl::Span<const float> k, absl::Span<const float> v,
                              absl::Span<const int32_t> doc_start, absl::Span<float> out,
                              absl::Span<float> lse) {
  std::vector<int> kv_of_q;
  GRADSUM_RETURN_IF_ERROR(CheckDims(dims, q.size(), k.size(), doc_start.size(), &kv_of_q));
  if (v.size() != k.size() || out.size() != q.size() ||
      lse.size() != static_cast<size_t>(dims.num_seqs * dims.seq_len * dims.q_heads)) {
    return absl::InvalidArgumentError("attention forward: v, out or lse has the wrong size");
  }
  GRADSUM_RETURN_IF_ERROR(CheckDocStarts(dims, doc_start));
  const int64_t S = dims.seq_len, d = dims.head_dim, Hq = dims.q_heads, Hk = dims.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  return ParallelForStatus(ComputeThreads(), dims.num_seqs * Hq, [&](int64_t job) {
    const int64_t n = job / Hq;
    const int h = static_cast<int>(job % Hq), j = kv_of_q[h];
    std::vector<float> scores(S);
    for (int64_t t = 0; t < S; ++t) {
      const int64_t row = n * S + t;
      float* o = out.data() + (row * Hq + h) * d;
      const int32_t start = doc_start[row];
      if (start < 0) {
        std::fill(o, o + d, 0.0f);
        lse[row * Hq + h] = 0.0f;
        continue;
      }
      const float* qt = q.data() + (row * Hq + h) * d;
      float mx = -INFINITY;
      for (int64_t s = start; s <= t; ++s) {
        const float* ks = k.data() + ((n * S + s) * Hk + j) * d;
        float dot = 0.0f;
        for (int64_t i = 0; i < d; ++i) dot += qt[i] * ks[i];
        scores[s] = dot * scale;
        mx = std::max(mx, scores[s]);
      }
      float sum = 0.0f;
      for (int64_t s = start; s <= t; ++s) {
        scores[s] = std::exp(scores[s] - mx);
        sum += scores[s];
      }
      std::fill(o, o + d, 0.0f);
      for (int64_t s = start; s <= t; ++s) {
        const float p = scores[s] / sum;
        const float* vs = v.data() + ((n * S + s) * Hk + j) * d;
        for (int64_t i = 0; i < d; ++i) o[i] += p * vs[i];
      }
      lse[row * Hq + h] = mx + std::log(sum);
    }
    return absl::OkStatus();
  });
}

absl::Status AttentionBackward(const AttentionDims& dims, absl::Span<const float> q,
                               absl::Span<const float> k, absl::Span<const float> v,
                               absl::Span<const int32_t> doc_start, absl::Span<const float> out,
                               absl::Span<const float> lse, absl::Span<const float> d_out,
                               absl::Span<float> dq, absl::Span<float> dk, absl::Span<float> dv) {
  std::vector<int> kv_of_q;
  GRADSUM_RETURN_IF_ERROR(CheckDims(dims, q.size(), k.size(), doc_start.size(), &kv_of_q));
  if (v.size() != k.size() || out.size() != q.size() || d_out.size() != q.size() ||
      dq.size() != q.size() || dk.size() != k.size() || dv.size() != k.size() ||
      lse.size() != static_cast<size_t>(dims.num_seqs * dims.seq_len * dims.q_heads)) {
    return absl::InvalidArgumentError("attention backward: an operand has the wrong size");
  }
  GRADSUM_RETURN_IF_ERROR(CheckDocStarts(dims, doc_start));
  const int64_t S = dims.seq_len, d = dims.head_dim, Hq = dims.q_heads, Hk = dims.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // One job per (sequence, kv head): its query heads in order, so dk and dv of a shared kv
  // head are summed in a fixed order without races.
  return ParallelForStatus(ComputeThreads(), dims.num_seqs * Hk, [&](int64_t job) {
    const int64_t n = job / Hk;
    const int j = static_cast<int>(job % Hk);
    for (int64_t s = 0; s < S; ++s) {
      float* dks = dk.data() + ((n * S + s) * Hk + j) * d;
      float* dvs = dv.data() + ((n * S + s) * Hk + j) * d;
      std::fill(dks, dks + d, 0.0f);
      std::fill(dvs, dvs + d, 0.0f);
    }
    for (int h = 0; h < Hq; ++h) {
      if (kv_of_q[h] != j) continue;
      for (int64_t t = 0; t < S; ++t) {
        const int64_t row = n * S + t;
        float* dqt = dq.data() + (row * Hq + h) * d;
        std::fill(dqt, dqt + d, 0.0f);
        const int32_t start = doc_start[row];
        if (start < 0) continue;
        const float* qt = q.data() + (row * Hq + h) * d;
        const float* ot = out.data() + (row * Hq + h) * d;
        const float* dot_t = d_out.data() + (row * Hq + h) * d;
        float delta = 0.0f;  // sum_i dO_i O_i
        for (int64_t i = 0; i < d; ++i) delta += dot_t[i] * ot[i];
        const float l = lse[row * Hq + h];
        for (int64_t s = start; s <= t; ++s) {
          const int64_t srow = n * S + s;
          const float* ks = k.data() + (srow * Hk + j) * d;
          const float* vs = v.data() + (srow * Hk + j) * d;
          float dot = 0.0f, dp = 0.0f;
          for (int64_t i = 0; i < d; ++i) {
            dot += qt[i] * ks[i];
            dp += dot_t[i] * vs[i];
          }
          const float p = std::exp(dot * scale - l);
          const float ds = p * (dp - delta) * scale;
          float* dks = dk.data() + (srow * Hk + j) * d;
          float* dvs = dv.data() + (srow * Hk + j) * d;
          for (int64_t i = 0; i < d; ++i) {
            dqt[i] += ds * ks[i];
            dks[i] += ds * qt[i];
            dvs[i] += p * dot_t[i];
          }
        }
      }
    }
    return absl::OkStatus();
  });
}

}  // namespace gradsum::model
