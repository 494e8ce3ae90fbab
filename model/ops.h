#ifndef GRADSUM_MODEL_OPS_H_
#define GRADSUM_MODEL_OPS_H_

// One device's kernels for the model's layers: the declaration that model/moe_lm.h composes
// the model from, once, and that each device implements (model/cpu_ops.h on the host,
// model/cuda/cuda_ops.h on a GPU). A new layer type adds its forward and backward here and
// in each device's ops; its place in the model is written once, in model/moe_lm.cc.
//
// Pointers are the device's memory (DeviceArray, ModelParams::Values) unless a comment
// says host. Calls run in order on the rank's thread; a device may enqueue them
// asynchronously, so results are only guaranteed on the host after End().
//
// One micro-batch:
//   ops.Begin(inputs);                       // tokens, labels, mask, CE weights, D, N, G
//   ... the stages' calls (model/moe_lm.cc) ...
//   GRADSUM_ASSIGN_OR_RETURN(MicroBatchLossTerms terms, ops.End());
//
// Row blocks (MicroBatchInputs::row_block): 0 lets a kernel treat the T tokens as one block;
// > 0 asks every per-token value and every weight-gradient contribution to be computed per
// block of that many rows (a packed sequence), so that its bits do not depend on which
// other sequences share the micro-batch (the exact gradient precision asks for this,
// core/grad_sink.h). A device that cannot (CUDA) refuses it in Begin.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "collectives/mesh.h"
#include "core/grad_sink.h"
#include "data/streams.h"

namespace gradsum::model {

// A float array in the device's memory, owned. Its contents are unspecified when allocated.
class DeviceArray {
 public:
  virtual ~DeviceArray() = default;
  float* data() const { return data_; }
  int64_t size() const { return size_; }

