#include "model/cuda/cuda_ops.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/device_stream.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/device_buffer.h"
#include "core/cuda/device_flag.h"
#include "core/cuda/gemm.h"
#include "core/status.h"
#include "data/streams.h"
#include "losses/cuda/cross_entropy_cuda.h"
#include "model/attention.h"
#include "model/attention_kernels.h"
#include "model/cuda/attention_cuda.h"
#include "model/cuda/model_kernels.h"
#include "model/layers.h"
#include "model/moe_block_ops.h"
#include "moe/cuda/layers_cuda.h"
#include "moe/cuda/moe_layer_cuda.h"

namespace gradsum::model {
namespace {

using cuda::DeviceBuffer;
using cuda::GemmRowMajor;
using cuda::Reserve;

class CudaArray : public DeviceArray {
 public:
  explicit CudaArray(DeviceBuffer buffer, int64_t numel) : buffer_(std::move(buffer)) {
    data_ = buffer_.as<float>();
    size_ = numel;
  }

 private:
  DeviceBuffer buffer_;
};

// The fp32 device buffer of a gradient target (this device keeps no exact sums).
absl::StatusOr<float*> DeviceGrad(const GradTarget& t, const char* what) {
  if (t.accumulate() == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("the CUDA ops add gradients into fp32 device buffers only; ", what,
                     " has an exact target (reproducible mode runs on the CPU backends)"));
  }
  return t.accumulate();
}

class CudaOps : public MoeBlockOps {
 public:
  CudaOps(const MoeLmSpec& spec, std::shared_ptr<cuda::ComputeContext> ctx, const Mesh& mesh)
      : config_(spec.config()),
        ctx_(std::move(ctx)),
        mesh_(&mesh),
        moe_kernels_(moe::MakeMoeLayersCuda(
            &exec_, mesh, MoeLayerConfigOf(config_),
            {.alpha_z = config_.alpha_z, .alpha_b = config_.alpha_b}, spec.moe_layers())) {
    const MoeLmConfig& m = config_;
    // Every MoE layer of the spec: the L main ones, then the extra blocks' (§15.1).
    InitMoeBlock(moe_kernels_.get(), spec);
    extra_streams_ = spec.label_streams() - 1;
    moe_layers_ = spec.moe_layers();
    exec_.blas = &ctx_->blas;
    exec_.stream = ctx_->stream.get();
    exec_.fence = ctx_->fence;
    const HeadLayout heads = HeadLayoutOf(m, /*sp=*/1);
    head_dim_ = heads.head_dim;
    group_ = heads.group;
  }

