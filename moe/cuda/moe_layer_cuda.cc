#include "moe/cuda/moe_layer_cuda.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/device_stream.h"
#include "core/cuda/cuda_status.h"
#include "core/status.h"
#include "moe/cuda/experts_cuda.h"
#include "moe/cuda/router_cuda.h"

namespace gradsum::moe {
namespace {

using cuda::Fence;
using cuda::GemmRowMajor;
using cuda::Reserve;

size_t F32(int64_t n) { return static_cast<size_t>(n) * sizeof(float); }

ExpertsCudaConfig ExpertsConfig(const MoeLayerCudaConfig& c, int local_experts) {
  ExpertsCudaConfig e;
  e.d_model = c.d_model;
  e.hidden = c.hidden;
  e.num_local_experts = local_experts;
  e.dtype = DType::kF32;
  return e;
}

ExpertsCudaWeights ExpertWeights(const MoeLayerCudaWeights& w, int64_t block) {
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

}  // namespace

absl::Status MoeLayerCuda::Reserve(int64_t T, const MoeLayerCudaConfig& c,
                                   MoeLayerCudaScratch* scratch) {
  if (rows_ == T) return absl::OkStatus();
  const int64_t E = c.num_experts, K = c.top_k, D = c.d_model, TK = T * K;
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&logits_, F32(T * E)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&probs_, F32(T * E)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&index_, TK * sizeof(int32_t)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&weight_, F32(TK)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&lse_, F32(T)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&local_counts_, E * sizeof(int64_t)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&global_counts_, E * sizeof(int64_t)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&gating_, E * sizeof(double)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&offsets_, (E + 1) * sizeof(int64_t)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&permuted_copy_, TK * sizeof(int64_t)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&copy_position_, TK * sizeof(int64_t)));
  // The shared scratch grows to the largest layer's needs (Reserve keeps larger buffers).
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&scratch->du, F32(T * E)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&scratch->dw, F32(TK)));
  for (cuda::DeviceBuffer* b : {&scratch->send, &scratch->d_back, &scratch->d_send}) {
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(b, F32(TK * D)));
  }
  rows_ = T;
  return absl::OkStatus();
}

