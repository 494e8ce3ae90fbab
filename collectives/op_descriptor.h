#ifndef GRADSUM_COLLECTIVES_OP_DESCRIPTOR_H_
#define GRADSUM_COLLECTIVES_OP_DESCRIPTOR_H_

// The agreement check shared by the mpi and nccl backends (an implementation detail of
// collectives/, not an API for callers).
//
// Before moving data, every rank all-reduces its operation's descriptor encoded as
// (d, -d) with MIN, which yields each field's minimum and maximum over the ranks. A field
// whose minimum and maximum differ is a disagreement; every rank sees the same reduced
// values, so every rank reaches the same verdict and reports the same message.
//
//   int64_t buf[kDescriptorWords];
//   EncodeDescriptor(d, buf);
//   ... all-reduce buf with MIN over int64 ...
//   GRADSUM_RETURN_IF_ERROR(CheckDescriptorAgreed(d, buf, label));

#include <cstdint>

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

struct OpDescriptor {
  OpKind kind = OpKind::kBarrier;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int64_t count = 0;
  int64_t root = -1;
  // This rank's number when its own arguments failed the local checks (it still joins
  // the exchange so that its peers fail too instead of waiting); -1 otherwise.
  int64_t invalid_rank = -1;
};

// Invalid rank, kind, dtype, op, count, root; each twice (value, negated value).
inline constexpr int kDescriptorFields = 6;
inline constexpr int kDescriptorWords = 2 * kDescriptorFields;

// Fills out[0, kDescriptorWords) for a MIN all-reduce.
void EncodeDescriptor(const OpDescriptor& d, int64_t* out);

// `reduced` is the MIN all-reduce of every rank's EncodeDescriptor. Returns OK when all
// fields agree. Otherwise InvalidArgument: "<label>: rank R passed invalid arguments ..."
// (the highest such rank), else "<label>: ranks disagree on <field>: <min> vs <max> (this
// rank: <mine>)" for the first field that differs.
absl::Status CheckDescriptorAgreed(const OpDescriptor& d, const int64_t* reduced,
                                   absl::string_view label);

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