 protected:
  float* data_ = nullptr;
  int64_t size_ = 0;
};

// One micro-batch's inputs (host memory; valid until End()). With sequence parallelism
// (SEMANTICS.md §12) the rank holds `local_seq_len = seq_len / S` consecutive tokens of each
// of its `sequences`; T = sequences * local_seq_len.
struct MicroBatchInputs {
  int64_t rows = 0;       // T tokens
  int64_t row_block = 0;  // see above; > 0 divides rows
  // An evaluation (forward stages and LmHeadLoss only): no extra label streams are
  // expected, and nothing of backward runs.
  bool forward_only = false;
  absl::Span<const int32_t> tokens;  // [T] in [0, V)
  absl::Span<const int32_t> labels;  // [T] in [0, V) or data::kIgnoreIndex
  absl::Span<const int32_t> mask;    // [T] 1 routed, 0 padding
  // The sequences' layout, for attention. positions[t]: the RoPE position of local token t
  // (from its document's first token). doc_start: for every token of the WHOLE sequences
  // (sequences * seq_len, in sequence order), the index within its sequence of its
  // document's first token, -1 for padding. Empty without attention.
  int64_t sequences = 0;
  int64_t seq_len = 0;                  // tokens of a whole sequence
  absl::Span<const int32_t> positions;  // [T]
  absl::Span<const int32_t> doc_start;  // [sequences * seq_len]
  absl::Span<const float> ce_weights;   // [T] w_t (SEMANTICS.md §3), empty in token mode
  double global_ce_weight_sum = 0;      // D (§3)
  int64_t global_routed_tokens = 0;     // N (§4)
  int num_micro_batches = 1;            // G (§5)
  // The label streams beyond stream 0 (tokens, labels, ce_weights and D above; data/streams.h:
  // stream j predicts the token j + 1 ahead), stream j at index j - 1, empty when the model
  // has none: its input tokens x_j [T] (rolled on the whole sequences), its labels y_j [T],
  // its CE weights [T] (empty in token mode), and the normaliser its CE divides by (the
  // model's choice).
  struct Stream {
    absl::Span<const int32_t> tokens;
    absl::Span<const int32_t> labels;
    absl::Span<const float> ce_weights;
    double ce_normaliser = 0;
  };
  std::vector<Stream> extra_streams;
};

// Every device's check of a micro-batch's extra label streams against the `count` the model
// expects: each stream's tokens and labels (and CE weights, unless empty) [rows] long.
// InvalidArgument naming the stream otherwise.
absl::Status CheckStreamInputs(const MicroBatchInputs& in, int count);

// Every device's check of a stream index a call names (EmbeddingForward, LmHeadCrossEntropy,
// ...): 0 (the main stream) or one of the micro-batch's extra streams. InvalidArgument
// naming the index otherwise.
absl::Status CheckStreamIndex(const MicroBatchInputs& in, int stream);

// A MoE layer's weights as the compute reads them: the router [D, E] (the same on every
// rank) and this rank's E_local = E / ep experts, stacked per matrix: all Wg [E_local, D, H],
// then all Wu, then all Wd [E_local, H, D] (moe/experts.h).
struct MoeWeights {
  const float* router = nullptr;
  const float* local_experts = nullptr;
  // The layer's expert bias [E] (SEMANTICS.md §5.1), HOST memory: added to the router
  // scores for the top-K selection only. Null: none (§10's routing). A device that cannot
  // route with a bias refuses it in MoeForward (Unimplemented); the CPU and CUDA ops both
  // route with it.
  const float* expert_bias = nullptr;
};

struct MoeGrads {
  GradTarget router;         // [D, E]
  GradTarget local_experts;  // the stacked layout above
};

// What a micro-batch computed for the logs (SEMANTICS.md §8), on the host after End().
struct MicroBatchLossTerms {
  // This rank's loss components (detached): L_ce[r, m], L_z[r, m], L_bal[r, m].
  double ce = 0, z = 0, bal = 0;
  // The output z-loss of SEMANTICS.md §3.2, alpha_lse * sum_t w_t lse_t^2 / D, when
  // alpha_lse > 0 (0 and z_out_terms empty otherwise). `ce` then excludes it: the LM
  // head's objective is ce + z_out.
  double z_out = 0;
  // The same values as the display adds them: one value per term for a single row block,
  // one per (layer, block) or block with row blocks, so that exact display sums see
  // per-sequence values (losses/display.h).
  std::vector<double> ce_terms, z_terms, bal_terms, z_out_terms;
  // Per extra label stream j (index j - 1): its head's local component and its display
  // values as above (a stream's output z-loss stays in its own term).
  std::vector<double> extra_ce;
  std::vector<std::vector<double>> extra_ce_terms;
  // Per MoE layer (MoeLmSpec::moe_layers()): c[l, m, :] of §5, global (every rank's SUM).
  std::vector<std::vector<int64_t>> global_expert_counts;
};

class ModelOps {
 public:
  virtual ~ModelOps() = default;

  virtual absl::StatusOr<std::unique_ptr<DeviceArray>> Allocate(int64_t numel) = 0;

  // Starts a micro-batch: takes its inputs (uploads them on a GPU). InvalidArgument for a
  // row_block the device does not support or that does not divide rows.
  virtual absl::Status Begin(const MicroBatchInputs& inputs) = 0;

  // out[i] = a[i] + b[i], i < n (out may alias a or b).
  virtual absl::Status Add(const float* a, const float* b, float* out, int64_t n) = 0;

  // h[t] = emb[x[t]] (emb [V, D], h [T, D]) for label stream `stream`'s input tokens x:
  // MicroBatchInputs::tokens for stream 0, extra_streams[stream - 1].tokens after it.
  virtual absl::Status EmbeddingForward(int stream, const float* emb, float* h) = 0;
  // demb[x[t]] += dh[t].
  virtual absl::Status EmbeddingBackward(int stream, const float* dh, GradTarget demb) = 0;

  // y[t] = x[t] * r_t * gain, r_t = 1 / sqrt(mean(x[t]^2) + eps), stored in inv_rms[t]
  // (SEMANTICS.md §10). x, y [T, D]; gain [D]; inv_rms [T].
  virtual absl::Status RmsNormForward(const float* x, const float* gain, float* y,
                                      float* inv_rms) = 0;
  // Given dy = dL/dy: dx = dL/dx (added into dx when accumulate_dx, else written), and
  // dL/dgain into dgain.
  virtual absl::Status RmsNormBackward(const float* x, const float* gain, const float* inv_rms,
                                       const float* dy, float* dx, bool accumulate_dx,
                                       GradTarget dgain) = 0;

