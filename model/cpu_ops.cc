#include "model/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/gemm.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "losses/cross_entropy.h"
#include "losses/linear_cross_entropy.h"
#include "model/attention.h"
#include "model/layers.h"
#include "model/moe_block_ops.h"
#include "moe/moe_layer.h"

namespace gradsum::model {
namespace {

class HostArray : public DeviceArray {
 public:
  explicit HostArray(int64_t numel) : storage_(numel) {
    data_ = storage_.data();
    size_ = numel;
  }

 private:
  std::vector<float> storage_;
};

// One CE call's display values over D (SEMANTICS.md §3.2): with `split` the CE alone
// (local_weighted_ce_sum / D) and the output z-loss (alpha_lse local_weighted_lse_sq_sum / D),
// both 0 when D is 0; without, the call's whole local loss and 0.
struct CeDisplay {
  double ce = 0, z_out = 0;
};
CeDisplay SplitCeDisplay(const losses::CrossEntropyResult& r, double d, double alpha_lse,
                         bool split) {
  if (!split) return {r.local_loss, 0.0};
  if (!(d > 0.0)) return {0.0, 0.0};
  return {r.local_weighted_ce_sum / d, alpha_lse * r.local_weighted_lse_sq_sum / d};
}

// Adds blocks [b * n, (b + 1) * n) of `blocks` (each one row block's contribution) to the
// sink's elements [0, n), in block order, split into element ranges over the threads
// (disjoint ranges may be added concurrently, core/grad_sink.h).
absl::Status AddBlocksExact(ExactGradSink& sink, absl::Span<const float> blocks, int64_t n) {
  const int64_t num_blocks = n == 0 ? 0 : static_cast<int64_t>(blocks.size()) / n;
  constexpr int64_t kMinRange = 4096;
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(ComputeThreads(), n / kMinRange));
  return ParallelForStatus(ComputeThreads(), ranges, [&](int64_t r) -> absl::Status {
    const int64_t begin = n * r / ranges, end = n * (r + 1) / ranges;
    for (int64_t b = 0; b < num_blocks; ++b) {
      GRADSUM_RETURN_IF_ERROR(sink.Add(begin, blocks.subspan(b * n + begin, end - begin)));
    }
    return absl::OkStatus();
  });
}

// A weight gradient of n values summed over the row blocks of T rows. compute(q, r0, rows,
// out) ADDS block q's (rows [r0, r0 + rows)) contribution into out[0, n). One block and an
// fp32 target: straight into the target. Otherwise each block into its own zeroed scratch
// (blocks run in parallel), then added to the target: exactly, or in block order.
template <typename Fn>
absl::Status AccumulateRowBlocks(const GradTarget& target, int64_t T, int64_t row_block, int64_t n,
                                 Fn compute) {
  if (row_block <= 0 && target.accumulate() != nullptr) {
    return compute(0, 0, T, target.accumulate());
  }
  const int64_t rows = row_block > 0 ? row_block : T;
  const int64_t blocks = rows == 0 ? 0 : T / rows;
  std::vector<float> scratch(blocks * n, 0.0f);
  GRADSUM_RETURN_IF_ERROR(ParallelForStatus(ComputeThreads(), blocks, [&](int64_t q) {
    return compute(q, q * rows, rows, scratch.data() + q * n);
  }));
  if (target.exact() != nullptr) return AddBlocksExact(*target.exact(), scratch, n);
  float* acc = target.accumulate();
  for (int64_t q = 0; q < blocks; ++q) {
    for (int64_t i = 0; i < n; ++i) acc[i] += scratch[q * n + i];
  }
  return absl::OkStatus();
}

class CpuOps : public MoeBlockOps {
 public:
  CpuOps(const MoeLmSpec& spec, const Mesh& mesh, const CpuOpsOptions& options)
      : config_(spec.config()),
        mesh_(&mesh),
        num_threads_(options.num_threads),
        moe_kernels_(mesh.ep_group(), mesh.world(), MoeLayerConfigOf(config_),
                     {.alpha_z = config_.alpha_z, .alpha_b = config_.alpha_b}, spec.moe_layers()) {
    const MoeLmConfig& m = config_;
    InitMoeBlock(&moe_kernels_, spec);
    extra_streams_ = spec.label_streams() - 1;
    const HeadLayout heads = HeadLayoutOf(m, /*sp=*/1);
    head_dim_ = heads.head_dim;
    group_ = heads.group;
  }