absl::Status MoeLayerCuda::Forward(const CudaExec& exec, const Mesh& mesh,
                                   const MoeLayerCudaConfig& c, MoeLayerCudaScratch* scratch,
                                   int64_t T, const float* a, const MoeLayerCudaWeights& w,
                                   const uint8_t* mask, float* y) {
  const int64_t D = c.d_model;
  const int E = c.num_experts, K = c.top_k;
  const int P = mesh.ep_size();
  cudaStream_t s = exec.stream;
  GRADSUM_RETURN_IF_ERROR(Reserve(T, c, scratch));
  GRADSUM_RETURN_IF_ERROR(GemmRowMajor(*exec.blas, s, false, false, T, E, D, a, D, w.router, E,
                                       DType::kF32, logits_.get(), E, DType::kF32));
  RouterForwardCudaArgs r;
  r.logits = logits_.as<float>();
  r.mask = mask;
  r.tokens = T;
  r.experts = E;
  r.top_k = K;
  r.norm_topk_prob = c.norm_topk_prob;
  r.router_scale = c.router_scale;
  r.sigmoid_scores = c.sigmoid_scores;
  r.expert_bias = w.expert_bias;
  r.probs = probs_.as<float>();
  r.expert_index = index_.as<int32_t>();
  r.combine_weight = weight_.as<float>();
  r.logsumexp = lse_.as<float>();
  r.local_expert_counts = local_counts_.as<int64_t>();
  r.local_gating_sums = gating_.as<double>();
  GRADSUM_RETURN_IF_ERROR(RouterForwardCuda(r, s));  // checks inputs (a host sync)
  // c[l, m, :] of §5: SUM over the world.
  GRADSUM_RETURN_IF_ERROR(
      Fence(s, mesh.device_group(MeshAxis::kWorld).device_stream()->stream(), exec.fence));
  GRADSUM_RETURN_IF_ERROR(
      mesh.device_group(MeshAxis::kWorld)
          .AllReduce(local_counts_.get(), global_counts_.get(), E, DType::kI64, ReduceOp::kSum));
  // Dispatch plan: copies ordered by expert, so EP rank p's rows are contiguous.
  plan_ = PermutePlanCudaArgs();
  plan_.expert_index = index_.as<int32_t>();
  plan_.tokens = T;
  plan_.top_k = K;
  plan_.experts = E;
  plan_.expert_offsets = offsets_.as<int64_t>();
  plan_.permuted_copy = permuted_copy_.as<int64_t>();
  plan_.copy_position = copy_position_.as<int64_t>();
  GRADSUM_RETURN_IF_ERROR(PermutePlanCuda(plan_, s));
  GRADSUM_RETURN_IF_ERROR(PermuteRowsCuda({a, DType::kF32, D, scratch->send.get()}, plan_, s));
  std::vector<int64_t> offsets(E + 1);
  GRADSUM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(offsets.data(), offsets_.get(), (E + 1) * sizeof(int64_t),
                      cudaMemcpyDeviceToHost, s),
      "download expert offsets");
  GRADSUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s), "wait for the expert offsets");
  // The per-expert row counts travel over the host EP group: they size the NCCL
  // all-to-all-v, which needs them on the host anyway.
  GRADSUM_ASSIGN_OR_RETURN(std::vector<int64_t> their_counts,
                           ExchangeExpertCounts(mesh.group(MeshAxis::kEp), offsets));
  GRADSUM_ASSIGN_OR_RETURN(exchange_, PlanEpExchange(offsets, their_counts, P, D));
  return DispatchExpertsCombine(exec, mesh, c, scratch, w, y);
}

absl::Status MoeLayerCuda::RecomputeForward(const CudaExec& exec, const Mesh& mesh,
                                            const MoeLayerCudaConfig& c,
                                            MoeLayerCudaScratch* scratch, const float* a,
                                            const MoeLayerCudaWeights& w, float* y) {
  if (rows_ < 0) {
    return absl::FailedPreconditionError("MoE layer recompute before its forward");
  }
  // The plan's permutation (plan_) and the exchange's sizes (exchange_) are the routing's,
  // kept: the rows are permuted again from `a` and travel as before.
  GRADSUM_RETURN_IF_ERROR(
      PermuteRowsCuda({a, DType::kF32, c.d_model, scratch->send.get()}, plan_, exec.stream));
  return DispatchExpertsCombine(exec, mesh, c, scratch, w, y);
}

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

int64_t MoeLayerCuda::HeldBytes() const {
  int64_t n = acts_.bytes();
  for (const cuda::DeviceBuffer* b :
       {&logits_, &probs_, &index_, &weight_, &lse_, &permuted_copy_, &copy_position_}) {
    n += b->size();
  }
  return n;
}

MoeLayerCudaActivations MoeLayerCuda::TakeActivations() {
  activations_valid_ = false;
  MoeLayerCudaActivations out = std::move(acts_);
  acts_ = MoeLayerCudaActivations();
  return out;
}

void MoeLayerCuda::GiveActivations(MoeLayerCudaActivations activations) {
  acts_ = std::move(activations);
  activations_valid_ = false;
}

