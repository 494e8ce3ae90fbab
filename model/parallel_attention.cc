#include "model/parallel_attention.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum::model {

absl::StatusOr<std::unique_ptr<ParallelAttention>> ParallelAttention::Create(
    const MoeLmConfig& config, ModelOps* ops, const ParallelAttentionOptions& options) {
  if (ops == nullptr) return absl::InvalidArgumentError("ParallelAttention needs a device's ops");
  auto block = std::unique_ptr<ParallelAttention>(new ParallelAttention(config, ops, options));
  if (config.attention && config.n_heads % block->sp_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model.heads=", config.n_heads,
                                                   " is not divisible by sp=", block->sp_,
                                                   " (Ulysses splits whole heads)"));
  }
  if (config.attention && block->cp_ > 1 && !ops->HostMemory()) {
    return absl::UnimplementedError(absl::StrCat(
        "context parallelism (cp=", block->cp_,
        ", SEMANTICS.md §16): these ops' memory is not the host's, and the ring has no device "
        "kernels yet (per-chunk attention forward / backward with log-sum-exp and the online "
        "softmax merge, model/attention_kernels.h); use a CPU backend"));
  }
  return block;
}

ParallelAttention::ParallelAttention(const MoeLmConfig& config, ModelOps* ops,
                                     const ParallelAttentionOptions& options)
    : config_(config), ops_(ops), mesh_(options.mesh) {
  if (mesh_ != nullptr) {
    sp_ = mesh_->size(MeshAxis::kSp);
    cp_ = mesh_->size(MeshAxis::kCp);
  }
  // Reproducible mode's bits do not depend on the CP size: attention gathers the group's
  // chunks and runs the whole-sequence kernel (model/ring_attention.h).
  schedule_ = options.reproducible ? RingSchedule::kGathered : RingSchedule::kRing;
  if (config.attention && config.n_heads % sp_ == 0) {
    const HeadLayout heads = HeadLayoutOf(config, sp_);
    head_dim_ = heads.head_dim;
    heads_local_ = heads.heads_local;
    group_ = heads.group;
  }
}

absl::Status ParallelAttention::Reserve(int64_t rows) {
  const int64_t n = rows * config_.dim;  // sp parts of rows * Hl * head_dim
  for (std::unique_ptr<DeviceArray>* a : {&send_, &recv_}) {
    if (*a == nullptr || (*a)->size() < n) {
      GRADSUM_ASSIGN_OR_RETURN(*a, ops_->Allocate(n));
    }
  }
  return absl::OkStatus();
}

int64_t ParallelAttention::HeldBytes() const {
  int64_t floats = 0;
  for (const std::unique_ptr<DeviceArray>* a : {&send_, &recv_}) {
    if (*a != nullptr) floats += (*a)->size();
  }
  return floats * static_cast<int64_t>(sizeof(float));
}

absl::Status ParallelAttention::Begin(const MicroBatchInputs& in) {
  const int64_t T = in.rows;
  if ((cp_ > 1 && in.seq_len % (2 * cp_) != 0) || (in.seq_len / cp_) % sp_ != 0 ||
      in.sequences * (in.seq_len / cp_ / sp_) != T) {
    return absl::InvalidArgumentError(absl::StrCat("attention: ", T, " tokens are not ",
                                                   in.sequences, " sequences of ", in.seq_len,
                                                   " / (sp=", sp_, " cp=", cp_, ") tokens"));
  }
  if (static_cast<int64_t>(in.doc_start.size()) != in.sequences * in.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("attention: ", in.doc_start.size(),
                                                   " document starts for ", in.sequences,
                                                   " sequences of ", in.seq_len, " tokens"));
  }
  rows_ = T;
  sequences_ = in.sequences;
  seq_len_ = in.seq_len;
  seq_rows_ = in.seq_len / cp_;
  doc_start_ = in.doc_start;
  return Reserve(T);
}

absl::Status ParallelAttention::TokensToHeads(const float* x, bool kv, float* out) {
  float* send = send_->data();
  GRADSUM_RETURN_IF_ERROR(ops_->PackHeads(x, kv, sp_, send));
  const float* recv = send;
  if (sp_ > 1) {
    GRADSUM_RETURN_IF_ERROR(
        ops_->AllToAll(MeshAxis::kSp, send, recv_->data(), rows_ * heads_local_ * head_dim_));
    recv = recv_->data();
  }
  return ops_->UnpackHeads(recv, sp_, seq_rows_, out);
}

absl::Status ParallelAttention::HeadsToTokens(const float* x, float* out) {
  float* send = send_->data();
  GRADSUM_RETURN_IF_ERROR(ops_->PackTokens(x, sp_, seq_rows_, send));
  const float* recv = send;
  if (sp_ > 1) {
    GRADSUM_RETURN_IF_ERROR(
        ops_->AllToAll(MeshAxis::kSp, send, recv_->data(), rows_ * heads_local_ * head_dim_));
    recv = recv_->data();
  }
  return ops_->UnpackTokens(recv, sp_, out);
}

