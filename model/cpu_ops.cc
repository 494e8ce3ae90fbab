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
#include "losses/router_losses.h"
#include "losses/step_stats.h"
#include "model/attention.h"
#include "model/layers.h"
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

class CpuOps : public ModelOps {
 public:
  CpuOps(const MoeLmSpec& spec, const Mesh& mesh, const CpuOpsOptions& options)
      : config_(spec.config()),
        mesh_(&mesh),
        cp_schedule_(options.cp_schedule),
        num_threads_(options.num_threads) {
    const MoeLmConfig& m = config_;
    SetMoeLayerShape(m, &layer_config_);
    layer_config_.score =
        m.router_sigmoid ? moe::RouterScore::kSigmoid : moe::RouterScore::kSoftmax;
    local_experts_ = m.experts / mesh.ep_size();
    moe_layers_ = spec.moe_layers();
    extra_streams_ = spec.label_streams() - 1;
    layer_state_.resize(moe_layers_);
    for (moe::MoeLayerState& s : layer_state_) s.scratch = &dispatch_scratch_;
    held_.assign(moe_layers_, false);
    sp_size_ = mesh.size(MeshAxis::kSp);
    sp_rank_ = mesh.rank(MeshAxis::kSp);
    cp_size_ = mesh.size(MeshAxis::kCp);
    const HeadLayout heads = HeadLayoutOf(m, sp_size_);
    head_dim_ = heads.head_dim;
    heads_local_ = heads.heads_local;
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
    mask_.assign(in.mask.begin(), in.mask.end());
    labels_.assign(in.labels.begin(), in.labels.end());
    layer_config_.row_block = in.row_block;
    const int k = in.forward_only ? 0 : extra_streams_;
    GRADSUM_RETURN_IF_ERROR(CheckStreamInputs(in, k));
    stream_labels_.resize(k);
    for (int j = 0; j < k; ++j) {
      stream_labels_[j].assign(in.extra_streams[j].labels.begin(),
                               in.extra_streams[j].labels.end());
    }
    counts_.clear();
    counts_.reserve(moe_layers_);
    global_counts_.assign(moe_layers_, {});
    terms_ = MicroBatchLossTerms();
    terms_.extra_ce.assign(k, 0.0);
    terms_.extra_ce_terms.assign(k, {});
    return absl::OkStatus();
  }

