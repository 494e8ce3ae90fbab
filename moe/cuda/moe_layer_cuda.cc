#include "moe/cuda/moe_layer_cuda.h"

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/device_stream.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"
#include "moe/cuda/experts_cuda.h"
#include "moe/cuda/permute_cuda.h"
#include "moe/cuda/router_cuda.h"
#include "moe/ep_exchange.h"

namespace gradsum::moe {
namespace {

using cuda::Fence;
using cuda::GemmRowMajor;

size_t F32(int64_t n) { return static_cast<size_t>(n) * sizeof(float); }

ExpertsCudaConfig ExpertsConfig(const MoeLayerConfig& c, int local_experts) {
  ExpertsCudaConfig e;
  e.d_model = c.d_model;
  e.hidden = c.hidden;
  e.num_local_experts = local_experts;
  e.dtype = DType::kF32;
  return e;
}

ExpertsCudaWeights ExpertWeights(const MoeBlockWeights& w, int64_t block) {
  ExpertsCudaWeights e;
  e.gate = w.local_experts;
  e.up = w.local_experts + block;
  e.down = w.local_experts + 2 * block;
  return e;
}

// All-to-all-v over the NCCL EP group, ordered after the compute stream's work.
absl::Status AllToAll(const CudaExec& exec, Communicator& ep, const float* send,
                      const std::vector<size_t>& sc, const std::vector<size_t>& so, float* recv,
                      const std::vector<size_t>& rc, const std::vector<size_t>& ro) {
  GRADSUM_RETURN_IF_ERROR(Fence(exec.stream, ep.device_stream()->stream(), exec.fence));
  return ep.AllToAllV(send, sc, so, recv, rc, ro, DType::kF32);
}

// Source p's rows of the receive side, as the experts read and keep them.
ExpertsCudaSaved SavedRows(MoeLayerCudaActivations& acts, int64_t first, int64_t H) {
  return ExpertsCudaSaved{acts.gate.as<float>() + first * H, acts.up.as<float>() + first * H,
                          acts.hidden.as<float>() + first * H};
}

// Calls fn(p, first) for every source p whose rows reached this rank, `first` its first
// received row: the experts run on each source's rows as they lie (EpExchangePlan).
template <typename Fn>
absl::Status ForEachSource(const EpExchangePlan& x, Fn fn) {
  for (size_t p = 0; p < x.source_offsets.size(); ++p) {
    if (x.source_offsets[p].back() == 0) continue;
    GRADSUM_RETURN_IF_ERROR(fn(static_cast<int>(p), x.source_first_row[p]));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t MoeLayerCudaActivations::bytes() const {
  int64_t n = 0;
  for (const cuda::DeviceBuffer* b : {&recv, &gate, &up, &hidden, &back}) n += b->size();
  return n;
}

int64_t MoeLayerCudaScratch::bytes() const {
  int64_t n = 0;
  for (const cuda::DeviceBuffer* b :
       {&send, &expert_out, &d_back, &d_recv, &dx_recv, &d_send, &du, &dw}) {
    n += b->size();
  }
  return n;
}

class MoeLayersCudaImpl final : public MoeLayersCuda {
 public:
  MoeLayersCudaImpl(const CudaExec* exec, const Mesh& mesh, const MoeLayerConfig& config,
                    const MoeLossWeights& losses, int num_layers)
      : exec_(exec), mesh_(&mesh), config_(config), losses_(losses), layers_(num_layers) {}

  void BeginMicroBatch(const MoeMicroBatchCuda& batch) override { batch_ = batch; }
  const int64_t* global_counts(int l) const override {
    return layers_[l].global_counts.as<int64_t>();
  }

  int64_t HeldBytes() const override {
    int64_t n = scratch_.bytes();
    for (const MoeLayerCudaActivations& a : spare_) n += a.bytes();
    for (const Layer& layer : layers_) {
      n += layer.acts.bytes();
      for (const cuda::DeviceBuffer* b : {&layer.logits, &layer.probs, &layer.index, &layer.weight,
                                          &layer.lse, &layer.permuted_copy, &layer.copy_position}) {
        n += b->size();
      }
    }
    return n;
  }

  absl::Status Route(int l, const float* a, const MoeBlockWeights& w) override {
    Layer& layer = layers_[l];
    const int64_t D = config_.d_model, T = batch_.rows;
    const int E = config_.num_experts;
    cudaStream_t s = exec_->stream;
    // §5.1: the layer's expert bias (host memory, the model's state) goes to the device for
    // the top-K selection. E floats per layer and forward; the copy is staged before it returns.
    const float* bias = nullptr;
    if (w.expert_bias != nullptr) {
      GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.bias, E * sizeof(float)));
      GRADSUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(layer.bias.get(), w.expert_bias,
                                                   E * sizeof(float), cudaMemcpyHostToDevice, s),
                                   "upload the expert bias");
      bias = layer.bias.as<float>();
    }
    GRADSUM_RETURN_IF_ERROR(Reserve(layer));
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(*exec_->blas, s, false, false, T, E, D, a, D, w.router, E,
                                         DType::kF32, layer.logits.get(), E, DType::kF32));
    RouterForwardCudaArgs r;
    r.logits = layer.logits.as<float>();
    r.mask = batch_.mask;
    r.tokens = T;
    r.experts = E;
    r.top_k = config_.top_k;
    r.norm_topk_prob = config_.norm_topk_prob;
    r.router_scale = config_.router_scale;
    r.sigmoid_scores = config_.score == RouterScore::kSigmoid;
    r.expert_bias = bias;
    r.probs = layer.probs.as<float>();
    r.expert_index = layer.index.as<int32_t>();
    r.combine_weight = layer.weight.as<float>();
    r.logsumexp = layer.lse.as<float>();
    r.local_expert_counts = layer.local_counts.as<int64_t>();
    r.local_gating_sums = layer.gating.as<double>();
    return RouterForwardCuda(r, s);  // checks inputs (a host sync)
  }