  // MoE layer `layer` (router, dropless dispatch over the EP group, SwiGLU experts,
  // combine; SEMANTICS.md §10): y[t] = sum_k w_tk Expert_{i_tk}(a[t]), 0 for padding. Keeps
  // what backward needs, and starts the SUM of the layer's expert counts over the world
  // (§5). Collective over the EP group and the world.
  virtual absl::Status MoeForward(int layer, const float* a, const MoeWeights& w, float* y) = 0;
  // Its backward with the layer's router z-loss (§4) and balancing loss (§5): da = dL/da
  // (written), the weight gradients into `grads`. Collective over the EP group.
  virtual absl::Status MoeBackward(int layer, const float* a, const MoeWeights& w, const float* dy,
                                   float* da, MoeGrads grads) = 0;

  // ---- Full activation recomputation (model/moe_lm.h, Recompute::kFull). ----
  // Whether MoeRecomputeForward and ReleaseMoeActivations are implemented.
  virtual bool CanRecomputeMoe() const { return false; }
  // Re-runs layer `layer`'s dispatch, experts and combine on the same `a` and weights as
  // its MoeForward of this micro-batch, with the routing decisions that forward kept: no
  // router pass, and no count reduction (the §5 counts were started once, by MoeForward);
  // the dispatch exchange is re-done, deterministically, so what backward reads and y are
  // bit-identical to the first forward's. Collective over the EP group.
  virtual absl::Status MoeRecomputeForward(int layer, const float* a, const MoeWeights& w,
                                           float* y) {
    return absl::UnimplementedError("these ops cannot re-run a MoE layer's forward");
  }
  // Layer `layer`'s kept dispatch and expert activations are not needed before its next
  // MoeRecomputeForward (or forward): the ops may lend their memory to another layer. The
  // routing decisions and counts stay.
  virtual void ReleaseMoeActivations(int layer) {}

  // The head's fused LM-head matmul and CE (§3) of label stream `stream`, forward and
  // backward at once: logits = f @ w_out (f [T, D], w_out [D, V]); grad_f = dL_ce/df
  // (written), dL_ce/dw_out into grad_out. Never holds all T x V logits at once where the
  // device need not. Stream 0 reads the main labels, CE weights and D, and its value goes to
  // MicroBatchLossTerms::ce (and z_out); stream j > 0 reads extra_streams[j - 1] and its
  // value, its output z-loss included, goes to extra_ce[j - 1].
  virtual absl::Status LmHeadCrossEntropy(int stream, const float* f, const float* w_out,
                                          float* grad_f, GradTarget grad_out) = 0;
  // The same loss, forward only (an evaluation, MicroBatchInputs::forward_only): its value
  // (and z_out) into the terms as LmHeadCrossEntropy adds them, nothing else written.
  virtual absl::Status LmHeadLoss(const float* f, const float* w_out) = 0;