  absl::StatusOr<std::unique_ptr<DeviceArray>> Allocate(int64_t numel) override {
    return std::unique_ptr<DeviceArray>(new HostArray(numel));
  }

  absl::Status Begin(const MicroBatchInputs& in) override {
    if (in.row_block < 0 || (in.row_block > 0 && in.rows % in.row_block != 0)) {
      return absl::InvalidArgumentError(absl::StrCat("row_block ", in.row_block,
                                                     " does not divide the ", in.rows,
                                                     " rows of the micro-batch"));
    }
    in_ = in;
    if (config_.attention) GRADSUM_RETURN_IF_ERROR(BeginAttention());
    labels_.assign(in.labels.begin(), in.labels.end());
    const int k = in.forward_only ? 0 : extra_streams_;
    GRADSUM_RETURN_IF_ERROR(CheckStreamInputs(in, k));
    stream_labels_.resize(k);
    for (int j = 0; j < k; ++j) {
      stream_labels_[j].assign(in.extra_streams[j].labels.begin(),
                               in.extra_streams[j].labels.end());
    }
    moe_kernels_.BeginMicroBatch({.rows = in.rows,
                                  .row_block = in.row_block,
                                  .mask = in.mask,
                                  .global_routed_tokens = in.global_routed_tokens,
                                  .num_micro_batches = in.num_micro_batches});
    moe_block().BeginMicroBatch();
    terms_ = MicroBatchLossTerms();
    terms_.extra_ce.assign(k, 0.0);
    terms_.extra_ce_terms.assign(k, {});
    return absl::OkStatus();
  }

  absl::Status Add(const float* a, const float* b, float* out, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    return absl::OkStatus();
  }

  absl::Status EmbeddingForward(int stream, const float* emb, float* h) override {
    GRADSUM_ASSIGN_OR_RETURN(const absl::Span<const int32_t> tokens, StreamTokens(stream));
    return Embed(tokens, emb, h);
  }

  absl::Status EmbeddingBackward(int stream, const float* dh, GradTarget demb) override {
    GRADSUM_ASSIGN_OR_RETURN(const absl::Span<const int32_t> tokens, StreamTokens(stream));
    return EmbedBackward(tokens, dh, std::move(demb));
  }

  // Label stream `stream`'s input tokens (InvalidArgument for a stream the micro-batch has not).
  absl::StatusOr<absl::Span<const int32_t>> StreamTokens(int stream) const {
    GRADSUM_RETURN_IF_ERROR(CheckStream(stream));
    return stream == 0 ? in_.tokens : in_.extra_streams[stream - 1].tokens;
  }

  absl::Status CheckStream(int stream) const { return CheckStreamIndex(in_, stream); }

  absl::Status Embed(absl::Span<const int32_t> tokens, const float* emb, float* h) {
    const int64_t D = config_.dim;
    model::EmbeddingForward(absl::MakeConstSpan(emb, config_.vocab * D), tokens, D,
                            absl::MakeSpan(h, in_.rows * D));
    return absl::OkStatus();
  }