  // Gives layer l a dispatch state from the spare pool when it holds none (the pool is
  // empty unless layers released theirs: then the layer's own, empty one grows).
  void BorrowDispatch(int l) {
    if (held_[l]) return;
    if (!spare_dispatch_.empty()) {
      layer_state_[l].dispatch = std::move(spare_dispatch_.back());
      spare_dispatch_.pop_back();
    }
    held_[l] = true;
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

  absl::Status CheckStream(int stream) const {
    if (stream < 0 || stream > static_cast<int>(in_.extra_streams.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("label stream ", stream, " is not in [0, ", in_.extra_streams.size(), "]"));
    }
    return absl::OkStatus();
  }

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

  absl::Status MoeForward(int l, const float* a, const MoeWeights& w, float* y) override {
    const int64_t D = config_.dim, T = in_.rows;
    BorrowDispatch(l);
    GRADSUM_RETURN_IF_ERROR(moe::MoeLayerForward(mesh_->ep_group(), layer_config_, LayerWeights(w),
                                                 absl::MakeConstSpan(a, T * D), mask_,
                                                 absl::MakeSpan(y, T * D), &layer_state_[l]));
    // c[l, m, :] of §5 travels while the next layers compute.
    GRADSUM_ASSIGN_OR_RETURN(
        losses::ExpertCountReduction c,
        losses::ExpertCountReduction::Start(
            mesh_->world(), layer_state_[l].route.local_expert_counts, config_.top_k));
    if (static_cast<int>(counts_.size()) != l) {
      return absl::FailedPreconditionError(
          absl::StrCat("MoE layer ", l, " ran forward out of order"));
    }
    counts_.push_back(std::move(c));
    return absl::OkStatus();
  }

  bool CanRecomputeMoe() const override { return true; }

  absl::Status MoeRecomputeForward(int l, const float* a, const MoeWeights& w, float* y) override {
    const int64_t D = config_.dim, T = in_.rows;
    if (l >= static_cast<int>(counts_.size())) {
      return absl::FailedPreconditionError(
          absl::StrCat("MoE layer ", l, " has no forward to re-run"));
    }
    BorrowDispatch(l);
    return moe::MoeLayerRecomputeForward(mesh_->ep_group(), layer_config_, LayerWeights(w),
                                         absl::MakeConstSpan(a, T * D), absl::MakeSpan(y, T * D),
                                         &layer_state_[l]);
  }

  // The layer's dispatch state (its buffers, with their capacity) goes to the spare pool,
  // where the next layer to run takes it: under full recomputation one set of dispatch and
  // expert buffers serves every layer.
  void ReleaseMoeActivations(int l) override {
    if (l < 0 || l >= static_cast<int>(layer_state_.size()) || !held_[l]) return;
    spare_dispatch_.push_back(std::move(layer_state_[l].dispatch));
    layer_state_[l].dispatch = moe::DispatchState();
    held_[l] = false;
  }

  absl::Status MoeBackward(int l, const float* a, const MoeWeights& w, const float* dy, float* da,
                           MoeGrads g) override {
    const int64_t D = config_.dim, E = config_.experts, T = in_.rows;
    const int K = config_.top_k;
    if (l >= static_cast<int>(counts_.size())) {
      return absl::FailedPreconditionError(absl::StrCat("MoE layer ", l, " has no forward"));
    }
    if (!held_[l]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "MoE layer ", l, " released its activations; re-run its forward before backward"));
    }
    moe::RouterOutput& route = layer_state_[l].route;
    du_.assign(T * E, 0.0f);
    GRADSUM_ASSIGN_OR_RETURN(absl::Span<const int64_t> global_counts, counts_[l].Wait());
    // The z and balancing losses (row-wise gradients into du; the values are sums over
    // the rows), per row block.
    const int64_t S = in_.row_block > 0 ? in_.row_block : T;
    for (int64_t r0 = 0; r0 < T; r0 += S) {
      GRADSUM_ASSIGN_OR_RETURN(
          TensorView u, TensorView::Create(route.logits.data() + r0 * E, DType::kF32, {S, E}));
      GRADSUM_ASSIGN_OR_RETURN(TensorView du_view,
                               TensorView::Create(du_.data() + r0 * E, DType::kF32, {S, E}));
      const auto m_rows = absl::MakeConstSpan(mask_).subspan(r0, S);
      GRADSUM_ASSIGN_OR_RETURN(
          double z, losses::RouterZLossForwardBackward(u, m_rows, in_.global_routed_tokens,
                                                       config_.alpha_z, du_view));
      GRADSUM_ASSIGN_OR_RETURN(double bal, losses::LoadBalancingLossForwardBackward(
                                               u, m_rows, global_counts, K, in_.num_micro_batches,
                                               config_.alpha_b, du_view));
      terms_.z += z;
      terms_.bal += bal;
      if (in_.row_block > 0) {
        terms_.z_terms.push_back(z);
        terms_.bal_terms.push_back(bal);
      }
    }
    global_counts_[l].assign(global_counts.begin(), global_counts.end());