// The ring's dims. Its k, v hold each query head's copy of its kv head (TokensToHeads
// repeats them); the ring schedule carries each distinct kv head once: heads_local_ query
// heads in consecutive groups of gcd(group_, heads_local_), each group's copies the same kv
// head (whatever the SP split), so kv_heads = heads_local_ / that. The gathered schedule
// (reproducible mode) keeps one per query head: its bits are the whole-sequence call's,
// which the model makes with the copies.
RingAttentionDims ParallelAttention::RingDims() const {
  RingAttentionDims d;
  d.num_seqs = sequences_;
  d.seq_len = seq_len_;
  d.heads = static_cast<int>(heads_local_);
  d.kv_heads = d.heads;
  if (schedule_ == RingSchedule::kRing) {
    d.kv_heads = static_cast<int>(heads_local_ / std::gcd<int64_t>(group_, heads_local_));
  }
  d.head_dim = head_dim_;
  return d;
}

// k and v as the ring takes them: the inputs themselves with one kv head per query head,
// else the first query head's copy of each group, into kc_, vc_.
absl::Status ParallelAttention::RingKv(const RingAttentionDims& rd, const float* k, const float* v,
                                       absl::Span<const float>* kr, absl::Span<const float>* vr) {
  const int64_t n = HeadRows() * heads_local_ * head_dim_;
  if (rd.kv_heads == rd.heads) {
    *kr = absl::MakeConstSpan(k, n);
    *vr = absl::MakeConstSpan(v, n);
    return absl::OkStatus();
  }
  const int64_t rows = HeadRows(), g = rd.heads / rd.kv_heads, hd = head_dim_;
  kc_.resize(rows * rd.kv_heads * hd);
  vc_.resize(kc_.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < rd.kv_heads; ++j) {
      const int64_t from = (r * rd.heads + j * g) * hd, to = (r * rd.kv_heads + j) * hd;
      std::copy_n(k + from, hd, kc_.data() + to);
      std::copy_n(v + from, hd, vc_.data() + to);
    }
  }
  *kr = absl::MakeConstSpan(kc_);
  *vr = absl::MakeConstSpan(vc_);
  return absl::OkStatus();
}

absl::Status ParallelAttention::Forward(const float* q, const float* k, const float* v, float* out,
                                        float* lse) {
  const int heads = static_cast<int>(heads_local_);
  if (cp_ == 1) return ops_->Attention(heads, q, k, v, out, lse);
  const int64_t n = HeadRows() * heads_local_ * head_dim_;
  const RingAttentionDims rd = RingDims();
  absl::Span<const float> kr, vr;
  GRADSUM_RETURN_IF_ERROR(RingKv(rd, k, v, &kr, &vr));
  return RingAttentionForward(mesh_->group(MeshAxis::kCp), rd, schedule_, absl::MakeConstSpan(q, n),
                              kr, vr, doc_start_, absl::MakeSpan(out, n),
                              absl::MakeSpan(lse, HeadRows() * heads));
}

absl::Status ParallelAttention::Backward(const float* q, const float* k, const float* v,
                                         const float* out, const float* lse, const float* d_out,
                                         float* dq, float* dk, float* dv) {
  const int heads = static_cast<int>(heads_local_);
  if (cp_ == 1) return ops_->AttentionBackward(heads, q, k, v, out, lse, d_out, dq, dk, dv);
  const int64_t n = HeadRows() * heads_local_ * head_dim_;
  const RingAttentionDims rd = RingDims();
  absl::Span<const float> kr, vr;
  GRADSUM_RETURN_IF_ERROR(RingKv(rd, k, v, &kr, &vr));
  Communicator& group = mesh_->group(MeshAxis::kCp);
  const absl::Span<const float> lse_span = absl::MakeConstSpan(lse, HeadRows() * heads);
  if (rd.kv_heads == rd.heads) {
    return RingAttentionBackward(group, rd, schedule_, absl::MakeConstSpan(q, n), kr, vr,
                                 doc_start_, absl::MakeConstSpan(out, n), lse_span,
                                 absl::MakeConstSpan(d_out, n), absl::MakeSpan(dq, n),
                                 absl::MakeSpan(dk, n), absl::MakeSpan(dv, n));
  }
  // The shared kv heads' gradients, each written to the first query head of its group and 0
  // to the others: SumKvGroups, which the model runs next, adds them.
  dkc_.resize(kc_.size());
  dvc_.resize(vc_.size());
  GRADSUM_RETURN_IF_ERROR(
      RingAttentionBackward(group, rd, schedule_, absl::MakeConstSpan(q, n), kr, vr, doc_start_,
                            absl::MakeConstSpan(out, n), lse_span, absl::MakeConstSpan(d_out, n),
                            absl::MakeSpan(dq, n), absl::MakeSpan(dkc_), absl::MakeSpan(dvc_)));
  const int64_t g = rd.heads / rd.kv_heads, hd = head_dim_;
  std::fill(dk, dk + n, 0.0f);
  std::fill(dv, dv + n, 0.0f);
  for (int64_t r = 0; r < HeadRows(); ++r) {
    for (int64_t j = 0; j < rd.kv_heads; ++j) {
      const int64_t from = (r * rd.kv_heads + j) * hd, to = (r * rd.heads + j * g) * hd;
      std::copy_n(dkc_.data() + from, hd, dk + to);
      std::copy_n(dvc_.data() + from, hd, dv + to);
    }
  }
  return absl::OkStatus();
}

}  // namespace gradsum::model
