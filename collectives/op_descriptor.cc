#include "collectives/op_descriptor.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace gradsum::collectives_internal {
namespace {

enum Field { kInvalidRank = 0, kKind, kDType, kOp, kCount, kRoot };

const char* FieldName(int f) {
  switch (f) {
    case kInvalidRank: return "argument validity";
    case kKind: return "the operation";
    case kDType: return "the dtype";
    case kOp: return "the reduce op";
    case kCount: return "the element count";
    case kRoot: return "the root";
  }
  return "?";
}

std::string FieldValue(int f, int64_t v) {
  switch (f) {
    case kKind:
      return v >= 0 && v <= static_cast<int64_t>(OpKind::kSplit)
                 ? OpKindName(static_cast<OpKind>(v))
                 : absl::StrCat(v);
    case kDType:
      return IsValidDType(static_cast<int>(v)) ? std::string(DTypeName(static_cast<DType>(v)))
                                               : absl::StrCat(v);
    case kOp: return ReduceOpName(static_cast<ReduceOp>(v));
    default: return absl::StrCat(v);
  }
}

void Fields(const OpDescriptor& d, int64_t* f) {
  f[kInvalidRank] = d.invalid_rank;
  f[kKind] = static_cast<int64_t>(d.kind);
  f[kDType] = static_cast<int64_t>(d.dtype);
  f[kOp] = static_cast<int64_t>(d.op);
  f[kCount] = d.count;
  f[kRoot] = d.root;
}

}  // namespace

const char* OpKindName(OpKind k) {
  switch (k) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kAllToAllV: return "all_to_all_v";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSplit: return "split";
  }
  return "invalid";
}

void EncodeDescriptor(const OpDescriptor& d, int64_t* out) {
  int64_t f[kDescriptorFields];
  Fields(d, f);
  for (int i = 0; i < kDescriptorFields; ++i) {
    out[i] = f[i];
    out[kDescriptorFields + i] = -f[i];
  }
}

absl::Status CheckDescriptorAgreed(const OpDescriptor& d, const int64_t* reduced,
                                   absl::string_view label) {
  int64_t mine[kDescriptorFields];
  Fields(d, mine);
  const int64_t highest_invalid = -reduced[kDescriptorFields + kInvalidRank];
  if (highest_invalid >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": rank ", highest_invalid,
                                                   " passed invalid arguments to its ",
                                                   OpKindName(d.kind), " (see that rank's error)"));
  }
  for (int f = 0; f < kDescriptorFields; ++f) {
    const int64_t lo = reduced[f], hi = -reduced[kDescriptorFields + f];
    if (lo == hi) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": ranks disagree on ", FieldName(f), ": ", FieldValue(f, lo), " vs ",
        FieldValue(f, hi), " (this rank: ", FieldValue(f, mine[f]), ")"));
  }
  return absl::OkStatus();
}

void MakeCountReport(absl::Span<const int64_t> incoming, absl::Span<const int64_t> expected,
                     int64_t* report) {
  report[0] = -1;
  report[1] = 0;
  report[2] = 0;
  for (size_t p = 0; p < incoming.size(); ++p) {
    if (incoming[p] != expected[p]) {
      report[0] = static_cast<int64_t>(p);
      report[1] = incoming[p];
      report[2] = expected[p];
      return;
    }
  }
}

absl::Status CheckCountReports(absl::Span<const int64_t> reports, absl::string_view label) {
  for (size_t r = 0; r + 2 < reports.size(); r += 3) {
    if (reports[r] < 0) continue;
    const size_t rank = r / 3;
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": counts disagree: rank ", reports[r], " sends ", reports[r + 1],
        " elements to rank ", rank, ", but rank ", rank, " expects ", reports[r + 2]));
  }
  return absl::OkStatus();
}

}  // namespace gradsum::collectives_internal