  absl::Status EmbedBackward(absl::Span<const int32_t> tokens, const float* dh, GradTarget demb) {
    const int64_t D = config_.dim, V = config_.vocab, T = in_.rows;
    if (demb.exact() == nullptr && in_.row_block <= 0) {
      model::EmbeddingBackward(tokens, absl::MakeConstSpan(dh, T * D), D,
                               absl::MakeSpan(demb.accumulate(), V * D));
      return absl::OkStatus();
    }
    // Per row block: each token's rows summed in token order, then handed over row by row
    // (only the vocabulary rows the block touched).
    const int64_t S = in_.row_block > 0 ? in_.row_block : T;
    std::vector<float> rows(V * D);
    std::vector<uint8_t> seen(V);
    for (int64_t q = 0; q * S < T; ++q) {
      std::fill(seen.begin(), seen.end(), 0);
      for (int64_t t = q * S; t < (q + 1) * S; ++t) {
        const int32_t v = tokens[t];
        float* row = rows.data() + static_cast<int64_t>(v) * D;
        if (!seen[v]) std::fill(row, row + D, 0.0f);
        seen[v] = 1;
        for (int64_t i = 0; i < D; ++i) row[i] += dh[t * D + i];
      }
      for (int64_t v = 0; v < V; ++v) {
        if (!seen[v]) continue;
        const auto row = absl::MakeConstSpan(rows).subspan(v * D, D);
        if (demb.exact() != nullptr) {
          GRADSUM_RETURN_IF_ERROR(demb.exact()->Add(v * D, row));
        } else {
          float* acc = demb.accumulate() + v * D;
          for (int64_t i = 0; i < D; ++i) acc[i] += row[i];
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status RmsNormForward(const float* x, const float* gain, float* y,
                              float* inv_rms) override {
    const int64_t D = config_.dim, T = in_.rows;
    model::RmsNormForward(absl::MakeConstSpan(x, T * D), absl::MakeConstSpan(gain, D), T, D,
                          absl::MakeSpan(y, T * D), absl::MakeSpan(inv_rms, T));
    return absl::OkStatus();
  }

  absl::Status RmsNormBackward(const float* x, const float* gain, const float* inv_rms,
                               const float* dy, float* dx, bool accumulate_dx,
                               GradTarget dgain) override {
    const int64_t D = config_.dim, T = in_.rows;
    if (!accumulate_dx) std::fill(dx, dx + T * D, 0.0f);
    return AccumulateRowBlocks(
        dgain, T, in_.row_block, D,
        [&](int64_t, int64_t r0, int64_t rows, float* out) -> absl::Status {
          model::RmsNormBackward(
              absl::MakeConstSpan(x + r0 * D, rows * D), absl::MakeConstSpan(gain, D),
              absl::MakeConstSpan(inv_rms + r0, rows), absl::MakeConstSpan(dy + r0 * D, rows * D),
              rows, D, absl::MakeSpan(dx + r0 * D, rows * D), absl::MakeSpan(out, D));
          return absl::OkStatus();
        });
  }

  absl::Status LmHeadCrossEntropy(int stream, const float* f, const float* w_out, float* grad_f,
                                  GradTarget grad_out) override {
    GRADSUM_RETURN_IF_ERROR(CheckStream(stream));
    if (stream == 0) {
      return HeadCrossEntropy(f, w_out, grad_f, std::move(grad_out), labels_, in_.ce_weights,
                              in_.global_ce_weight_sum, &terms_.ce, &terms_.ce_terms, &terms_.z_out,
                              &terms_.z_out_terms);
    }
    // A further stream's output z-loss stays in its own term (its head's whole objective).
    const MicroBatchInputs::Stream& s = in_.extra_streams[stream - 1];
    return HeadCrossEntropy(f, w_out, grad_f, std::move(grad_out), stream_labels_[stream - 1],
                            s.ce_weights, s.ce_normaliser, &terms_.extra_ce[stream - 1],
                            &terms_.extra_ce_terms[stream - 1], /*z_out=*/nullptr,
                            /*z_out_blocks=*/nullptr);
  }

  // Forward only: logits = f @ w_out a block of rows at a time (a row block with row blocks,
  // single-threaded as HeadCrossEntropy's; else 256 rows, the rank's threads), the CE with
  // §3.2's options, `ce` and (alpha_lse > 0) `z_out` into the terms as HeadCrossEntropy adds
  // them.
  absl::Status LmHeadLoss(const float* f, const float* w_out) override {
    const int64_t D = config_.dim, V = config_.vocab, T = in_.rows;
    const int64_t block = in_.row_block > 0 ? in_.row_block : std::min<int64_t>(T, 256);
    const int threads = in_.row_block > 0 ? 1 : num_threads_;
    losses::CrossEntropyOptions options;
    options.num_threads = threads;
    options.ce = config_.ce;
    const double d = in_.global_ce_weight_sum, alpha_lse = config_.ce.alpha_lse;
    std::vector<float> logits(block * V);
    for (int64_t r0 = 0; r0 < T; r0 += block) {
      const int64_t rows = std::min(block, T - r0);
      GRADSUM_RETURN_IF_ERROR(Sgemm(Trans::kNo, Trans::kNo, rows, V, D, 1.0f,
                                    absl::MakeConstSpan(f + r0 * D, rows * D), D,
                                    absl::MakeConstSpan(w_out, D * V), V, 0.0f,
                                    absl::MakeSpan(logits.data(), rows * V), V, threads));
      GRADSUM_ASSIGN_OR_RETURN(TensorView view,
                               TensorView::Create(logits.data(), DType::kF32, {rows, V}));
      const absl::Span<const float> weights =
          in_.ce_weights.empty() ? in_.ce_weights : in_.ce_weights.subspan(r0, rows);
      GRADSUM_ASSIGN_OR_RETURN(
          losses::CrossEntropyResult ce,
          losses::CrossEntropyForward(view, absl::MakeConstSpan(labels_).subspan(r0, rows), weights,
                                      d, options));
      const CeDisplay shown = SplitCeDisplay(ce, d, alpha_lse, alpha_lse > 0.0);
      if (alpha_lse > 0.0) {
        terms_.z_out += shown.z_out;
        if (in_.row_block > 0) terms_.z_out_terms.push_back(shown.z_out);
      }
      terms_.ce += shown.ce;
      if (in_.row_block > 0) terms_.ce_terms.push_back(shown.ce);
    }
    return absl::OkStatus();
  }

  // The fused LM head + CE of `labels` with weights `ce_weights` (empty: token mode) over the
  // normaliser `d`: the local component added into *value, and with row blocks each
  // block's value into *block_values. With alpha_lse > 0 and `z_out` non-null the output
  // z-loss goes apart into *z_out (and *z_out_blocks), *value keeping only the CE; with
  // `z_out` null *value holds both.
  absl::Status HeadCrossEntropy(const float* f, const float* w_out, float* grad_f,
                                GradTarget grad_out, absl::Span<const int64_t> labels,
                                absl::Span<const float> ce_weights, double d, double* value,
                                std::vector<double>* block_values, double* z_out,
                                std::vector<double>* z_out_blocks) {
    const int64_t D = config_.dim, V = config_.vocab, T = in_.rows;
    GRADSUM_ASSIGN_OR_RETURN(TensorView head_view,
                             TensorView::Create(const_cast<float*>(w_out), DType::kF32, {D, V}));
    losses::LinearCrossEntropyOptions ce_options;
    // One block: the rank's threads over its chunks. Row blocks: one block per call,
    // single-threaded and in one chunk, so a block's GEMMs are the same at every mesh;
    // the blocks run in parallel.
    ce_options.num_threads = in_.row_block > 0 ? 1 : num_threads_;
    if (in_.row_block > 0) ce_options.chunk_rows = in_.row_block;
    // §3.2: the loss term is the CE with these options plus the output z-loss; local_loss
    // holds both. The display shows them apart: `ce` the CE (local_weighted_ce_sum / D),
    // `z_out` the z-loss (alpha_lse local_weighted_lse_sq_sum / D). With alpha_lse = 0
    // `ce` is local_loss itself, as before the options.
    ce_options.ce = config_.ce;
    const int64_t blocks = in_.row_block > 0 ? T / in_.row_block : 1;
    const double alpha_lse = config_.ce.alpha_lse;
    const bool split_z_out = alpha_lse > 0.0 && z_out != nullptr;
    std::vector<double> block_ce(blocks, 0.0), block_z_out(split_z_out ? blocks : 0, 0.0);
    std::vector<int64_t> block_scratch(blocks, 0);
    GRADSUM_RETURN_IF_ERROR(AccumulateRowBlocks(
        grad_out, T, in_.row_block, D * V,
        [&](int64_t q, int64_t r0, int64_t rows, float* out) -> absl::Status {
          GRADSUM_ASSIGN_OR_RETURN(
              TensorView f_view,
              TensorView::Create(const_cast<float*>(f) + r0 * D, DType::kF32, {rows, D}));
          GRADSUM_ASSIGN_OR_RETURN(TensorView grad_f_view,
                                   TensorView::Create(grad_f + r0 * D, DType::kF32, {rows, D}));
          GRADSUM_ASSIGN_OR_RETURN(TensorView grad_head_view,
                                   TensorView::Create(out, DType::kF32, {D, V}));
          const absl::Span<const float> weights =
              ce_weights.empty() ? ce_weights : ce_weights.subspan(r0, rows);
          GRADSUM_ASSIGN_OR_RETURN(losses::LinearCrossEntropyResult ce,
                                   losses::LinearCrossEntropyForwardBackward(
                                       f_view, head_view, labels.subspan(r0, rows), weights, d,
                                       grad_f_view, grad_head_view, ce_options));
          const CeDisplay shown = SplitCeDisplay(ce.ce, d, alpha_lse, split_z_out);
          block_ce[q] = shown.ce;
          block_scratch[q] = ce.peak_scratch_bytes;
          if (split_z_out) block_z_out[q] = shown.z_out;
          return absl::OkStatus();
        }));
    for (double v : block_ce) *value += v;
    for (double v : block_z_out) *z_out += v;
    // At most ComputeThreads() blocks run at once (AccumulateRowBlocks' ParallelForStatus),
    // each holding its own chunk while it runs.
    const int64_t at_once = std::min<int64_t>(blocks, std::max(1, ComputeThreads()));
    const int64_t largest =
        block_scratch.empty() ? 0 : *std::max_element(block_scratch.begin(), block_scratch.end());
    peak_head_scratch_bytes_ = std::max(peak_head_scratch_bytes_, at_once * largest);
    if (in_.row_block > 0) {
      *block_values = std::move(block_ce);
      if (split_z_out) *z_out_blocks = std::move(block_z_out);
    }
    return absl::OkStatus();
  }

  // ---- The attention block. ----

  absl::Status MatMul(const float* x, const float* w, int64_t in, int64_t out, float* y) override {
    const int64_t T = in_.rows;
    return ForEachRowBlock(
        [&](int64_t r0, int64_t rows, int threads) {
          return Sgemm(Trans::kNo, Trans::kNo, rows, out, in, 1.0f,
                       absl::MakeConstSpan(x + r0 * in, rows * in), in,
                       absl::MakeConstSpan(w, in * out), out, 0.0f,
                       absl::MakeSpan(y + r0 * out, rows * out), out, threads);
        },
        T);
  }

  absl::Status MatMulBackward(const float* x, const float* w, int64_t in, int64_t out,
                              const float* dy, float* dx, bool accumulate_dx,
                              GradTarget dw) override {
    const int64_t T = in_.rows;
    GRADSUM_RETURN_IF_ERROR(ForEachRowBlock(
        [&](int64_t r0, int64_t rows, int threads) {
          return Sgemm(Trans::kNo, Trans::kYes, rows, in, out, 1.0f,
                       absl::MakeConstSpan(dy + r0 * out, rows * out), out,
                       absl::MakeConstSpan(w, in * out), out, accumulate_dx ? 1.0f : 0.0f,
                       absl::MakeSpan(dx + r0 * in, rows * in), in, threads);
        },
        T));
    const int threads = in_.row_block > 0 ? 1 : ComputeThreads();
    return AccumulateRowBlocks(dw, T, in_.row_block, in * out,
                               [&](int64_t, int64_t r0, int64_t rows, float* acc) -> absl::Status {
                                 return Sgemm(Trans::kYes, Trans::kNo, in, out, rows, 1.0f,
                                              absl::MakeConstSpan(x + r0 * in, rows * in), in,
                                              absl::MakeConstSpan(dy + r0 * out, rows * out), out,
                                              1.0f, absl::MakeSpan(acc, in * out), out, threads);
                               });
  }

  absl::Status Rope(float* x, int heads, bool inverse) override {
    const int64_t half = head_dim_ / 2, T = in_.rows;
    const float sign = inverse ? -1.0f : 1.0f;
    return ParallelForStatus(ComputeThreads(), T, [&](int64_t t) {
      const float* c = rope_cos_.data() + t * half;
      const float* sn = rope_sin_.data() + t * half;
      for (int h = 0; h < heads; ++h) {
        float* v = x + (t * heads + h) * head_dim_;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half], s = sign * sn[i];
          v[i] = a * c[i] - b * s;
          v[i + half] = b * c[i] + a * s;
        }
      }
      return absl::OkStatus();
    });
  }

  absl::Status PackHeads(const float* x, bool kv, int parts, float* send) override {
    const int64_t hd = head_dim_, Hl = config_.n_heads / parts, T = in_.rows;
    const int heads_in = kv ? config_.n_kv_heads : config_.n_heads;
    // For destination rank j, head slot hl: the input head it carries.
    auto source_head = [&](int j, int64_t hl) {
      const int64_t h = j * Hl + hl;  // the destination's query head
      return kv ? static_cast<int>(h / group_) : static_cast<int>(h);
    };
    const int64_t block = T * Hl * hd;  // floats per (source, destination) pair
    for (int j = 0; j < parts; ++j) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t hl = 0; hl < Hl; ++hl) {
          const float* src = x + (t * heads_in + source_head(j, hl)) * hd;
          std::copy(src, src + hd, send + j * block + (t * Hl + hl) * hd);
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status UnpackHeads(const float* recv, int parts, int64_t seq_rows, float* out) override {
    const int64_t Hl = config_.n_heads / parts, T = in_.rows, row = Hl * head_dim_;
    const int64_t block = T * row, L = seq_rows / parts;
    // From source i: its slice [i L, (i + 1) L) of every sequence.
    for (int i = 0; i < parts; ++i) {
      for (int64_t n = 0; n < in_.sequences; ++n) {
        const float* src = recv + i * block + n * L * row;
        std::copy(src, src + L * row, out + (n * seq_rows + i * L) * row);
      }
    }
    return absl::OkStatus();
  }

  absl::Status PackTokens(const float* x, int parts, int64_t seq_rows, float* send) override {
    const int64_t Hl = config_.n_heads / parts, T = in_.rows, row = Hl * head_dim_;
    const int64_t block = T * row, L = seq_rows / parts;
    // To destination j: its slice of every sequence, this rank's heads.
    for (int j = 0; j < parts; ++j) {
      for (int64_t n = 0; n < in_.sequences; ++n) {
        const float* src = x + (n * seq_rows + j * L) * row;
        std::copy(src, src + L * row, send + j * block + n * L * row);
      }
    }
    return absl::OkStatus();
  }

  absl::Status UnpackTokens(const float* recv, int parts, float* out) override {
    const int64_t hd = head_dim_, Hl = config_.n_heads / parts, T = in_.rows, H = config_.n_heads;
    const int64_t row = Hl * hd, block = T * row;
    for (int i = 0; i < parts; ++i) {
      for (int64_t t = 0; t < T; ++t) {
        const float* src = recv + i * block + t * row;
        std::copy(src, src + row, out + (t * H + i * Hl) * hd);
      }
    }
    return absl::OkStatus();
  }

  absl::Status AllToAll(MeshAxis axis, const float* send, float* recv, int64_t block) override {
    const int n = mesh_->size(axis);
    if (n == 1) {
      std::copy(send, send + block, recv);
      return absl::OkStatus();
    }
    std::vector<size_t> counts(n, static_cast<size_t>(block)), offsets(n);
    for (int i = 0; i < n; ++i) offsets[i] = static_cast<size_t>(i * block);
    return mesh_->group(axis).AllToAllV(send, counts, offsets, recv, counts, offsets, DType::kF32);
  }

  bool HostMemory() const override { return true; }

  absl::Status SumKvGroups(const float* x, float* out) override {
    const int64_t hd = head_dim_, T = in_.rows, H = config_.n_heads, Hk = config_.n_kv_heads;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < Hk; ++j) {
        float* o = out + (t * Hk + j) * hd;
        const float* first = x + (t * H + j * group_) * hd;
        std::copy(first, first + hd, o);
        for (int g = 1; g < group_; ++g) {
          const float* src = first + g * hd;
          for (int64_t i = 0; i < hd; ++i) o[i] += src[i];
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Attention(int heads, const float* q, const float* k, const float* v, float* out,
                         float* lse) override {
    const AttentionDims dims = HeadDims(heads);
    const int64_t n = HeadRows() * heads * head_dim_;
    return AttentionForward(dims, absl::MakeConstSpan(q, n), absl::MakeConstSpan(k, n),
                            absl::MakeConstSpan(v, n), in_.doc_start, absl::MakeSpan(out, n),
                            absl::MakeSpan(lse, HeadRows() * heads));
  }

  absl::Status AttentionBackward(int heads, const float* q, const float* k, const float* v,
                                 const float* out, const float* lse, const float* d_out, float* dq,
                                 float* dk, float* dv) override {
    const AttentionDims dims = HeadDims(heads);
    const int64_t n = HeadRows() * heads * head_dim_;
    return model::AttentionBackward(
        dims, absl::MakeConstSpan(q, n), absl::MakeConstSpan(k, n), absl::MakeConstSpan(v, n),
        in_.doc_start, absl::MakeConstSpan(out, n), absl::MakeConstSpan(lse, HeadRows() * heads),
        absl::MakeConstSpan(d_out, n), absl::MakeSpan(dq, n), absl::MakeSpan(dk, n),
        absl::MakeSpan(dv, n));
  }

  absl::StatusOr<MicroBatchLossTerms> End() override {
    moe::MoeLossTerms moe = moe_kernels_.TakeLossTerms();
    terms_.z = moe.z;
    terms_.bal = moe.bal;
    terms_.z_terms = std::move(moe.z_terms);
    terms_.bal_terms = std::move(moe.bal_terms);
    terms_.global_expert_counts = std::move(moe.global_expert_counts);
    if (in_.row_block <= 0) {
      terms_.ce_terms = {terms_.ce};
      terms_.z_terms = {terms_.z};
      terms_.bal_terms = {terms_.bal};
      for (size_t j = 0; j < terms_.extra_ce.size(); ++j) {
        terms_.extra_ce_terms[j] = {terms_.extra_ce[j]};
      }
      if (config_.ce.alpha_lse > 0.0) terms_.z_out_terms = {terms_.z_out};
    }
    return std::move(terms_);
  }

  void Abandon() override { moe_kernels_.Abandon(); }

 private:
  // Attention: the inputs' sizes and the RoPE tables of the micro-batch (how the tokens lie
  // in the sequences is the attention block's to check, model/parallel_attention.h).
  absl::Status BeginAttention() {
    if (static_cast<int64_t>(in_.positions.size()) != in_.rows ||
        static_cast<int64_t>(in_.doc_start.size()) != in_.sequences * in_.seq_len) {
      return absl::InvalidArgumentError("attention: positions or document starts missing");
    }
    RopeTable(in_.positions, head_dim_, config_.rope_theta, &rope_cos_, &rope_sin_);
    return absl::OkStatus();
  }

  // Rows of the whole sequences that attention runs over.
  int64_t HeadRows() const { return in_.sequences * in_.seq_len; }

  // `heads` query heads over the whole sequences, each with its own key/value head.
  AttentionDims HeadDims(int heads) const {
    AttentionDims d;
    d.num_seqs = in_.sequences;
    d.seq_len = in_.seq_len;
    d.q_heads = heads;
    d.kv_heads = heads;
    d.head_dim = head_dim_;
    return d;
  }

  // Runs fn(first_row, rows, gemm_threads) over the row blocks (one block of all T rows
  // when row_block is 0, with the rank's threads; else the blocks in parallel, one thread
  // each).
  template <typename Fn>
  absl::Status ForEachRowBlock(Fn fn, int64_t T) {
    if (in_.row_block <= 0) return fn(0, T, ComputeThreads());
    return ParallelForStatus(ComputeThreads(), T / in_.row_block,
                             [&](int64_t b) { return fn(b * in_.row_block, in_.row_block, 1); });
  }

  int64_t HeldActivationBytes() const override {
    int64_t bytes = moe_kernels_.HeldBytes();
    auto add = [&bytes](const auto& v) {
      bytes += static_cast<int64_t>(v.capacity() * sizeof(v[0]));
    };
    add(rope_cos_), add(rope_sin_);
    return bytes;
  }

  int64_t TakePeakHeadScratchBytes() override {
    return std::exchange(peak_head_scratch_bytes_, int64_t{0});
  }

  MoeLmConfig config_;
  const Mesh* mesh_;  // not owned
  int num_threads_ = 1;
  // The MoE layers' compute (their order: MoeBlockOps).
  moe::MoeLayersCpu moe_kernels_;
  int extra_streams_ = 0;  // MoeLmSpec::label_streams() - 1
  // The micro-batch.
  MicroBatchInputs in_;
  std::vector<int64_t> labels_;
  std::vector<std::vector<int64_t>> stream_labels_;  // the extra streams' labels, widened
  MicroBatchLossTerms terms_;
  // Attention: the head layout and the micro-batch's RoPE tables [T, head_dim / 2].
  int64_t head_dim_ = 0;
  int group_ = 1;  // query heads per kv head
  std::vector<float> rope_cos_, rope_sin_;
  int64_t peak_head_scratch_bytes_ = 0;  // TakePeakHeadScratchBytes
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelOps>> MakeCpuOps(const MoeLmSpec& spec, const Mesh& mesh,
                                                     const CpuOpsOptions& options) {
  const int P = mesh.ep_size();
  if (spec.config().experts % P != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model.experts=", spec.config().experts,
                                                   " is not divisible by ep=", P,
                                                   " (SEMANTICS.md §7)"));
  }
  return std::unique_ptr<ModelOps>(new CpuOps(spec, mesh, options));
}

}  // namespace gradsum::model