absl::Status MoeLayerCuda::DispatchExpertsCombine(const CudaExec& exec, const Mesh& mesh,
                                                  const MoeLayerCudaConfig& c,
                                                  MoeLayerCudaScratch* scratch,
                                                  const MoeLayerCudaWeights& w, float* y) {
  const int64_t T = rows_, D = c.d_model, H = c.hidden;
  const int E = c.num_experts, K = c.top_k;
  const int P = mesh.ep_size();
  const int El = E / P;
  cudaStream_t s = exec.stream;
  const EpExchangePlan& x = exchange_;
  const int64_t R = x.recv_rows;
  activations_valid_ = false;
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&acts_.back, F32(T * K * D)));
  GRADSUM_RETURN_IF_ERROR(cuda::Reserve(&acts_.recv, F32(R * D)));
  for (cuda::DeviceBuffer* b : {&acts_.gate, &acts_.up, &acts_.hidden}) {
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(b, F32(R * H)));
  }
  for (cuda::DeviceBuffer* b : {&scratch->expert_out, &scratch->d_recv, &scratch->dx_recv}) {
    GRADSUM_RETURN_IF_ERROR(cuda::Reserve(b, F32(R * D)));
  }
  GRADSUM_RETURN_IF_ERROR(AllToAll(exec, mesh.device_group(MeshAxis::kEp),
                                   scratch->send.as<float>(), x.send_counts, x.send_offsets,
                                   acts_.recv.as<float>(), x.recv_counts, x.recv_offsets));
  const ExpertsCudaConfig ecfg = ExpertsConfig(c, El);
  const ExpertsCudaWeights ew = ExpertWeights(w, El * D * H);
  for (int p = 0; p < P; ++p) {
    const int64_t first = x.source_first_row[p];
    if (x.source_offsets[p][El] == 0) continue;
    const ExpertsCudaSaved saved{acts_.gate.as<float>() + first * H,
                                 acts_.up.as<float>() + first * H,
                                 acts_.hidden.as<float>() + first * H};
    GRADSUM_RETURN_IF_ERROR(ExpertsForwardCuda(
        *exec.blas, s, ecfg, ew, acts_.recv.as<float>() + first * D, x.source_offsets[p],
        scratch->expert_out.as<float>() + first * D, saved));
  }
  // The outputs go back to where their rows came from (the reverse exchange).
  GRADSUM_RETURN_IF_ERROR(AllToAll(exec, mesh.device_group(MeshAxis::kEp),
                                   scratch->expert_out.as<float>(), x.recv_counts, x.recv_offsets,
                                   acts_.back.as<float>(), x.send_counts, x.send_offsets));
  CombineCudaArgs comb;
  comb.dtype = DType::kF32;
  comb.width = D;
  comb.rows = acts_.back.get();
  comb.weights = weight_.as<float>();
  comb.out = y;
  GRADSUM_RETURN_IF_ERROR(CombineCuda(comb, plan_, s));
  activations_valid_ = true;
  return absl::OkStatus();
}