    std::fill(da, da + T * D, 0.0f);
    moe::MoeLayerGrads grads;
    const int64_t expert_block = local_experts_ * D * config_.expert_dim;
    if (g.router.exact() != nullptr || g.local_experts.exact() != nullptr) {
      if (g.router.exact() == nullptr || g.local_experts.exact() == nullptr) {
        return absl::InvalidArgumentError(
            "MoE layer gradients: the router and the experts need the same kind of target");
      }
      grads.router_exact = g.router.exact();
      grads.local_experts.exact = g.local_experts.exact();
    } else {
      float* experts = g.local_experts.accumulate();
      grads.router = absl::MakeSpan(g.router.accumulate(), D * E);
      grads.local_experts.gate = absl::MakeSpan(experts, expert_block);
      grads.local_experts.up = absl::MakeSpan(experts + expert_block, expert_block);
      grads.local_experts.down = absl::MakeSpan(experts + 2 * expert_block, expert_block);
    }
    moe::RouterLossGrads loss_grads;
    loss_grads.d_logits = du_;
    return moe::MoeLayerBackward(mesh_->ep_group(), layer_config_, LayerWeights(w),
                                 absl::MakeConstSpan(a, T * D), layer_state_[l],
                                 absl::MakeConstSpan(dy, T * D), loss_grads,
                                 absl::MakeSpan(da, T * D), grads);
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
          if (split_z_out) block_z_out[q] = shown.z_out;
          return absl::OkStatus();
        }));
    for (double v : block_ce) *value += v;
    for (double v : block_z_out) *z_out += v;
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

  absl::Status TokensToHeads(const float* x, bool kv, float* out) override {
    const int64_t hd = head_dim_, Hl = heads_local_, T = in_.rows;
    const int heads_in = kv ? config_.n_kv_heads : config_.n_heads;
    // For destination rank j, head slot hl: the input head it carries.
    auto source_head = [&](int j, int64_t hl) {
      const int64_t h = j * Hl + hl;  // the destination's query head
      return kv ? static_cast<int>(h / group_) : static_cast<int>(h);
    };
    const int64_t block = T * Hl * hd;  // floats per (source, destination) pair
    send_.resize(sp_size_ * block);
    for (int j = 0; j < sp_size_; ++j) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t hl = 0; hl < Hl; ++hl) {
          const float* src = x + (t * heads_in + source_head(j, hl)) * hd;
          std::copy(src, src + hd, send_.data() + j * block + (t * Hl + hl) * hd);
        }
      }
    }
    GRADSUM_RETURN_IF_ERROR(Exchange(block));
    // From source i: its slice [i L, (i + 1) L) of every (CP-local) sequence.
    const int64_t local = LocalSeqLen(), L = local / sp_size_, row = Hl * hd;
    for (int i = 0; i < sp_size_; ++i) {
      for (int64_t n = 0; n < in_.sequences; ++n) {
        const float* src = recv_.data() + i * block + n * L * row;
        std::copy(src, src + L * row, out + (n * local + i * L) * row);
      }
    }
    return absl::OkStatus();
  }

  absl::Status HeadsToTokens(const float* x, float* out) override {
    const int64_t hd = head_dim_, Hl = heads_local_, T = in_.rows, H = config_.n_heads;
    const int64_t local = LocalSeqLen(), L = local / sp_size_, row = Hl * hd, block = T * row;
    send_.resize(sp_size_ * block);
    // To destination j: its slice of every (CP-local) sequence, this rank's heads.
    for (int j = 0; j < sp_size_; ++j) {
      for (int64_t n = 0; n < in_.sequences; ++n) {
        const float* src = x + (n * local + j * L) * row;
        std::copy(src, src + L * row, send_.data() + j * block + n * L * row);
      }
    }
    GRADSUM_RETURN_IF_ERROR(Exchange(block));
    for (int i = 0; i < sp_size_; ++i) {
      for (int64_t t = 0; t < T; ++t) {
        const float* src = recv_.data() + i * block + t * row;
        std::copy(src, src + row, out + (t * H + i * Hl) * hd);
      }
    }
    return absl::OkStatus();
  }

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

  absl::Status Attention(const float* q, const float* k, const float* v, float* out,
                         float* lse) override {
    const AttentionDims dims = HeadDims();
    const int64_t n = HeadSplitRows() * heads_local_ * head_dim_;
    if (cp_size_ > 1) {
      const RingAttentionDims rd = RingDims();
      std::vector<float> kc, vc;
      const auto [kr, vr] = RingKv(rd, k, v, n, &kc, &vc);
      return RingAttentionForward(mesh_->group(MeshAxis::kCp), rd, cp_schedule_,
                                  absl::MakeConstSpan(q, n), kr, vr, in_.doc_start,
                                  absl::MakeSpan(out, n),
                                  absl::MakeSpan(lse, HeadSplitRows() * heads_local_));
    }
    return AttentionForward(dims, absl::MakeConstSpan(q, n), absl::MakeConstSpan(k, n),
                            absl::MakeConstSpan(v, n), in_.doc_start, absl::MakeSpan(out, n),
                            absl::MakeSpan(lse, HeadSplitRows() * heads_local_));
  }

  absl::Status AttentionBackward(const float* q, const float* k, const float* v, const float* out,
                                 const float* lse, const float* d_out, float* dq, float* dk,
                                 float* dv) override {
    const AttentionDims dims = HeadDims();
    const int64_t n = HeadSplitRows() * heads_local_ * head_dim_;
    if (cp_size_ > 1) {
      const RingAttentionDims rd = RingDims();
      std::vector<float> kc, vc;
      const auto [kr, vr] = RingKv(rd, k, v, n, &kc, &vc);
      if (rd.kv_heads == rd.heads) {
        return RingAttentionBackward(
            mesh_->group(MeshAxis::kCp), rd, cp_schedule_, absl::MakeConstSpan(q, n), kr, vr,
            in_.doc_start, absl::MakeConstSpan(out, n),
            absl::MakeConstSpan(lse, HeadSplitRows() * heads_local_), absl::MakeConstSpan(d_out, n),
            absl::MakeSpan(dq, n), absl::MakeSpan(dk, n), absl::MakeSpan(dv, n));
      }
      // The shared kv heads' gradients, each written to the first query head of its
      // group and 0 to the others: SumKvGroups, which the model runs next, adds them.
      std::vector<float> dkc(kc.size()), dvc(vc.size());
      GRADSUM_RETURN_IF_ERROR(RingAttentionBackward(
          mesh_->group(MeshAxis::kCp), rd, cp_schedule_, absl::MakeConstSpan(q, n), kr, vr,
          in_.doc_start, absl::MakeConstSpan(out, n),
          absl::MakeConstSpan(lse, HeadSplitRows() * heads_local_), absl::MakeConstSpan(d_out, n),
          absl::MakeSpan(dq, n), absl::MakeSpan(dkc), absl::MakeSpan(dvc)));
      const int64_t g = rd.heads / rd.kv_heads, hd = head_dim_;
      std::fill(dk, dk + n, 0.0f);
      std::fill(dv, dv + n, 0.0f);
      for (int64_t r = 0; r < HeadSplitRows(); ++r) {
        for (int64_t j = 0; j < rd.kv_heads; ++j) {
          const int64_t from = (r * rd.kv_heads + j) * hd, to = (r * rd.heads + j * g) * hd;
          std::copy_n(dkc.data() + from, hd, dk + to);
          std::copy_n(dvc.data() + from, hd, dv + to);
        }
      }
      return absl::OkStatus();
    }
    return model::AttentionBackward(
        dims, absl::MakeConstSpan(q, n), absl::MakeConstSpan(k, n), absl::MakeConstSpan(v, n),
        in_.doc_start, absl::MakeConstSpan(out, n),
        absl::MakeConstSpan(lse, HeadSplitRows() * heads_local_), absl::MakeConstSpan(d_out, n),
        absl::MakeSpan(dq, n), absl::MakeSpan(dk, n), absl::MakeSpan(dv, n));
  }

  absl::StatusOr<MicroBatchLossTerms> End() override {
    if (in_.row_block <= 0) {
      terms_.ce_terms = {terms_.ce};
      terms_.z_terms = {terms_.z};
      terms_.bal_terms = {terms_.bal};
      for (size_t j = 0; j < terms_.extra_ce.size(); ++j) {
        terms_.extra_ce_terms[j] = {terms_.extra_ce[j]};
      }
      if (config_.ce.alpha_lse > 0.0) terms_.z_out_terms = {terms_.z_out};
    }
    terms_.global_expert_counts = std::move(global_counts_);
    counts_.clear();
    return std::move(terms_);
  }

  void Abandon() override { counts_.clear(); }

 private:
  // Attention: the layout checks and the RoPE tables of the micro-batch.
  absl::Status BeginAttention() {
    const int64_t T = in_.rows;
    if ((cp_size_ > 1 && in_.seq_len % (2 * cp_size_) != 0) || LocalSeqLen() % sp_size_ != 0 ||
        in_.sequences * (LocalSeqLen() / sp_size_) != T) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention: ", T, " tokens are not ", in_.sequences, " sequences of ",
                       in_.seq_len, " / (sp=", sp_size_, " cp=", cp_size_, ") tokens"));
    }
    if (static_cast<int64_t>(in_.positions.size()) != T ||
        static_cast<int64_t>(in_.doc_start.size()) != in_.sequences * in_.seq_len) {
      return absl::InvalidArgumentError("attention: positions or document starts missing");
    }
    RopeTable(in_.positions, head_dim_, config_.rope_theta, &rope_cos_, &rope_sin_);
    return absl::OkStatus();
  }

  // Tokens of a sequence this rank's SP group holds: all of it, or with context
  // parallelism its two zigzag chunks (model/ring_attention.h), seq_len / cp.
  int64_t LocalSeqLen() const { return in_.seq_len / cp_size_; }

  // Rows of the head split: the (CP-local) sequences of the micro-batch.
  int64_t HeadSplitRows() const { return in_.sequences * LocalSeqLen(); }

  // The ring's dims. Its k, v hold each query head's copy of its kv head (TokensToHeads
  // repeats them); the ring schedule carries each distinct kv head once: heads_local_
  // query heads in consecutive groups of gcd(group_, heads_local_), each group's copies the
  // same kv head (whatever the SP split), so kv_heads = heads_local_ / that. The gathered
  // schedule (reproducible mode) keeps one per query head: its bits are the whole-sequence
  // call's, which the model makes with the copies.
  RingAttentionDims RingDims() const {
    RingAttentionDims d;
    d.num_seqs = in_.sequences;
    d.seq_len = in_.seq_len;
    d.heads = static_cast<int>(heads_local_);
    d.kv_heads = d.heads;
    if (cp_schedule_ == RingSchedule::kRing) {
      d.kv_heads = static_cast<int>(heads_local_ / std::gcd<int64_t>(group_, heads_local_));
    }
    d.head_dim = head_dim_;
    return d;
  }

  // k and v as the ring takes them: the inputs themselves with one kv head per query head,
  // else the first query head's copy of each group, into *kc, *vc.
  std::pair<absl::Span<const float>, absl::Span<const float>> RingKv(const RingAttentionDims& rd,
                                                                     const float* k, const float* v,
                                                                     int64_t n,
                                                                     std::vector<float>* kc,
                                                                     std::vector<float>* vc) const {
    if (rd.kv_heads == rd.heads) return {absl::MakeConstSpan(k, n), absl::MakeConstSpan(v, n)};
    const int64_t rows = HeadSplitRows(), g = rd.heads / rd.kv_heads, hd = head_dim_;
    kc->resize(rows * rd.kv_heads * hd);
    vc->resize(kc->size());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < rd.kv_heads; ++j) {
        const int64_t from = (r * rd.heads + j * g) * hd, to = (r * rd.kv_heads + j) * hd;
        std::copy_n(k + from, hd, kc->data() + to);
        std::copy_n(v + from, hd, vc->data() + to);
      }
    }
    return {absl::MakeConstSpan(*kc), absl::MakeConstSpan(*vc)};
  }

  // The head split's attention: this rank's query heads, each with its own key/value head.
  AttentionDims HeadDims() const {
    AttentionDims d;
    d.num_seqs = in_.sequences;
    d.seq_len = in_.seq_len;
    d.q_heads = heads_local_;
    d.kv_heads = heads_local_;
    d.head_dim = head_dim_;
    return d;
  }

  // send_ [S][block] -> recv_ [S][block] over the SP group (a copy without one).
  absl::Status Exchange(int64_t block) {
    recv_.resize(sp_size_ * block);
    if (sp_size_ == 1) {
      std::copy(send_.begin(), send_.begin() + block, recv_.begin());
      return absl::OkStatus();
    }
    std::vector<size_t> counts(sp_size_, static_cast<size_t>(block)), offsets(sp_size_);
    for (int i = 0; i < sp_size_; ++i) offsets[i] = static_cast<size_t>(i * block);
    return mesh_->group(MeshAxis::kSp)
        .AllToAllV(send_.data(), counts, offsets, recv_.data(), counts, offsets, DType::kF32);
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

  moe::MoeLayerWeights LayerWeights(const MoeWeights& w) const {
    const int64_t D = config_.dim, E = config_.experts;
    const int64_t block = local_experts_ * D * config_.expert_dim;
    moe::MoeLayerWeights out;
    out.router = absl::MakeConstSpan(w.router, D * E);
    if (w.expert_bias != nullptr) out.expert_bias = absl::MakeConstSpan(w.expert_bias, E);
    out.local_experts.gate = absl::MakeConstSpan(w.local_experts, block);
    out.local_experts.up = absl::MakeConstSpan(w.local_experts + block, block);
    out.local_experts.down = absl::MakeConstSpan(w.local_experts + 2 * block, block);
    return out;
  }

  int64_t HeldActivationBytes() const override {
    int64_t bytes = 0;
    auto add = [&bytes](const auto& v) {
      bytes += static_cast<int64_t>(v.capacity() * sizeof(v[0]));
    };
    auto add_dispatch = [&add](const moe::DispatchState& d) {
      add(d.send_copy), add(d.copy_pos), add(d.combine_weight), add(d.output_row);
      add(d.copy_output), add(d.expert_input), add(d.expert_output);
      for (const moe::ExpertsSaved& e : d.experts_saved) add(e.gate_pre), add(e.up_pre);
      add(d.scratch_send), add(d.scratch_expert_a), add(d.scratch_expert_b);
    };
    for (const moe::MoeLayerState& s : layer_state_) {
      const moe::RouterOutput& r = s.route;
      add(r.logits), add(r.probs), add(r.expert_index), add(r.combine_weight), add(r.routed);
      add_dispatch(s.dispatch);
    }
    for (const moe::DispatchState& d : spare_dispatch_) add_dispatch(d);
    add(dispatch_scratch_.send), add(dispatch_scratch_.expert_a), add(dispatch_scratch_.expert_b);
    add(du_), add(rope_cos_), add(rope_sin_), add(send_), add(recv_);
    return bytes;
  }

  MoeLmConfig config_;
  const Mesh* mesh_;  // not owned
  RingSchedule cp_schedule_;
  int num_threads_ = 1;
  int local_experts_ = 1;
  int moe_layers_ = 0;     // MoeLmSpec::moe_layers()
  int extra_streams_ = 0;  // MoeLmSpec::label_streams() - 1
  moe::MoeLayerConfig layer_config_;
  std::vector<moe::MoeLayerState> layer_state_;
  // The dispatch's scratch, one set for every layer (the layers run one at a time).
  moe::DispatchScratch dispatch_scratch_;
  // Full recomputation: the dispatch states released by ReleaseMoeActivations, and which
  // layers hold one (a layer that holds none takes one from the pool before it runs, so
  // one set of buffers circulates through the layers).
  std::vector<moe::DispatchState> spare_dispatch_;
  std::vector<bool> held_;
  // The micro-batch.
  MicroBatchInputs in_;
  std::vector<uint8_t> mask_;
  std::vector<int64_t> labels_;
  std::vector<std::vector<int64_t>> stream_labels_;   // the extra streams' labels, widened
  std::vector<losses::ExpertCountReduction> counts_;  // per layer, in flight from forward
  std::vector<std::vector<int64_t>> global_counts_;
  std::vector<float> du_;  // [T, E]
  MicroBatchLossTerms terms_;
  // Attention: the SP group's size and this rank's place in it, the head layout, the
  // micro-batch's RoPE tables [T, head_dim / 2], and the exchanges' buffers.
  int sp_size_ = 1, sp_rank_ = 0;
  int cp_size_ = 1;  // the CP group's (§16)
  int64_t head_dim_ = 0, heads_local_ = 0;
  int group_ = 1;  // query heads per kv head
  std::vector<float> rope_cos_, rope_sin_;
  std::vector<float> send_, recv_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelOps>> MakeCpuOps(const MoeLmSpec& spec, const Mesh& mesh,
                                                     const CpuOpsOptions& options) {
  const int P = mesh.ep_size();
  const int S = mesh.size(MeshAxis::kSp);
  if (spec.config().attention && spec.config().n_heads % S != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model.heads=", spec.config().n_heads,
                                                   " is not divisible by sp=", S,
                                                   " (Ulysses splits whole heads)"));
  }
  if (spec.config().experts % P != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model.experts=", spec.config().experts,
                                                   " is not divisible by ep=", P,
                                                   " (SEMANTICS.md §7)"));
  }
  return std::unique_ptr<ModelOps>(new CpuOps(spec, mesh, options));
}

}  // namespace gradsum::model
