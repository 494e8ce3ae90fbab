#ifndef GRADSUM_MODEL_RING_ATTENTION_H_
#define GRADSUM_MODEL_RING_ATTENTION_H_

// Context parallelism (SEMANTICS.md §16): the document-causal attention of model/attention.h
// over sequences split among the C ranks of a CP group, forward and backward.
//
// The zigzag layout. Each sequence of seq_len tokens is cut into 2C chunks of c = seq_len /
// 2C tokens; rank i of the group holds chunks i and 2C-1-i, in that order, so every rank has
// the same causal work (data/shard.h: ZigzagIndex, the layout the data loader fills).
// q, k, v, out, d_out, dq, dk, dv are [num_seqs * 2c, heads, head_dim] in that local order;
// lse [num_seqs * 2c, heads]. doc_start is the WHOLE sequences' (num_seqs * seq_len entries,
// model/attention.h), which every rank of the group has. k, v, dk, dv are
// [num_seqs * 2c, kv_heads, head_dim]: with kv_heads = heads each query head has its own
// key/value head; with fewer (GQA), query head h reads kv head h / (heads / kv_heads), the
// ring carries only the kv_heads distinct heads (heads / kv_heads times fewer bytes), and
// dk, dv sum over each kv head's query heads.
//
// Two schedules, one result to rounding:
// - kRing (the default). Key/value blocks rotate around the group: at step s = 0..C-1
//   rank i holds rank (i - s) mod C's chunks; the next step's arrive (an all-to-all with one
//   peer, started before this step's work) while this step's pairs are computed. Each pair
//   (query chunk, key chunk) that causality leaves non-empty updates an online softmax
//   (model/attention_kernels.h, AttentionPairForwardTask), merged in arrival order; inside a
//   pair, 64-token blocks the document mask leaves empty are skipped. Backward rotates the
//   key/value blocks the same way with their dK/dV accumulators: each rank adds its queries'
//   contributions to the accumulator it holds and passes it on, and after C passes the
//   accumulator is home, every contribution added exactly once. Memory per rank: 1/C of the
//   whole sequences' attention activations, plus two key/value blocks in flight.
// - kGathered (reproducible mode, §11). One kv head (and its query heads) at a time, each rank
//   all-gathers the group's q, k, v (forward; backward also out, lse, d_out), runs
//   AttentionForward / AttentionBackward on the whole sequences (the whole-sequence kernel's
//   results are per sequence and kv head, so these calls give the bits of the one call a
//   group of one makes) and keeps its own rows. Its bits are those of C = 1 at every C; its
//   attention work is not divided by C, and it holds one kv head's whole sequences at once.
//
// Errors: InvalidArgument naming the value for a seq_len that 2C does not divide, sizes
// that do not match the layout, or a bad doc_start (as model/attention.h); the group's
// failures (a peer that fails or times out) come back as its status. The check on sizes
// and C happens before any communication, and every rank of a group passes the same sizes,
// so a bad argument fails on every rank before the first exchange.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"

namespace gradsum::model {

struct RingAttentionDims {
  int64_t num_seqs = 0;  // sequences
  int64_t seq_len = 0;   // tokens of a whole sequence; 2C must divide it
  int heads = 0;         // query heads held
  int kv_heads = 0;      // key/value heads held, dividing heads; 0 means heads
  int64_t head_dim = 0;
};

enum class RingSchedule { kRing, kGathered };

// Where the time of one call went (seconds, on the calling thread).
struct RingAttentionTimes {
  double compute_s = 0;  // the pair kernels (and, gathered, the whole-sequence kernel)
  double wait_s = 0;     // waiting for the group's exchanges: the exposed communication
  int64_t bytes_sent = 0;
  // The most bytes of working buffers one call held at once (their sizes, counted, not
  // estimated: the ring's softmax state, accumulators and the blocks in flight, or the
  // gathered whole sequences; the kernels' per-task scratch included), the largest over
  // the calls that shared this struct. The caller's inputs and outputs are not counted.
  int64_t peak_buffer_bytes = 0;
};

absl::Status RingAttentionForward(Communicator& cp_group, const RingAttentionDims& dims,
                                  RingSchedule schedule, absl::Span<const float> q,
                                  absl::Span<const float> k, absl::Span<const float> v,
                                  absl::Span<const int32_t> doc_start, absl::Span<float> out,
                                  absl::Span<float> lse, RingAttentionTimes* times = nullptr);

// Given d_out = dL/dout and the forward's out and lse: writes dq, dk, dv of this rank's
// rows (dk, dv: the sum over every rank's queries).
absl::Status RingAttentionBackward(Communicator& cp_group, const RingAttentionDims& dims,
                                   RingSchedule schedule, absl::Span<const float> q,
                                   absl::Span<const float> k, absl::Span<const float> v,
                                   absl::Span<const int32_t> doc_start, absl::Span<const float> out,
                                   absl::Span<const float> lse, absl::Span<const float> d_out,
                                   absl::Span<float> dq, absl::Span<float> dk, absl::Span<float> dv,
                                   RingAttentionTimes* times = nullptr);

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_RING_ATTENTION_H_