  // ---- The attention block (SEMANTICS.md §10). ----
  // y = x @ w: x [T, in], w [in, out], y [T, out] written.
  virtual absl::Status MatMul(const float* x, const float* w, int64_t in, int64_t out,
                              float* y) = 0;
  // Its backward given dy [T, out]: dx = dy @ w^T (added into dx when accumulate_dx, else
  // written), x^T dy into dw.
  virtual absl::Status MatMulBackward(const float* x, const float* w, int64_t in, int64_t out,
                                      const float* dy, float* dx, bool accumulate_dx,
                                      GradTarget dw) = 0;
  // RoPE in place on x [T, heads, head_dim] at the tokens' positions; `inverse` rotates by
  // the opposite angles (RoPE's backward: the transpose of a rotation).
  virtual absl::Status Rope(float* x, int heads, bool inverse) = 0;
  // ---- Attention's layouts (SEMANTICS.md §12). The exchanges that move them (sequence
  // parallelism's all-to-all) and context parallelism's ring are the attention block's,
  // model/parallel_attention.h: these kernels only pack and unpack this device's memory.
  // A head split over `parts` ranks gives each n_heads / parts query heads (Hl) of
  // sequences * seq_rows rows, seq_rows = parts * (T / sequences) per sequence.
  // send [parts][T, Hl, head_dim] (written): for part j, token t, slot hl, head j Hl + hl of
  // x [T, heads_in, head_dim] (heads_in = n_heads), or with `kv` (heads_in = n_kv_heads) the
  // key/value head that query head uses.
  virtual absl::Status PackHeads(const float* x, bool kv, int parts, float* send) = 0;
  // recv [parts][T, Hl, head_dim] (part i: rank i's T rows, L = seq_rows / parts per
  // sequence) -> out [sequences * seq_rows, Hl, head_dim]: part i's rows of sequence n at
  // rows [n seq_rows + i L, n seq_rows + (i + 1) L) (written).
  virtual absl::Status UnpackHeads(const float* recv, int parts, int64_t seq_rows, float* out) = 0;
  // The inverse pair: x [sequences * seq_rows, Hl, head_dim] -> send [parts][T, Hl,
  // head_dim], part j rows [n seq_rows + j L, ...) of each sequence n; and recv [parts][T,
  // Hl, head_dim] -> out [T, n_heads, head_dim], part i into heads [i Hl, (i + 1) Hl).
  virtual absl::Status PackTokens(const float* x, int parts, int64_t seq_rows, float* send) = 0;
  virtual absl::Status UnpackTokens(const float* recv, int parts, float* out) = 0;
  // recv[i] = rank i's send[me] for blocks of `block` floats, over the mesh's `axis` group
  // (all-to-all), in this device's memory and ordered after the calls before it (the
  // device picks its view of the group: host or NCCL). A copy of send[0] for a group of one.
  virtual absl::Status AllToAll(MeshAxis axis, const float* send, float* recv, int64_t block) = 0;
  // Whether DeviceArrays are host memory (the ring of model/ring_attention.h runs on the
  // host; a device without it cannot run context parallelism).
  virtual bool HostMemory() const { return false; }
  // out[t, j] = sum of x[t, h] over the query heads h of kv head j, in head order: x [T,
  // n_heads, head_dim] → out [T, n_kv_heads, head_dim] (written). (Per-query-head key and
  // value gradients summed the same way whatever S is.)
  virtual absl::Status SumKvGroups(const float* x, float* out) = 0;
  // Document-causal attention (§10) of `heads` query heads over whole sequences: q, k, v,
  // out [sequences * seq_len, heads, head_dim] (k, v: each query head's own key/value
  // head, as PackHeads with `kv` gives them); lse [sequences * seq_len, heads] kept for
  // backward.
  virtual absl::Status Attention(int heads, const float* q, const float* k, const float* v,
                                 float* out, float* lse) = 0;
  // Its backward: dq, dk, dv (per query head) written.
  virtual absl::Status AttentionBackward(int heads, const float* q, const float* k, const float* v,
                                         const float* out, const float* lse, const float* d_out,
                                         float* dq, float* dk, float* dv) = 0;

  // Ends the micro-batch: waits for the device and returns its loss terms and counts.
  virtual absl::StatusOr<MicroBatchLossTerms> End() = 0;
  // After a failed micro-batch: drops what is in flight (the step is lost).
  virtual void Abandon() {}

  // The bytes of the activation buffers these ops hold now between calls (what forward
  // keeps for backward, per layer, and the per-token workspaces they reuse): the buffers'
  // capacities, counted, not estimated. Temporaries that live only inside one call are
  // not held, and per-expert bookkeeping ([E]-sized) is not an activation. 0 for a device
  // that does not count its own (the model counts the DeviceArrays it allocates itself).
  virtual int64_t HeldActivationBytes() const { return 0; }
  // The most bytes the training LM head's cross-entropy held inside one call since the last
  // Take, and resets it: the fused linear CE's logits chunk and row scratch
  // (losses::LinearCrossEntropyResult::peak_scratch_bytes); with row blocks, the largest
  // block's times the blocks that run at once. Apart from HeldActivationBytes: it lives only
  // inside the call; a bound on the head's working set that shows it never holds the
  // [T, V] logits. 0 for ops that do not count it (the CUDA ops).
  virtual int64_t TakePeakHeadScratchBytes() { return 0; }
};

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_OPS_H_
