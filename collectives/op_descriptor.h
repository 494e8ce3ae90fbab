#ifndef GRADSUM_COLLECTIVES_OP_DESCRIPTOR_H_
#define GRADSUM_COLLECTIVES_OP_DESCRIPTOR_H_

// What every backend shares about one collective call (an implementation detail of
// collectives/, not an API for callers): the call's arguments (OpCall), the one local
// argument check every backend runs before any exchange (ValidateCall), and the
// cross-rank agreement check on a small fixed-size descriptor.
//
// Agreement: before moving data, every rank all-reduces its operation's descriptor
// encoded as (-d, d) with MAX, which yields each field's minimum (negated) and maximum
// over the ranks. A field whose minimum and maximum differ is a disagreement; every rank
// sees the same reduced values, so every rank reaches the same verdict and reports the
// same message.
//
//   int64_t buf[kDescriptorWords];
//   EncodeDescriptor(d, buf);
//   ... all-reduce buf with MAX over int64 ...
//   if (!DescriptorAgreed(buf)) return CheckDescriptorAgreed(d, buf, label);

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "core/dtype.h"

namespace gradsum::collectives_internal {

enum class OpKind : int64_t {
  kAllReduce = 0,
  kReduceScatter,
  kAllGather,
  kAllToAllV,
  kBroadcast,
  kBarrier,
  kSplit,
};

// "all_reduce", "reduce_scatter", ... (the thread backend's names).
const char* OpKindName(OpKind k);

// One rank's arguments to one collective.
struct OpCall {
  OpKind kind = OpKind::kBarrier;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  // all-reduce: count; reduce-scatter: recv_count; all-gather: send_count; broadcast: count.
  size_t count = 0;
  int root = 0;
  const void* send = nullptr;
  void* recv = nullptr;  // broadcast: the buffer
  // all-to-all-v only (each size() entries).
  absl::Span<const size_t> send_counts, send_offsets, recv_counts, recv_offsets;
};

// Builders for the calls of each shape (every backend's entry points use these).
OpCall MakeCall(OpKind kind, const void* send, void* recv, size_t count, DType dtype,
                ReduceOp op = ReduceOp::kSum);
OpCall MakeBroadcastCall(void* buf, size_t count, DType dtype, int root);
OpCall MakeAllToAllVCall(const void* send, absl::Span<const size_t> send_counts,
                         absl::Span<const size_t> send_offsets, void* recv,
                         absl::Span<const size_t> recv_counts,
                         absl::Span<const size_t> recv_offsets, DType dtype);

// Checks one rank's own arguments, before any exchange, the same way on every backend
// (the rules of communicator.h): a valid dtype and reduce op (reduce-scatter: no MAX; AVG
// needs a floating dtype), no null buffer with elements, the in-place conventions and no
// other overlap, a broadcast root inside [0, size), all-to-all-v spans of size() entries
// with non-overlapping receive blocks and no send block overlapping a receive block.
// `max_count` is the backend's limit on any count or offset in elements
// (Communicator::max_count(); MPI: INT_MAX).
// Returns OK without formatting anything, or InvalidArgument "<operation>: <what>"
// naming the offending value.
absl::Status ValidateCall(const OpCall& c, int rank, int size,
                          size_t max_count = std::numeric_limits<size_t>::max());

// The one local check of a point-to-point call (Communicator::SendAsync / RecvAsync) on
// every backend: a valid dtype, count <= max_count, no null buffer with elements, peer in
// [0, size), tag in [0, Communicator::kMaxTag]. InvalidArgument "send to rank P: <what>"
// (or "recv from rank P: ...") naming the value, OK otherwise (formats nothing then).
absl::Status ValidatePointToPoint(bool send, const void* buf, size_t count, DType dtype, int peer,
                                  int tag, int size,
                                  size_t max_count = std::numeric_limits<size_t>::max());

// "send to rank 2" / "recv from rank 2" (tag appended when not 0: "... tag 5").
std::string PointToPointLabel(bool send, int peer, int tag);

// A backend's own rule for the buffers of a call (the nccl backend: device memory, through
// DeviceStream::CheckBuffer), after ValidateCall passed: runs `check` on every buffer of the
// call that has elements to move (all-to-all-v: the span of its blocks) and returns its
// first error as InvalidArgument "<operation> <side> buffer <check's message>", e.g.
// "all_reduce send buffer is host memory; the nccl backend needs device memory" (side
// "send" or "recv"; a broadcast's one buffer has none).
absl::Status CheckEachBuffer(const OpCall& c, int size,
                             absl::FunctionRef<absl::Status(const void*)> check);

// Which fields of an OpCall an operation kind uses (the rest are ignored and neither
// validated nor compared across ranks): the dtype (all but barrier and split), the element
// count (the four uniform collectives; all-to-all-v has per-peer counts) and the reduction
// (all-reduce and reduce-scatter).
bool HasDType(OpKind k);
bool HasCount(OpKind k);
bool HasReduceOp(OpKind k);

// True for reduce-scatter / all-gather calls that follow the in-place convention (my
// block of the full buffer is the small one); all-reduce with send == recv.
bool IsInPlace(const OpCall& c, int rank);

struct OpDescriptor {
  OpKind kind = OpKind::kBarrier;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int64_t count = 0;
  int64_t root = -1;
  // This rank's number when its own arguments failed the local checks (it still joins
  // the exchange so that its peers fail too instead of waiting); -1 otherwise.
  int64_t invalid_rank = -1;
  // Issued as an async operation (including the options forms with a per-call timeout,
  // which are async + Wait). A backend may run sync and async forms differently (the mpi
  // backend: blocking versus non-blocking MPI, which never match each other).
  bool async = false;
};

// The descriptor of a call (invalid_rank -1, async false).
OpDescriptor Describe(const OpCall& c);

// Invalid rank, kind, dtype, op, count, root, async; each twice (value, negated value).
inline constexpr int kDescriptorFields = 7;
inline constexpr int kDescriptorWords = 2 * kDescriptorFields;

// Fills out[0, kDescriptorWords) for a MAX all-reduce.
void EncodeDescriptor(const OpDescriptor& d, int64_t* out);

// True when the reduced descriptor shows full agreement and no invalid rank (formats
// nothing: the cheap test before CheckDescriptorAgreed builds a message).
bool DescriptorAgreed(const int64_t* reduced);

// The highest rank whose own arguments were invalid, or -1 (from the reduced descriptor).
int64_t HighestInvalidRank(const int64_t* reduced);

// `reduced` is the MAX all-reduce of every rank's EncodeDescriptor. Returns OK when all
// fields agree. Otherwise InvalidArgument: "<label>: rank R passed invalid arguments to its
// <op>: <invalid_message>" (R = HighestInvalidRank; `invalid_message` is that rank's own
// error, if the caller fetched it, else "(see that rank's error)"), else "<label>: ranks
// disagree on <field>: <min> vs <max> (this rank: <mine>)" for the first field that differs.
absl::Status CheckDescriptorAgreed(const OpDescriptor& d, const int64_t* reduced,
                                   absl::string_view label, absl::string_view invalid_message = {});

// All-to-all-v: rank r's send_counts[p] must equal rank p's recv_counts[r]. Each rank
// reports (first sender p whose count differs, or -1; what p sends; what this rank
// expects) and the reports of all ranks are gathered, rank-major, into `reports`
// (3 * size values). Returns InvalidArgument for the lowest reporting rank, else OK.
absl::Status CheckCountReports(absl::Span<const int64_t> reports, absl::string_view label);

// Fills report[0, 3) from what peers said they send (`incoming[p]`) and what this rank
// expects (`expected[p]`).
void MakeCountReport(absl::Span<const int64_t> incoming, absl::Span<const int64_t> expected,
                     int64_t* report);

}  // namespace gradsum::collectives_internal

#endif  // GRADSUM_COLLECTIVES_OP_DESCRIPTOR_H_