  absl::Status StartCountSum(int l) override {
    Layer& layer = layers_[l];
    Communicator& world = mesh_->device_group(MeshAxis::kWorld);
    GRADSUM_RETURN_IF_ERROR(Fence(exec_->stream, world.device_stream()->stream(), exec_->fence));
    return world.AllReduce(layer.local_counts.get(), layer.global_counts.get(), config_.num_experts,
                           DType::kI64, ReduceOp::kSum);
  }

  absl::Status Dispatch(int l, const float* a, const MoeBlockWeights& w, float* y,
                        bool rerun) override {
    Layer& layer = layers_[l];
    const int64_t D = config_.d_model;
    const int E = config_.num_experts;
    cudaStream_t s = exec_->stream;
    if (layer.rows < 0) {
      return absl::FailedPreconditionError("MoE layer recompute before its forward");
    }
    if (rerun) {
      // The plan's permutation and the exchange's sizes are the routing's, kept: the rows
      // are permuted again from `a` and travel as before.
      GRADSUM_RETURN_IF_ERROR(
          PermuteRowsCuda({a, DType::kF32, D, scratch_.send.get()}, layer.plan, s));
      return ExchangeExpertsCombine(layer, w, y);
    }
    // Dispatch plan: copies ordered by expert, so EP rank p's rows are contiguous.
    layer.plan = PermutePlanCudaArgs();
    layer.plan.expert_index = layer.index.as<int32_t>();
    layer.plan.tokens = layer.rows;
    layer.plan.top_k = config_.top_k;
    layer.plan.experts = E;
    layer.plan.expert_offsets = layer.offsets.as<int64_t>();
    layer.plan.permuted_copy = layer.permuted_copy.as<int64_t>();
    layer.plan.copy_position = layer.copy_position.as<int64_t>();
    GRADSUM_RETURN_IF_ERROR(PermutePlanCuda(layer.plan, s));
    GRADSUM_RETURN_IF_ERROR(
        PermuteRowsCuda({a, DType::kF32, D, scratch_.send.get()}, layer.plan, s));
    std::vector<int64_t> offsets(E + 1);
    GRADSUM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(offsets.data(), layer.offsets.get(), (E + 1) * sizeof(int64_t),
                        cudaMemcpyDeviceToHost, s),
        "download expert offsets");
    GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s), "wait for the expert offsets");
    // The per-expert row counts travel over the host EP group: they size the NCCL
    // all-to-all-v, which needs them on the host anyway.
    GRADSUM_ASSIGN_OR_RETURN(std::vector<int64_t> their_counts,
                             ExchangeExpertCounts(mesh_->group(MeshAxis::kEp), offsets));
    GRADSUM_ASSIGN_OR_RETURN(layer.exchange,
                             PlanEpExchange(offsets, their_counts, mesh_->ep_size(), D));
    return ExchangeExpertsCombine(layer, w, y);
  }

  absl::Status CheckGrads(const MoeBlockGrads& g) const override {
    if (g.router->exact() != nullptr || g.local_experts->exact() != nullptr) {
      return absl::InvalidArgumentError(
          "the CUDA MoE layers add gradients into fp32 device buffers only, not into exact "
          "targets (reproducible mode runs on the CPU backends)");
    }
    return absl::OkStatus();
  }

  absl::Status RouterLosses(int l) override {
    return RouterAuxLossCuda(AuxArgs(layers_[l]), exec_->stream);
  }

  absl::Status DispatchBackward(int l, const float* a, const MoeBlockWeights& w, const float* dy,
                                float* da, const MoeBlockGrads& g) override {
    Layer& layer = layers_[l];
    const int64_t D = config_.d_model, H = config_.hidden;
    const int P = mesh_->ep_size();
    const int El = config_.num_experts / P;
    const CudaExec& exec = *exec_;
    if (!layer.activations_valid) {
      return absl::FailedPreconditionError(
          "MoE layer backward: its activations were handed over; re-run its forward first");
    }
    const EpExchangePlan& x = layer.exchange;
    // Combine backward: rows' gradient (w * dy) and the combine weights' gradient.
    CombineCudaArgs comb;
    comb.dtype = DType::kF32;
    comb.width = D;
    comb.rows = layer.acts.back.get();
    comb.weights = layer.weight.as<float>();
    comb.d_out = dy;
    comb.d_rows = scratch_.d_back.get();
    comb.d_weights = scratch_.dw.as<float>();
    GRADSUM_RETURN_IF_ERROR(CombineBackwardCuda(comb, layer.plan, exec.stream));
    // Expert backward where the rows were computed, then the input gradients come home.
    Communicator& ep = mesh_->device_group(MeshAxis::kEp);
    GRADSUM_RETURN_IF_ERROR(AllToAll(exec, ep, scratch_.d_back.as<float>(), x.send_counts,
                                     x.send_offsets, scratch_.d_recv.as<float>(), x.recv_counts,
                                     x.recv_offsets));
    const int64_t block = El * D * H;
    float* d_experts = g.local_experts->accumulate();
    const ExpertsCudaConfig ecfg = ExpertsConfig(config_, El);
    const ExpertsCudaWeights ew = ExpertWeights(w, block);
    const ExpertsCudaWeightGrads eg{d_experts, d_experts + block, d_experts + 2 * block};
    GRADSUM_RETURN_IF_ERROR(ForEachSource(x, [&](int p, int64_t first) {
      return ExpertsBackwardCuda(
          *exec.blas, exec.stream, ecfg, ew, layer.acts.recv.as<float>() + first * D,
          x.source_offsets[p], SavedRows(layer.acts, first, H),
          scratch_.d_recv.as<float>() + first * D, scratch_.dx_recv.as<float>() + first * D, eg);
    }));
    // The gather's backward: da[t] = sum_k d_send[pos(t, k)].
    return ReturnAndCombine(layer, scratch_.dx_recv.as<float>(), scratch_.d_send.as<float>(),
                            /*weights=*/nullptr, da);
  }

  absl::Status RouterBackward(int l, const float* a, const MoeBlockWeights& w, float* da,
                              const MoeBlockGrads& g) override {
    const Layer& layer = layers_[l];
    const int64_t T = layer.rows, D = config_.d_model;
    const int E = config_.num_experts;
    cudaStream_t s = exec_->stream;
    RouterAuxCudaArgs aux = AuxArgs(layer);
    aux.expert_index = layer.index.as<int32_t>();
    aux.d_combine_weight = scratch_.dw.as<float>();
    aux.norm_topk_prob = config_.norm_topk_prob;
    aux.router_scale = config_.router_scale;
    aux.logits = layer.logits.as<float>();  // the z-loss's softmax with sigmoid scores
    aux.d_logits = scratch_.du.as<float>();
    aux.accumulate_grad = false;
    GRADSUM_RETURN_IF_ERROR(RouterBackwardCuda(aux, s));
    // Router GEMM backward: dWr += a^T du; da += du Wr^T.
    GRADSUM_RETURN_IF_ERROR(GemmRowMajor(*exec_->blas, s, true, false, D, E, T, a, D,
                                         scratch_.du.get(), E, DType::kF32, g.router->accumulate(),
                                         E, DType::kF32, 1.0f));
    return GemmRowMajor(*exec_->blas, s, false, true, T, D, E, scratch_.du.get(), E, w.router, E,
                        DType::kF32, da, D, DType::kF32, 1.0f);
  }

  // One stream: the next layer's kernels that reuse these buffers run after this layer's,
  // whatever the host does.
  void LendActivations(int l) override {
    Layer& layer = layers_[l];
    layer.activations_valid = false;
    spare_.push_back(std::move(layer.acts));
    layer.acts = MoeLayerCudaActivations();
  }

  void BorrowActivations(int l) override {
    if (spare_.empty()) return;
    layers_[l].acts = std::move(spare_.back());
    layers_[l].activations_valid = false;
    spare_.pop_back();
  }

 private:
  struct Layer {
    int64_t rows = -1;
    cuda::DeviceBuffer logits, probs, index, weight, lse;      // [T, E], [T, E], [T, K] x 2, [T]
    cuda::DeviceBuffer local_counts, global_counts, gating;    // [E] i64, [E] i64, [E] f64
    cuda::DeviceBuffer offsets, permuted_copy, copy_position;  // [E + 1], [T K], [T K] i64
    cuda::DeviceBuffer bias;                                   // [E] (§5.1), when given
    MoeLayerCudaActivations acts;
    bool activations_valid = false;  // acts hold this micro-batch's dispatch
    EpExchangePlan exchange;         // send side by expert, receive side by source then expert
    PermutePlanCudaArgs plan;
  };

  // Sizes the layer's routing buffers and the shared scratch for the micro-batch's rows.
  absl::Status Reserve(Layer& layer) {
    const int64_t T = batch_.rows;
    if (layer.rows == T) return absl::OkStatus();
    const int64_t E = config_.num_experts, K = config_.top_k, D = config_.d_model, TK = T * K;
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.logits, F32(T * E)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.probs, F32(T * E)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.index, TK * sizeof(int32_t)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.weight, F32(TK)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.lse, F32(T)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.local_counts, E * sizeof(int64_t)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.global_counts, E * sizeof(int64_t)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.gating, E * sizeof(double)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.offsets, (E + 1) * sizeof(int64_t)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.permuted_copy, TK * sizeof(int64_t)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&layer.copy_position, TK * sizeof(int64_t)));
    // The shared scratch grows to the largest layer's needs (Reserve keeps larger buffers).
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&scratch_.du, F32(T * E)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&scratch_.dw, F32(TK)));
    for (cuda::DeviceBuffer* b : {&scratch_.send, &scratch_.d_back, &scratch_.d_send}) {
      GRADSUM_RETURN_IF_ERROR(cuda::Reserve(b, F32(TK * D)));
    }
    layer.rows = T;
    return absl::OkStatus();
  }

  // Dispatch's part after the permutation into scratch_.send: the all-to-all, experts, the
  // reverse all-to-all and the combine into y, in layer.acts.
  absl::Status ExchangeExpertsCombine(Layer& layer, const MoeBlockWeights& w, float* y) {
    const int64_t T = layer.rows, D = config_.d_model, H = config_.hidden;
    const int P = mesh_->ep_size();
    const int El = config_.num_experts / P;
    const CudaExec& exec = *exec_;
    const EpExchangePlan& x = layer.exchange;
    const int64_t R = x.recv_rows;
    MoeLayerCudaActivations& acts = layer.acts;
    layer.activations_valid = false;
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&acts.back, F32(T * config_.top_k * D)));
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&acts.recv, F32(R * D)));
    for (cuda::DeviceBuffer* b : {&acts.gate, &acts.up, &acts.hidden}) {
      GRADSUM_RETURN_IF_ERROR(cuda::Reserve(b, F32(R * H)));
    }
    for (cuda::DeviceBuffer* b : {&scratch_.expert_out, &scratch_.d_recv, &scratch_.dx_recv}) {
      GRADSUM_RETURN_IF_ERROR(cuda::Reserve(b, F32(R * D)));
    }
    Communicator& ep = mesh_->device_group(MeshAxis::kEp);
    GRADSUM_RETURN_IF_ERROR(AllToAll(exec, ep, scratch_.send.as<float>(), x.send_counts,
                                     x.send_offsets, acts.recv.as<float>(), x.recv_counts,
                                     x.recv_offsets));
    const ExpertsCudaConfig ecfg = ExpertsConfig(config_, El);
    const ExpertsCudaWeights ew = ExpertWeights(w, El * D * H);
    GRADSUM_RETURN_IF_ERROR(ForEachSource(x, [&](int p, int64_t first) {
      return ExpertsForwardCuda(
          *exec.blas, exec.stream, ecfg, ew, acts.recv.as<float>() + first * D, x.source_offsets[p],
          scratch_.expert_out.as<float>() + first * D, SavedRows(acts, first, H));
    }));
    GRADSUM_RETURN_IF_ERROR(ReturnAndCombine(layer, scratch_.expert_out.as<float>(),
                                             acts.back.as<float>(), layer.weight.as<float>(), y));
    layer.activations_valid = true;
    return absl::OkStatus();
  }

  // The rows computed here (`owner`, receive side) go back to where they came from
  // (`home`, send order: the reverse exchange), and out[t] = sum_k w_tk home[pos(t, k)]
  // (written; weights null: a plain sum).
  absl::Status ReturnAndCombine(const Layer& layer, const float* owner, float* home,
                                const float* weights, float* out) {
    const EpExchangePlan& x = layer.exchange;
    GRADSUM_RETURN_IF_ERROR(AllToAll(*exec_, mesh_->device_group(MeshAxis::kEp), owner,
                                     x.recv_counts, x.recv_offsets, home, x.send_counts,
                                     x.send_offsets));
    CombineCudaArgs comb;
    comb.dtype = DType::kF32;
    comb.width = config_.d_model;
    comb.rows = home;
    comb.weights = weights;
    comb.out = out;
    return CombineCuda(comb, layer.plan, exec_->stream);
  }

  // The router losses' arguments of the layer (their backward adds its own).
  RouterAuxCudaArgs AuxArgs(const Layer& layer) const {
    RouterAuxCudaArgs aux;
    aux.probs = layer.probs.as<float>();
    aux.logsumexp = layer.lse.as<float>();
    aux.mask = batch_.mask;
    aux.tokens = layer.rows;
    aux.experts = config_.num_experts;
    aux.top_k = config_.top_k;
    aux.alpha_z = static_cast<float>(losses_.alpha_z);
    aux.alpha_b = static_cast<float>(losses_.alpha_b);
    aux.sigmoid_scores = config_.score == RouterScore::kSigmoid;
    aux.num_micro_batches = batch_.num_micro_batches;
    aux.global_routed_tokens = batch_.global_routed_tokens;
    aux.global_expert_counts = layer.global_counts.as<int64_t>();
    aux.local_gating_sums = layer.gating.as<double>();
    aux.z_loss = batch_.z_loss;
    aux.balance_loss = batch_.balance_loss;
    aux.accumulate_loss = true;
    return aux;
  }

  const CudaExec* exec_;
  const Mesh* mesh_;
  MoeLayerConfig config_;
  MoeLossWeights losses_;
  std::vector<Layer> layers_;
  MoeLayerCudaScratch scratch_;
  // Full recomputation: the activation sets lent by LendActivations.
  std::vector<MoeLayerCudaActivations> spare_;
  MoeMicroBatchCuda batch_;
};

std::unique_ptr<MoeLayersCuda> MakeMoeLayersCuda(const CudaExec* exec, const Mesh& mesh,
                                                 const MoeLayerConfig& config,
                                                 const MoeLossWeights& losses, int num_layers) {
  return std::make_unique<MoeLayersCudaImpl>(exec, mesh, config, losses, num_layers);
}

}  // namespace gradsum::moe