  absl::StatusOr<std::unique_ptr<DeviceArray>> Allocate(int64_t numel) override {
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device), "cudaSetDevice");
    GRADSUM_ASSIGN_OR_RETURN(DeviceBuffer b,
                             DeviceBuffer::Create(std::max<int64_t>(numel, 1) * sizeof(float)));
    return std::unique_ptr<DeviceArray>(new CudaArray(std::move(b), numel));
  }

  absl::Status Begin(const MicroBatchInputs& in) override {
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device), "cudaSetDevice");
    const int k = in.forward_only ? 0 : extra_streams_;
    GRADSUM_RETURN_IF_ERROR(CheckBatch(in, k));
    in_ = in;
    if (config_.attention) GRADSUM_RETURN_IF_ERROR(UploadAttentionLayout(in));
    GRADSUM_RETURN_IF_ERROR(ReserveRows(in.rows, k));
    labels_host_.assign(in.labels.begin(), in.labels.end());
    mask_host_.assign(in.mask.begin(), in.mask.end());
    if (k > 0) GRADSUM_RETURN_IF_ERROR(UploadStreamRows(in, k));
    GRADSUM_RETURN_IF_ERROR(UploadBatch(in, k));
    double* d = scalars_.as<double>();  // D, N, ce, z, bal, ...
    moe_kernels_->BeginMicroBatch({.rows = in.rows,
                                   .mask = mask_.as<uint8_t>(),
                                   .num_micro_batches = in.num_micro_batches,
                                   .global_routed_tokens = d + 1,
                                   .z_loss = d + 3,
                                   .balance_loss = d + 4});
    moe_block().BeginMicroBatch();
    // The host copies are pageable: the calls return once they are staged.
    return absl::OkStatus();
  }

  // What Begin checks on the host before any device work (the kernels trust it): one block
  // per micro-batch, every label (every stream's) in [0, V) or ignored.
  absl::Status CheckBatch(const MicroBatchInputs& in, int k) const {
    if (in.row_block != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the CUDA ops compute a micro-batch as one block, not in blocks of ", in.row_block,
          " rows (per-sequence blocks are the exact gradient precision's: CPU backends only)"));
    }
    const int64_t V = config_.vocab, T = in.rows;
    // `where` prefixes the message ("" for the main labels, "label stream j: ").
    auto check_labels = [&](auto labels, const std::string& where) -> absl::Status {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t y = labels[t];
        if (y != data::kIgnoreIndex && (y < 0 || y >= V)) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, "label ", y, " at position ", t, " outside [0, ", V,
                           ") and not ignore_index ", data::kIgnoreIndex));
        }
      }
      return absl::OkStatus();
    };
    GRADSUM_RETURN_IF_ERROR(check_labels(in.labels, ""));
    GRADSUM_RETURN_IF_ERROR(CheckStreamInputs(in, k));
    for (int j = 0; j < k; ++j) {
      GRADSUM_RETURN_IF_ERROR(
          check_labels(in.extra_streams[j].labels, absl::StrCat("label stream ", j + 1, ": ")));
    }
    return absl::OkStatus();
  }

  // Attention's layout of the micro-batch (in_ set): its shape checked, the document starts
  // checked on the host, as the CPU kernel checks them, so that the device check (into
  // attention_error_, read in End) costs no sync per layer; the RoPE tables and the
  // document starts uploaded.
  absl::Status UploadAttentionLayout(const MicroBatchInputs& in) {
    const int64_t T = in.rows;
    cudaStream_t s = exec_.stream;
    if (static_cast<int64_t>(in.positions.size()) != T) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention: ", in.positions.size(), " positions for ", T, " tokens"));
    }
    const AttentionDims dims = HeadDims(static_cast<int>(config_.n_heads));
    if (static_cast<int64_t>(in.doc_start.size()) != in.sequences * in.seq_len) {
      return absl::InvalidArgumentError(absl::StrCat("attention: ", in.doc_start.size(),
                                                     " document starts for ", in.sequences,
                                                     " sequences of ", in.seq_len, " tokens"));
    }
    for (int64_t i = 0; i < static_cast<int64_t>(in.doc_start.size()); ++i) {
      const int32_t previous = i % in.seq_len == 0 ? -1 : in.doc_start[i - 1];
      GRADSUM_RETURN_IF_ERROR(internal::CheckDocStartToken(dims, i, in.doc_start[i], previous));
    }
    if (attention_error_.device_word() == nullptr) {
      GRADSUM_ASSIGN_OR_RETURN(attention_error_, cuda::DeviceIndexFlag::Create());
    }
    RopeTable(in.positions, head_dim_, config_.rope_theta, &cos_host_, &sin_host_);
    GRADSUM_RETURN_IF_ERROR(Reserve(&rope_cos_, cos_host_.size() * sizeof(float)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&rope_sin_, sin_host_.size() * sizeof(float)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&doc_start_, in.doc_start.size() * sizeof(int32_t)));
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(rope_cos_.get(), cos_host_.data(), cos_host_.size() * sizeof(float),
                        cudaMemcpyHostToDevice, s),
        "upload RoPE cosines");
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(rope_sin_.get(), sin_host_.data(), sin_host_.size() * sizeof(float),
                        cudaMemcpyHostToDevice, s),
        "upload RoPE sines");
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(doc_start_.get(), in.doc_start.data(),
                        in.doc_start.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s),
        "upload document starts");
    return absl::OkStatus();
  }

  // The device buffers of a micro-batch of T rows (and k extra streams), grown when T changes.
  absl::Status ReserveRows(int64_t T, int k) {
    if (rows_ == T) return absl::OkStatus();
    const int64_t V = config_.vocab;
    GRADSUM_RETURN_IF_ERROR(Reserve(&tokens_, T * sizeof(int32_t)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&labels_, T * sizeof(int64_t)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&mask_, T));
    GRADSUM_RETURN_IF_ERROR(Reserve(&weights_, T * sizeof(float)));
    GRADSUM_RETURN_IF_ERROR(Reserve(&scalars_, (kScalars + 2 * extra_streams_) * sizeof(double)));
    if (k > 0) {
      GRADSUM_RETURN_IF_ERROR(Reserve(&stream_tokens_, k * T * sizeof(int32_t)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&stream_labels_, k * T * sizeof(int64_t)));
      GRADSUM_RETURN_IF_ERROR(Reserve(&stream_weights_, k * T * sizeof(float)));
    }
    GRADSUM_RETURN_IF_ERROR(Reserve(&logits_, static_cast<size_t>(T) * V * sizeof(float)));
    rows_ = T;
    return absl::OkStatus();
  }

  // The k extra streams' tokens, labels (widened to int64) and CE weights: stream j's rows
  // at (j - 1) T, staged contiguously on the host (pageable copies).
  absl::Status UploadStreamRows(const MicroBatchInputs& in, int k) {
    const int64_t T = in.rows;
    cudaStream_t s = exec_.stream;
    bool weighted = false;
    for (const MicroBatchInputs::Stream& x : in.extra_streams) weighted |= !x.ce_weights.empty();
    stream_tokens_host_.resize(k * T);
    stream_labels_host_.resize(k * T);
    stream_weights_host_.assign(weighted ? k * T : 0, 0.0f);
    for (int j = 0; j < k; ++j) {
      const MicroBatchInputs::Stream& x = in.extra_streams[j];
      std::copy(x.tokens.begin(), x.tokens.end(), stream_tokens_host_.begin() + j * T);
      std::copy(x.labels.begin(), x.labels.end(), stream_labels_host_.begin() + j * T);
      std::copy(x.ce_weights.begin(), x.ce_weights.end(), stream_weights_host_.begin() + j * T);
    }
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(stream_tokens_.get(), stream_tokens_host_.data(), k * T * sizeof(int32_t),
                        cudaMemcpyHostToDevice, s),
        "upload label streams' tokens");
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(stream_labels_.get(), stream_labels_host_.data(), k * T * sizeof(int64_t),
                        cudaMemcpyHostToDevice, s),
        "upload label streams' labels");
    if (!stream_weights_host_.empty()) {
      GRADSUM_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(stream_weights_.get(), stream_weights_host_.data(), k * T * sizeof(float),
                          cudaMemcpyHostToDevice, s),
          "upload label streams' CE weights");
    }
    return absl::OkStatus();
  }

  // The tokens, labels, mask, CE weights and the step statistics: D, N, the loss slots,
  // then per extra stream its normaliser and its loss slot.
  absl::Status UploadBatch(const MicroBatchInputs& in, int k) {
    const int64_t T = in.rows;
    cudaStream_t s = exec_.stream;
    std::vector<double> scalars(kScalars + 2 * extra_streams_, 0.0);  // stream slots 0 if unused
    scalars[0] = in.global_ce_weight_sum;
    scalars[1] = static_cast<double>(in.global_routed_tokens);
    for (int j = 0; j < k; ++j) scalars[kScalars + 2 * j] = in.extra_streams[j].ce_normaliser;
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tokens_.get(), in.tokens.data(),
                                                 T * sizeof(int32_t), cudaMemcpyHostToDevice, s),
                                 "upload tokens");
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(labels_.get(), labels_host_.data(),
                                                 T * sizeof(int64_t), cudaMemcpyHostToDevice, s),
                                 "upload labels");
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(mask_.get(), mask_host_.data(), T, cudaMemcpyHostToDevice, s),
        "upload mask");
    if (!in.ce_weights.empty()) {
      GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(weights_.get(), in.ce_weights.data(),
                                                   T * sizeof(float), cudaMemcpyHostToDevice, s),
                                   "upload CE weights");
    }
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(scalars_.get(), scalars.data(), scalars.size() * sizeof(double),
                        cudaMemcpyHostToDevice, s),
        "upload step statistics");
    return absl::OkStatus();
  }

  absl::Status Add(const float* a, const float* b, float* out, int64_t n) override {
    return AddCuda(a, b, out, n, exec_.stream);
  }

  absl::Status EmbeddingForward(int stream, const float* emb, float* h) override {
    GRADSUM_ASSIGN_OR_RETURN(const int32_t* tokens, StreamTokens(stream));
    return EmbeddingForwardCuda(emb, tokens, in_.rows, config_.dim, h, exec_.stream);
  }

  absl::Status EmbeddingBackward(int stream, const float* dh, GradTarget demb) override {
    GRADSUM_ASSIGN_OR_RETURN(const int32_t* tokens, StreamTokens(stream));
    GRADSUM_ASSIGN_OR_RETURN(float* grad, DeviceGrad(demb, "emb"));
    return EmbeddingBackwardCuda(tokens, dh, in_.rows, config_.dim, grad, exec_.stream);
  }

  absl::Status RmsNormForward(const float* x, const float* gain, float* y,
                              float* inv_rms) override {
    moe::RmsNormArgs n = Rms(x, gain, inv_rms);
    n.y = y;
    return moe::RmsNormForwardCuda(n, exec_.stream);
  }

  absl::Status RmsNormBackward(const float* x, const float* gain, const float* inv_rms,
                               const float* dy, float* dx, bool accumulate_dx,
                               GradTarget dgain) override {
    GRADSUM_ASSIGN_OR_RETURN(float* grad, DeviceGrad(dgain, "an RMSNorm gain"));
    // Backward only reads rstd (moe/cuda/layers_cuda.h).
    moe::RmsNormArgs n = Rms(x, gain, const_cast<float*>(inv_rms));
    n.dy = dy;
    n.dx = dx;
    n.accumulate_dx = accumulate_dx;
    n.dgamma = grad;
    return moe::RmsNormBackwardCuda(n, exec_.stream);
  }

  absl::Status LmHeadCrossEntropy(int stream, const float* f, const float* w_out, float* grad_f,
                                  GradTarget grad_out) override {
    GRADSUM_RETURN_IF_ERROR(CheckStream(stream));
    if (stream == 0) return HeadCrossEntropy(f, w_out, grad_f, &grad_out, MainHeadLabels());
    // A further stream: the main path's kernel on its labels, weights and normaliser; its
    // output z-loss stays in its own term, so its CE writes one value.
    const int64_t T = in_.rows;
    double* slots = scalars_.as<double>() + kScalars + 2 * (stream - 1);
    HeadLabels labels;
    labels.labels = stream_labels_.as<int64_t>() + (stream - 1) * T;
    // As the CPU ops: a stream without CE weights is in token mode.
    const bool weighted = !in_.extra_streams[stream - 1].ce_weights.empty();
    labels.weights = weighted ? stream_weights_.as<float>() + (stream - 1) * T : nullptr;
    labels.global_weight_sum = slots;
    labels.loss = slots + 1;
    return HeadCrossEntropy(f, w_out, grad_f, &grad_out, labels);
  }

  // Forward only: the same GEMM and CE kernel, with no gradient (the kernel's forward-only
  // mode) and no backward GEMMs.
  absl::Status LmHeadLoss(const float* f, const float* w_out) override {
    return HeadCrossEntropy(f, w_out, nullptr, nullptr, MainHeadLabels());
  }

  // ---- The attention block. ----

  absl::Status MatMul(const float* x, const float* w, int64_t in, int64_t out, float* y) override {
    return GemmRowMajor(ctx_->blas, exec_.stream, false, false, in_.rows, out, in, x, in, w, out,
                        DType::kF32, y, out, DType::kF32);
  }

  absl::Status MatMulBackward(const float* x, const float* w, int64_t in, int64_t out,
                              const float* dy, float* dx, bool accumulate_dx,
                              GradTarget dw) override {
    GRADSUM_ASSIGN_OR_RETURN(float* grad, DeviceGrad(dw, "a projection"));
    const int64_t T = in_.rows;
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(ctx_->blas, exec_.stream, false, true, T, in, out, dy, out,
                                         w, out, DType::kF32, dx, in, DType::kF32,
                                         accumulate_dx ? 1.0f : 0.0f));
    return GemmRowMajor(ctx_->blas, exec_.stream, true, false, in, out, T, x, in, dy, out,
                        DType::kF32, grad, out, DType::kF32, 1.0f);
  }

  absl::Status Rope(float* x, int heads, bool inverse) override {
    return RopeCuda(x, rope_cos_.as<float>(), rope_sin_.as<float>(), in_.rows, heads, head_dim_,
                    inverse, exec_.stream);
  }

  absl::Status PackHeads(const float* x, bool kv, int parts, float* send) override {
    const int64_t hd = head_dim_, Hl = config_.n_heads / parts, T = in_.rows;
    const int heads_in = kv ? config_.n_kv_heads : config_.n_heads;
    const size_t f = sizeof(float);
    const int64_t block = T * Hl * hd;
    // To destination j, per token: the heads of its query heads (for `kv`, the kv head
    // each uses), one strided copy per head slot.
    for (int j = 0; j < parts; ++j) {
      for (int64_t hl = 0; hl < Hl; ++hl) {
        const int64_t h = j * Hl + hl;
        const int64_t src_head = kv ? h / group_ : h;
        GRADSUM_CUDA_RETURN_IF_ERROR(
            cudaMemcpy2DAsync(send + j * block + hl * hd, Hl * hd * f, x + src_head * hd,
                              heads_in * hd * f, hd * f, T, cudaMemcpyDeviceToDevice, exec_.stream),
            "pack the head split");
      }
    }
    return absl::OkStatus();
  }

  absl::Status UnpackHeads(const float* recv, int parts, int64_t seq_rows, float* out) override {
    const int64_t Hl = config_.n_heads / parts, T = in_.rows, row = Hl * head_dim_;
    const int64_t block = T * row, L = seq_rows / parts;
    const size_t f = sizeof(float);
    // From source i: its slice [i L, (i + 1) L) of every sequence.
    for (int i = 0; i < parts; ++i) {
      GRADSUM_CUDA_RETURN_IF_ERROR(
          cudaMemcpy2DAsync(out + i * L * row, seq_rows * row * f, recv + i * block, L * row * f,
                            L * row * f, in_.sequences, cudaMemcpyDeviceToDevice, exec_.stream),
          "unpack the head split");
    }
    return absl::OkStatus();
  }

  absl::Status PackTokens(const float* x, int parts, int64_t seq_rows, float* send) override {
    const int64_t Hl = config_.n_heads / parts, T = in_.rows, row = Hl * head_dim_;
    const int64_t block = T * row, L = seq_rows / parts;
    const size_t f = sizeof(float);
    for (int j = 0; j < parts; ++j) {
      GRADSUM_CUDA_RETURN_IF_ERROR(
          cudaMemcpy2DAsync(send + j * block, L * row * f, x + j * L * row, seq_rows * row * f,
                            L * row * f, in_.sequences, cudaMemcpyDeviceToDevice, exec_.stream),
          "pack the token split");
    }
    return absl::OkStatus();
  }

  absl::Status UnpackTokens(const float* recv, int parts, float* out) override {
    const int64_t hd = head_dim_, Hl = config_.n_heads / parts, T = in_.rows, H = config_.n_heads;
    const int64_t row = Hl * hd, block = T * row;
    const size_t f = sizeof(float);
    for (int i = 0; i < parts; ++i) {
      GRADSUM_CUDA_RETURN_IF_ERROR(
          cudaMemcpy2DAsync(out + i * Hl * hd, H * hd * f, recv + i * block, row * f, row * f, T,
                            cudaMemcpyDeviceToDevice, exec_.stream),
          "unpack the token split");
    }
    return absl::OkStatus();
  }

  // Over the axis's NCCL device group, ordered after the compute stream (a device copy for
  // a group of one).
  absl::Status AllToAll(MeshAxis axis, const float* send, float* recv, int64_t block) override {
    const size_t bytes = static_cast<size_t>(block) * sizeof(float);
    const int n = mesh_->size(axis);
    if (n == 1) {
      GRADSUM_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDeviceToDevice, exec_.stream),
          "copy the exchange");
      return absl::OkStatus();
    }
    Communicator& group = mesh_->device_group(axis);
    if (group.device_stream() == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("CUDA ops: the device ", MeshAxisName(axis),
                                                     " group (", group.backend(), ") is not NCCL"));
    }
    cudaStream_t comm_stream = group.device_stream()->stream();
    GRADSUM_RETURN_IF_ERROR(cuda::Fence(exec_.stream, comm_stream, exec_.fence));
    std::vector<size_t> counts(n, static_cast<size_t>(block)), offsets(n);
    for (int i = 0; i < n; ++i) offsets[i] = static_cast<size_t>(i) * block;
    GRADSUM_RETURN_IF_ERROR(
        group.AllToAllV(send, counts, offsets, recv, counts, offsets, DType::kF32));
    // The compute stream reads what the NCCL stream wrote.
    return cuda::Fence(comm_stream, exec_.stream, exec_.fence);
  }

  absl::Status SumKvGroups(const float* x, float* out) override {
    return SumGroupsCuda(x, out, in_.rows, config_.n_kv_heads, group_, head_dim_, exec_.stream);
  }

  absl::Status Attention(int heads, const float* q, const float* k, const float* v, float* out,
                         float* lse) override {
    return AttentionForwardCuda(HeadDims(heads), q, k, v, doc_start_.as<int32_t>(), out, lse,
                                exec_.stream, &attention_error_);
  }

  absl::Status AttentionBackward(int heads, const float* q, const float* k, const float* v,
                                 const float* out, const float* lse, const float* d_out, float* dq,
                                 float* dk, float* dv) override {
    return AttentionBackwardCuda(HeadDims(heads), q, k, v, doc_start_.as<int32_t>(), out, lse,
                                 d_out, dq, dk, dv, exec_.stream, &attention_error_);
  }

  absl::StatusOr<MicroBatchLossTerms> End() override {
    cudaStream_t s = exec_.stream;
    const int k = extra_streams_;
    // Every MoE layer that ran: the extra blocks' too, except in an evaluation (which skips
    // them).
    const int L = in_.forward_only ? config_.layers : moe_layers_;
    const int E = config_.experts;
    // ce, z, bal, z_out (scalars 2..5), the objective (6), then per stream (D_j', loss_j).
    std::vector<double> losses_host(kScalars - 2 + 2 * k, 0.0);
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(losses_host.data(), scalars_.as<double>() + 2,
                        losses_host.size() * sizeof(double), cudaMemcpyDeviceToHost, s),
        "download loss values");
    MicroBatchLossTerms terms;
    terms.global_expert_counts.assign(L, std::vector<int64_t>(E));
    for (int l = 0; l < L; ++l) {
      GRADSUM_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(terms.global_expert_counts[l].data(), moe_kernels_->global_counts(l),
                          E * sizeof(int64_t), cudaMemcpyDeviceToHost, s),
          "download expert counts");
    }
    GRADSUM_RETURN_IF_ERROR(ctx_->stream.Synchronize());
    if (attention_error_.device_word() != nullptr) {
      GRADSUM_ASSIGN_OR_RETURN(std::optional<int64_t> bad, attention_error_.ReadAndReset(s));
      if (bad.has_value()) {
        return absl::InternalError(absl::StrCat("attention (CUDA): the device flagged doc_start[",
                                                *bad, "], which the host checked in Begin"));
      }
    }
    terms.ce = losses_host[0];
    terms.z = losses_host[1];
    terms.bal = losses_host[2];
    terms.ce_terms = {terms.ce};
    terms.z_terms = {terms.z};
    terms.bal_terms = {terms.bal};
    if (config_.ce.alpha_lse > 0.0) {
      terms.z_out = losses_host[3];
      terms.z_out_terms = {terms.z_out};
    }
    terms.extra_ce.resize(k);
    terms.extra_ce_terms.resize(k);
    for (int j = 0; j < k; ++j) {
      terms.extra_ce[j] = losses_host[kScalars - 2 + 2 * j + 1];
      terms.extra_ce_terms[j] = {terms.extra_ce[j]};
    }
    return terms;
  }

  void Abandon() override { (void)ctx_->stream.Synchronize(); }

  // The device buffers these ops hold between calls, as capacities (model/ops.h): every
  // MoE layer's routing and activations, the released sets of full recomputation, the
  // layers' shared scratch, the [T, V] logits and the micro-batch's inputs (the head split's
  // exchange buffers are the attention block's, counted by the model).
  int64_t HeldActivationBytes() const override {
    int64_t bytes = moe_kernels_->HeldBytes();
    for (const DeviceBuffer* b :
         {&tokens_, &labels_, &mask_, &weights_, &logits_, &stream_tokens_, &stream_labels_,
          &stream_weights_, &rope_cos_, &rope_sin_, &doc_start_}) {
      bytes += static_cast<int64_t>(b->size());
    }
    return bytes;
  }

 private:
  // What one LM head's CE reads and writes (device pointers): its labels, CE weights (null:
  // token mode), normaliser, and the loss slots (ce_loss / z_out_loss null: not split).
  struct HeadLabels {
    const int64_t* labels = nullptr;
    const float* weights = nullptr;
    const double* global_weight_sum = nullptr;
    double* loss = nullptr;
    double* ce_loss = nullptr;
    double* z_out_loss = nullptr;
  };

  // The main head's labels, weights, D and loss slots.
  HeadLabels MainHeadLabels() {
    double* d = scalars_.as<double>();
    HeadLabels labels;
    labels.labels = labels_.as<int64_t>();
    labels.weights = in_.ce_weights.empty() ? nullptr : weights_.as<float>();  // null: token
    labels.global_weight_sum = d;
    // The display shows the CE and the output z-loss apart (ce, z_out): with alpha_lse > 0
    // the CE term is ce_loss and the objective (their sum, not displayed) goes to its own
    // scalar; without it the CE term is the loss, as before the options.
    if (config_.ce.alpha_lse > 0.0) {
      labels.loss = d + 6;
      labels.ce_loss = d + 2;
      labels.z_out_loss = d + 5;
    } else {
      labels.loss = d + 2;
    }
    return labels;
  }

  // logits = f @ W_out, the fused CE in place with §3.2's options (as the CPU ops pass
  // them), grad_f = dlogits @ W_out^T, dW_out += f^T @ dlogits (§3). The main head and
  // every further label stream's. grad_out null: forward only (the loss; nothing else written).
  absl::Status HeadCrossEntropy(const float* f, const float* w_out, float* grad_f,
                                GradTarget* grad_out, const HeadLabels& labels) {
    float* d_out = nullptr;
    if (grad_out != nullptr) {
      GRADSUM_ASSIGN_OR_RETURN(d_out, DeviceGrad(*grad_out, "out"));
    }
    const int64_t T = in_.rows, D = config_.dim, V = config_.vocab;
    cudaStream_t s = exec_.stream;
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(ctx_->blas, s, false, false, T, V, D, f, D, w_out, V,
                                         DType::kF32, logits_.get(), V, DType::kF32));
    losses::CrossEntropyCudaArgs ce;
    ce.logits = logits_.get();
    ce.dtype = DType::kF32;
    ce.rows = T;
    ce.vocab = V;
    ce.labels = labels.labels;
    ce.token_weights = labels.weights;
    ce.global_weight_sum = labels.global_weight_sum;
    ce.grad_logits = grad_out != nullptr ? logits_.get() : nullptr;
    ce.ignore_index = data::kIgnoreIndex;
    ce.ce = config_.ce;
    ce.loss = labels.loss;
    ce.ce_loss = labels.ce_loss;
    ce.z_out_loss = labels.z_out_loss;
    GRADSUM_RETURN_IF_ERROR(losses::CrossEntropyCuda(ce, s));  // checks labels (a host sync)
    if (grad_out == nullptr) return absl::OkStatus();
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(ctx_->blas, s, false, true, T, D, V, logits_.get(), V,
                                         w_out, V, DType::kF32, grad_f, D, DType::kF32));
    return GemmRowMajor(ctx_->blas, s, true, false, D, V, T, f, D, logits_.get(), V, DType::kF32,
                        d_out, V, DType::kF32, 1.0f);
  }

  absl::Status CheckStream(int stream) const { return CheckStreamIndex(in_, stream); }

  // Label stream `stream`'s input tokens on the device.
  absl::StatusOr<const int32_t*> StreamTokens(int stream) const {
    GRADSUM_RETURN_IF_ERROR(CheckStream(stream));
    return stream == 0 ? tokens_.as<int32_t>()
                       : stream_tokens_.as<int32_t>() + (stream - 1) * in_.rows;
  }

  // `heads` query heads over whole sequences (as the CPU ops), each with its own key/value
  // head.
  AttentionDims HeadDims(int heads) const {
    AttentionDims d;
    d.num_seqs = in_.sequences;
    d.seq_len = in_.seq_len;
    d.q_heads = heads;
    d.kv_heads = heads;
    d.head_dim = head_dim_;
    return d;
  }

  moe::RmsNormArgs Rms(const float* x, const float* gain, float* inv_rms) const {
    moe::RmsNormArgs n;
    n.dtype = DType::kF32;
    n.rows = in_.rows;
    n.width = config_.dim;
    n.eps = kRmsNormEps;
    n.x = x;
    n.gamma = gain;
    n.rstd = inv_rms;
    return n;
  }

  MoeLmConfig config_;
  std::shared_ptr<cuda::ComputeContext> ctx_;
  const Mesh* mesh_;  // not owned: its device view's groups (NCCL) and host EP group
  moe::CudaExec exec_;
  // The MoE layers' compute (their order: MoeBlockOps).
  std::unique_ptr<moe::MoeLayersCuda> moe_kernels_;
  // The micro-batch's inputs on the device, sized for rows_ tokens.
  MicroBatchInputs in_;
  int64_t rows_ = -1;
  std::vector<int64_t> labels_host_;
  std::vector<uint8_t> mask_host_;
  DeviceBuffer tokens_, labels_, mask_, weights_;
  // The k extra label streams: stream j's tokens, labels and CE weights at rows
  // [(j - 1) T, j T).
  int extra_streams_ = 0;  // MoeLmSpec::label_streams() - 1
  int moe_layers_ = 0;     // MoeLmSpec::moe_layers()
  DeviceBuffer stream_tokens_, stream_labels_, stream_weights_;
  std::vector<int32_t> stream_tokens_host_;
  std::vector<int64_t> stream_labels_host_;
  std::vector<float> stream_weights_host_;
  // D, N, ce, z, bal, z_out, and the LM head's objective ce + z_out with alpha_lse > 0
  // (f64; z_out and the objective are written only then); then, per extra label stream j,
  // its normaliser at kScalars + 2 (j - 1) and its loss term after it.
  static constexpr int kScalars = 7;
  DeviceBuffer scalars_;
  DeviceBuffer logits_;  // [T, V], its CE gradient in place
  // Attention: the head layout, the RoPE tables and document starts of the micro-batch.
  int64_t head_dim_ = 0;
  int group_ = 1;
  std::vector<float> cos_host_, sin_host_;
  DeviceBuffer rope_cos_, rope_sin_, doc_start_;
  cuda::DeviceIndexFlag attention_error_;  // the attention kernels' doc_start check
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelOps>> MakeCudaOps(const MoeLmSpec& spec,
                                                      std::shared_ptr<cuda::ComputeContext> context,
                                                      const Mesh& mesh) {
  // The CE options of SEMANTICS.md §3.2 run in the CUDA CE kernel (losses/cuda), and the
  // aux-loss-free balancing of §5.1 (the expert bias, sigmoid scores) in the CUDA router
  // (moe/cuda/router_cuda.h): nothing of the config is refused here.
  if (context == nullptr || !mesh.has_device_view() ||
      mesh.device_group(MeshAxis::kWorld).device_stream() == nullptr) {
    return absl::InvalidArgumentError(
        "CUDA ops need a compute context and a mesh with an NCCL device view "
        "(Mesh::AttachDeviceView)");
  }
  if (spec.config().experts % mesh.ep_size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model.experts=", spec.config().experts,
                                                   " is not divisible by ep=", mesh.ep_size(),
                                                   " (SEMANTICS.md §7)"));
  }
  return std::unique_ptr<ModelOps>(new CudaOps(spec, std::move(context), mesh));
}

}  // namespace gradsum::model
