#ifndef GRADSUM_MODEL_PARALLEL_ATTENTION_H_
#define GRADSUM_MODEL_PARALLEL_ATTENTION_H_

// The parallel side of the attention block: where the model's attention crosses ranks, in one
// place for every device. Sequence parallelism (Ulysses, SEMANTICS.md §12) turns the token
// split into a head split and back with all-to-alls over the mesh's SP group; context
// parallelism (§16) runs the attention of the head split over sequences cut in zigzag chunks
// among the CP group (model/ring_attention.h). A device implements only the compute these
// call (model/ops.h: PackHeads / UnpackHeads / PackTokens / UnpackTokens, AllToAll on its
// memory, Attention / AttentionBackward); the model (model/moe_lm.cc) calls this in place of
// the exchanges.
//
//   GRADSUM_ASSIGN_OR_RETURN(auto attention,
//                            ParallelAttention::Create(config, ops, {.mesh = &mesh}));
//   GRADSUM_RETURN_IF_ERROR(attention->Reserve(T));  // per row count
//   GRADSUM_RETURN_IF_ERROR(attention->Begin(inputs));  // per micro-batch, after ops.Begin
//   GRADSUM_RETURN_IF_ERROR(attention->TokensToHeads(q, /*kv=*/false, qh));  // k, v with kv
//   GRADSUM_RETURN_IF_ERROR(attention->Forward(qh, kh, vh, oh, lse));
//   GRADSUM_RETURN_IF_ERROR(attention->HeadsToTokens(oh, o));
//
// The ring runs on host memory (its pair kernels are the CPU's, model/attention_kernels.h):
// a device whose arrays are not (ModelOps::HostMemory) cannot run context parallelism, and
// Create says so (Unimplemented) rather than failing later.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/mesh.h"
#include "model/moe_lm_spec.h"
#include "model/ops.h"
#include "model/ring_attention.h"

namespace gradsum::model {

struct ParallelAttentionOptions {
  // The rank's mesh (not owned; it must outlive the block): its SP and CP axes. Null: one
  // rank holds whole sequences and every head.
  const Mesh* mesh = nullptr;
  // Reproducible mode (§11): attention's bits do not depend on how the sequences are split
  // (context parallelism gathers the group's chunks, model/ring_attention.h kGathered).
  bool reproducible = false;
};

class ParallelAttention {
 public:
  // `ops` is not owned and must outlive the block. InvalidArgument for heads the SP group
  // does not divide (Ulysses splits whole heads); Unimplemented for context parallelism on
  // ops whose memory is not the host's.
  static absl::StatusOr<std::unique_ptr<ParallelAttention>> Create(
      const MoeLmConfig& config, ModelOps* ops, const ParallelAttentionOptions& options);

  // Sizes the exchange buffers for micro-batches of `rows` tokens (never shrinks them).
  absl::Status Reserve(int64_t rows);
  // The bytes of the buffers it holds (their sizes).
  int64_t HeldBytes() const;

  // Takes a micro-batch's layout (inputs valid until its end): InvalidArgument, naming
  // the sizes, unless its rows are `sequences` sequences of seq_len / (the ranks sharing
  // them) tokens.
  absl::Status Begin(const MicroBatchInputs& in);

  // x [T, heads_in, head_dim] (this rank's tokens of every head: n_heads query heads, or
  // n_kv_heads with `kv`) -> out [sequences * seq_rows, Hl, head_dim]: this rank's Hl query
  // heads over the rows its head split holds (whole sequences, or with context parallelism
  // its chunks of them); for `kv` the key/value head each query head uses, repeated.
  absl::Status TokensToHeads(const float* x, bool kv, float* out);
  // The inverse: x [sequences * seq_rows, Hl, head_dim] -> out [T, n_heads, head_dim].
  absl::Status HeadsToTokens(const float* x, float* out);

  // Document-causal attention (§10) of the head split: q, k, v, out as TokensToHeads gives
  // them, lse [sequences * seq_rows, Hl] kept for Backward.
  absl::Status Forward(const float* q, const float* k, const float* v, float* out, float* lse);
  // Its backward: dq, dk, dv per query head (written).
  absl::Status Backward(const float* q, const float* k, const float* v, const float* out,
                        const float* lse, const float* d_out, float* dq, float* dk, float* dv);

 private:
  ParallelAttention(const MoeLmConfig& config, ModelOps* ops,
                    const ParallelAttentionOptions& options);

  int64_t HeadRows() const { return sequences_ * seq_rows_; }
  RingAttentionDims RingDims() const;
  absl::Status RingKv(const RingAttentionDims& rd, const float* k, const float* v,
                      absl::Span<const float>* kr, absl::Span<const float>* vr);

  MoeLmConfig config_;
  ModelOps* ops_;     // not owned
  const Mesh* mesh_;  // not owned; may be null
  int sp_ = 1, cp_ = 1;
  RingSchedule schedule_ = RingSchedule::kRing;
  int64_t head_dim_ = 0, heads_local_ = 0;
  int group_ = 1;  // query heads per kv head
  // The micro-batch: sequences, the whole sequence's tokens, the rows of each its head
  // split holds (seq_len / cp), and the whole sequences' document starts (host).
  int64_t rows_ = 0, sequences_ = 0, seq_len_ = 0, seq_rows_ = 0;
  absl::Span<const int32_t> doc_start_;
  // The exchanges' buffers in the device's memory ([T, D] each at any S).
  std::unique_ptr<DeviceArray> send_, recv_;
  // The ring's compacted key/value heads (GQA) and their gradients (host).
  std::vector<float> kc_, vc_, dkc_, dvc_;
};

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_PARALLEL_ATTENTION_H_