absl::Status MoeLayerCuda::Backward(const CudaExec& exec, const Mesh& mesh,
                                    const MoeLayerCudaConfig& c, MoeLayerCudaScratch* scratch,
                                    const float* a, const MoeLayerCudaWeights& w,
                                    const uint8_t* mask, const MoeRouterLossCudaArgs& losses,
                                    const float* dy, float* da, const MoeLayerCudaGrads& grads) {
  const int64_t T = rows_, D = c.d_model, H = c.hidden;
  const int E = c.num_experts, K = c.top_k;
  const int P = mesh.ep_size();
  const int El = E / P;
  cudaStream_t s = exec.stream;
  if (T < 0) return absl::FailedPreconditionError("MoE layer backward before its forward");
  if (!activations_valid_) {
    return absl::FailedPreconditionError(
        "MoE layer backward: its activations were handed over; re-run its forward first");
  }
  const EpExchangePlan& x = exchange_;
  RouterAuxCudaArgs aux;
  aux.probs = probs_.as<float>();
  aux.logsumexp = lse_.as<float>();
  aux.mask = mask;
  aux.tokens = T;
  aux.experts = E;
  aux.top_k = K;
  aux.alpha_z = losses.alpha_z;
  aux.alpha_b = losses.alpha_b;
  aux.sigmoid_scores = c.sigmoid_scores;
  aux.num_micro_batches = losses.num_micro_batches;
  aux.global_routed_tokens = losses.global_routed_tokens;
  aux.global_expert_counts = global_counts_.as<int64_t>();
  aux.local_gating_sums = gating_.as<double>();
  aux.z_loss = losses.z_loss;
  aux.balance_loss = losses.balance_loss;
  aux.accumulate_loss = true;
  GRADSUM_RETURN_IF_ERROR(RouterAuxLossCuda(aux, s));
  // Combine backward: rows' gradient (w * dy) and the combine weights' gradient.
  CombineCudaArgs comb;
  comb.dtype = DType::kF32;
  comb.width = D;
  comb.rows = acts_.back.get();
  comb.weights = weight_.as<float>();
  comb.d_out = dy;
  comb.d_rows = scratch->d_back.get();
  comb.d_weights = scratch->dw.as<float>();
  GRADSUM_RETURN_IF_ERROR(CombineBackwardCuda(comb, plan_, s));
  aux.expert_index = index_.as<int32_t>();
  aux.d_combine_weight = scratch->dw.as<float>();
  aux.norm_topk_prob = c.norm_topk_prob;
  aux.router_scale = c.router_scale;
  aux.logits = logits_.as<float>();  // the z-loss's softmax with sigmoid scores
  aux.d_logits = scratch->du.as<float>();
  aux.accumulate_grad = false;
  GRADSUM_RETURN_IF_ERROR(RouterBackwardCuda(aux, s));
  // Expert backward where the rows were computed, then the input gradients come home.
  GRADSUM_RETURN_IF_ERROR(AllToAll(exec, mesh.device_group(MeshAxis::kEp),
                                   scratch->d_back.as<float>(), x.send_counts, x.send_offsets,
                                   scratch->d_recv.as<float>(), x.recv_counts, x.recv_offsets));
  const int64_t block = El * D * H;
  const ExpertsCudaConfig ecfg = ExpertsConfig(c, El);
  const ExpertsCudaWeights ew = ExpertWeights(w, block);
  const ExpertsCudaWeightGrads eg{grads.local_experts, grads.local_experts + block,
                                  grads.local_experts + 2 * block};
  for (int p = 0; p < P; ++p) {
    const int64_t first = x.source_first_row[p];
    if (x.source_offsets[p][El] == 0) continue;
    const ExpertsCudaSaved saved{acts_.gate.as<float>() + first * H,
                                 acts_.up.as<float>() + first * H,
                                 acts_.hidden.as<float>() + first * H};
    GRADSUM_RETURN_IF_ERROR(ExpertsBackwardCuda(
        *exec.blas, s, ecfg, ew, acts_.recv.as<float>() + first * D, x.source_offsets[p], saved,
        scratch->d_recv.as<float>() + first * D, scratch->dx_recv.as<float>() + first * D, eg));
  }
  GRADSUM_RETURN_IF_ERROR(AllToAll(exec, mesh.device_group(MeshAxis::kEp),
                                   scratch->dx_recv.as<float>(), x.recv_counts, x.recv_offsets,
                                   scratch->d_send.as<float>(), x.send_counts, x.send_offsets));
  // The gather's backward: da[t] = sum_k d_send[pos(t, k)].
  CombineCudaArgs g;
  g.dtype = DType::kF32;
  g.width = D;
  g.rows = scratch->d_send.get();
  g.weights = nullptr;
  g.out = da;
  g.accumulate = false;
  GRADSUM_RETURN_IF_ERROR(CombineCuda(g, plan_, s));
  // Router GEMM backward: dWr += a^T du; da += du Wr^T.
  GRADSUM_RETURN_IF_ERROR(GemmRowMajor(*exec.blas, s, true, false, D, E, T, a, D, scratch->du.get(),
                                       E, DType::kF32, grads.router, E, DType::kF32, 1.0f));
  return GemmRowMajor(*exec.blas, s, false, true, T, D, E, scratch->du.get(), E, w.router, E,
                      DType::kF32, da, D, DType::kF32, 1.0f);
}

}  // namespace gradsum::moe
