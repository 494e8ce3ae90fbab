#include "collectives/op_descriptor.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace gradsum::collectives_internal {
namespace {

enum Field { kInvalidRank = 0, kKind, kDType, kOp, kCount, kRoot, kAsync };

const char* FieldName(int f) {
  switch (f) {
    case kInvalidRank:
      return "argument validity";
    case kKind:
      return "the operation";
    case kDType:
      return "the dtype";
    case kOp:
      return "the reduce op";
    case kCount:
      return "the element count";
    case kRoot:
      return "the root";
    case kAsync:
      return "sync versus async";
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
    case kOp:
      return ReduceOpName(static_cast<ReduceOp>(v));
    case kAsync:
      return v != 0 ? "async" : "sync";
    default:
      return absl::StrCat(v);
  }
}

void Fields(const OpDescriptor& d, int64_t* f) {
  f[kInvalidRank] = d.invalid_rank;
  f[kKind] = static_cast<int64_t>(d.kind);
  f[kDType] = static_cast<int64_t>(d.dtype);
  f[kOp] = static_cast<int64_t>(d.op);
  f[kCount] = d.count;
  f[kRoot] = d.root;
  f[kAsync] = d.async ? 1 : 0;
}

// [begin, end) byte ranges; true if both are non-empty and intersect.
bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a);
  const auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

const char* At(const void* p, size_t off_bytes) { return static_cast<const char*>(p) + off_bytes; }

absl::Status Invalid(OpKind k, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(OpKindName(k), ": ", what));
}

absl::Status NeedBuffer(OpKind k, const void* p, const char* what, size_t n) {
  if (p == nullptr && n > 0) {
    return Invalid(k, absl::StrCat(what, " buffer is null with ", n, " elements to move"));
  }
  return absl::OkStatus();
}

absl::Status ValidateAllToAllV(const OpCall& a, int w, size_t max_count, size_t elem) {
  const size_t n = static_cast<size_t>(w);
  if (a.send_counts.size() != n || a.send_offsets.size() != n || a.recv_counts.size() != n ||
      a.recv_offsets.size() != n) {
    return Invalid(a.kind,
                   absl::StrCat("needs size() = ", n, " entries per span; got send_counts ",
                                a.send_counts.size(), ", send_offsets ", a.send_offsets.size(),
                                ", recv_counts ", a.recv_counts.size(), ", recv_offsets ",
                                a.recv_offsets.size()));
  }
  size_t send_total = 0, recv_total = 0;
  for (size_t p = 0; p < n; ++p) {
    for (const bool is_send : {true, false}) {
      const size_t off = is_send ? a.send_offsets[p] : a.recv_offsets[p];
      const size_t cnt = is_send ? a.send_counts[p] : a.recv_counts[p];
      if (cnt > max_count || off > max_count) {
        return Invalid(
            a.kind, absl::StrCat(is_send ? "send" : "recv", " block for peer ", p, " (offset ", off,
                                 ", count ", cnt, ") exceeds the backend's limit of ", max_count,
                                 " elements"));
      }
    }
    send_total += a.send_counts[p];
    recv_total += a.recv_counts[p];
  }
  GRADSUM_RETURN_IF_ERROR(NeedBuffer(a.kind, a.send, "send", send_total));
  GRADSUM_RETURN_IF_ERROR(NeedBuffer(a.kind, a.recv, "recv", recv_total));
  // Receive blocks must not overlap each other; nothing sent may overlap anything received.
  // Sorted by offset only when some block could overlap another (w > 1).
  if (n > 1) {
    std::vector<std::pair<size_t, size_t>> recv_ranges;
    recv_ranges.reserve(n);
    for (size_t p = 0; p < n; ++p) {
      if (a.recv_counts[p] > 0) {
        recv_ranges.push_back({a.recv_offsets[p], a.recv_offsets[p] + a.recv_counts[p]});
      }
    }
    std::sort(recv_ranges.begin(), recv_ranges.end());
    for (size_t i = 1; i < recv_ranges.size(); ++i) {
      if (recv_ranges[i].first < recv_ranges[i - 1].second) {
        return Invalid(
            a.kind, absl::StrCat("recv blocks overlap: [", recv_ranges[i - 1].first, ", ",
                                 recv_ranges[i - 1].second, ") and [", recv_ranges[i].first, ", ",
                                 recv_ranges[i].second, ")"));
      }
    }
  }
  for (size_t p = 0; p < n; ++p) {
    for (size_t q = 0; q < n; ++q) {
      if (Overlaps(At(a.send, a.send_offsets[p] * elem), a.send_counts[p] * elem,
                   At(a.recv, a.recv_offsets[q] * elem), a.recv_counts[q] * elem)) {
        return Invalid(a.kind,
                       absl::StrCat("send block for peer ", p, " overlaps recv block from peer ", q,
                                    " (in place is not supported)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool HasDType(OpKind k) { return k != OpKind::kBarrier && k != OpKind::kSplit; }
bool HasCount(OpKind k) {
  return k == OpKind::kAllReduce || k == OpKind::kReduceScatter || k == OpKind::kAllGather ||
         k == OpKind::kBroadcast;
}
bool HasReduceOp(OpKind k) { return k == OpKind::kAllReduce || k == OpKind::kReduceScatter; }

std::string PointToPointLabel(bool send, int peer, int tag) {
  std::string label = absl::StrCat(send ? "send to rank " : "recv from rank ", peer);
  if (tag != 0) absl::StrAppend(&label, " tag ", tag);
  return label;
}

absl::Status ValidatePointToPoint(bool send, const void* buf, size_t count, DType dtype, int peer,
                                  int tag, int size, size_t max_count) {
  const auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(PointToPointLabel(send, peer, tag), ": ", what));
  };
  if (!IsValidDType(static_cast<int>(dtype))) {
    return invalid(absl::StrCat("invalid dtype value ", static_cast<int>(dtype)));
  }
  if (peer < 0 || peer >= size) {
    return invalid(absl::StrCat("peer ", peer, " is outside [0, ", size, ")"));
  }
  if (tag < 0 || tag > Communicator::kMaxTag) {
    return invalid(absl::StrCat("tag ", tag, " is outside [0, ", Communicator::kMaxTag, "]"));
  }
  max_count = std::min(max_count, std::numeric_limits<size_t>::max() / 16);
  if (count > max_count) {
    return invalid(
        absl::StrCat("count ", count, " exceeds the backend's limit of ", max_count, " elements"));
  }
  if (buf == nullptr && count > 0) {
    return invalid(absl::StrCat("null buffer with count ", count));
  }
  return absl::OkStatus();
}

absl::Status ValidateCall(const OpCall& a, int rank, int size, size_t max_count) {
  const size_t w = static_cast<size_t>(size);
  if (HasDType(a.kind) && !IsValidDType(static_cast<int>(a.dtype))) {
    return Invalid(a.kind, absl::StrCat("invalid dtype value ", static_cast<int>(a.dtype)));
  }
  const size_t elem = HasDType(a.kind) ? DTypeSize(a.dtype) : 1;
  // No byte count below may overflow: limit counts so that count * size() * elem fits.
  max_count = std::min(max_count, std::numeric_limits<size_t>::max() / 16 / w);
  if (HasCount(a.kind) && a.count > max_count) {
    return Invalid(a.kind, absl::StrCat("count ", a.count, " exceeds the backend's limit of ",
                                        max_count, " elements"));
  }
  if (HasReduceOp(a.kind)) {
    if (a.op != ReduceOp::kSum && a.op != ReduceOp::kAvg && a.op != ReduceOp::kMax) {
      return Invalid(a.kind, absl::StrCat("invalid reduce op value ", static_cast<int>(a.op)));
    }
    if (a.kind == OpKind::kReduceScatter && a.op == ReduceOp::kMax) {
      return Invalid(a.kind, "supports sum and avg, not max");
    }
    if (a.op == ReduceOp::kAvg && !IsFloating(a.dtype)) {
      return Invalid(a.kind, absl::StrCat("avg needs a floating dtype, got ", DTypeName(a.dtype)));
    }
  }
  switch (a.kind) {
    case OpKind::kAllReduce: {
      GRADSUM_RETURN_IF_ERROR(NeedBuffer(a.kind, a.send, "send", a.count));
      GRADSUM_RETURN_IF_ERROR(NeedBuffer(a.kind, a.recv, "recv", a.count));
      const size_t bytes = a.count * elem;
      if (a.send != a.recv && Overlaps(a.send, bytes, a.recv, bytes)) {
        return Invalid(a.kind,
                       "send and recv overlap without being equal (in place is send == recv)");
      }
      break;
    }
    case OpKind::kReduceScatter:
    case OpKind::kAllGather: {
      const bool rs = a.kind == OpKind::kReduceScatter;
      const size_t full = a.count * w;
      GRADSUM_RETURN_IF_ERROR(NeedBuffer(a.kind, a.send, "send", rs ? full : a.count));
      GRADSUM_RETURN_IF_ERROR(NeedBuffer(a.kind, a.recv, "recv", rs ? a.count : full));
      const void* full_buf = rs ? a.send : a.recv;
      const void* block = rs ? a.recv : a.send;
      if (!IsInPlace(a, rank) && Overlaps(full_buf, full * elem, block, a.count * elem)) {
        return Invalid(a.kind, absl::StrCat("buffers overlap; in place needs ",
                                            rs ? "recv == send + rank * recv_count"
                                               : "send == recv + rank * send_count",
                                            " (rank ", rank, ")"));
      }
      break;
    }
    case OpKind::kAllToAllV:
      return ValidateAllToAllV(a, size, max_count, elem);
    case OpKind::kBroadcast:
      if (a.root < 0 || a.root >= size) {
        return Invalid(a.kind, absl::StrCat("root ", a.root, " is outside [0, ", size, ")"));
      }
      GRADSUM_RETURN_IF_ERROR(NeedBuffer(a.kind, a.recv, "buf", a.count));
      break;
    case OpKind::kBarrier:
    case OpKind::kSplit:
      break;
  }
  return absl::OkStatus();
}

absl::Status CheckEachBuffer(const OpCall& c, int size,
                             absl::FunctionRef<absl::Status(const void*)> check) {
  const size_t w = static_cast<size_t>(size);
  // One buffer of `count` elements; `side` is "send", "recv" or "" (formatted on failure only).
  auto one = [&](const void* p, size_t count, const char* side) -> absl::Status {
    if (count == 0) return absl::OkStatus();
    auto what = [&] {
      return *side == '\0' ? std::string(OpKindName(c.kind))
                           : absl::StrCat(OpKindName(c.kind), " ", side);
    };
    if (p == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), " buffer is null with ", count, " elements"));
    }
    absl::Status s = check(p);
    if (s.ok()) return s;
    return absl::InvalidArgumentError(absl::StrCat(what(), " buffer ", s.message()));
  };
  switch (c.kind) {
    case OpKind::kAllReduce:
      GRADSUM_RETURN_IF_ERROR(one(c.send, c.count, "send"));
      return one(c.recv, c.count, "recv");
    case OpKind::kReduceScatter:
      GRADSUM_RETURN_IF_ERROR(one(c.send, c.count * w, "send"));
      return one(c.recv, c.count, "recv");
    case OpKind::kAllGather:
      GRADSUM_RETURN_IF_ERROR(one(c.send, c.count, "send"));
      return one(c.recv, c.count * w, "recv");
    case OpKind::kAllToAllV: {
      size_t send_end = 0, recv_end = 0;
      for (size_t p = 0; p < w; ++p) {
        send_end = std::max(send_end, c.send_offsets[p] + c.send_counts[p]);
        recv_end = std::max(recv_end, c.recv_offsets[p] + c.recv_counts[p]);
      }
      GRADSUM_RETURN_IF_ERROR(one(c.send, send_end, "send"));
      return one(c.recv, recv_end, "recv");
    }
    case OpKind::kBroadcast:
      return one(c.recv, c.count, "");
    case OpKind::kBarrier:
    case OpKind::kSplit:
      break;
  }
  return absl::OkStatus();
}

OpCall MakeCall(OpKind kind, const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  OpCall c;
  c.kind = kind;
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.dtype = dtype;
  c.op = op;
  return c;
}

OpCall MakeBroadcastCall(void* buf, size_t count, DType dtype, int root) {
  OpCall c = MakeCall(OpKind::kBroadcast, nullptr, buf, count, dtype);
  c.root = root;
  return c;
}

OpCall MakeAllToAllVCall(const void* send, absl::Span<const size_t> send_counts,
                         absl::Span<const size_t> send_offsets, void* recv,
                         absl::Span<const size_t> recv_counts,
                         absl::Span<const size_t> recv_offsets, DType dtype) {
  OpCall c = MakeCall(OpKind::kAllToAllV, send, recv, 0, dtype);
  c.send_counts = send_counts;
  c.send_offsets = send_offsets;
  c.recv_counts = recv_counts;
  c.recv_offsets = recv_offsets;
  return c;
}

bool IsInPlace(const OpCall& a, int rank) {
  switch (a.kind) {
    case OpKind::kAllReduce:
      return a.send == a.recv;
    case OpKind::kReduceScatter:
      return a.recv == At(a.send, static_cast<size_t>(rank) * a.count * DTypeSize(a.dtype));
    case OpKind::kAllGather:
      return a.send == At(a.recv, static_cast<size_t>(rank) * a.count * DTypeSize(a.dtype));
    default:
      return false;
  }
}

OpDescriptor Describe(const OpCall& c) {
  OpDescriptor d;
  d.kind = c.kind;
  d.dtype = HasDType(c.kind) ? c.dtype : DType::kF32;
  d.op = HasReduceOp(c.kind) ? c.op : ReduceOp::kSum;
  d.count = HasCount(c.kind) ? static_cast<int64_t>(c.count) : 0;
  d.root = c.kind == OpKind::kBroadcast ? c.root : -1;
  return d;
}

const char* OpKindName(OpKind k) {
  switch (k) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kAllToAllV:
      return "all_to_all_v";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kSplit:
      return "split";
  }
  return "invalid";
}

void EncodeDescriptor(const OpDescriptor& d, int64_t* out) {
  int64_t f[kDescriptorFields];
  Fields(d, f);
  for (int i = 0; i < kDescriptorFields; ++i) {
    out[i] = -f[i];
    out[kDescriptorFields + i] = f[i];
  }
}

bool DescriptorAgreed(const int64_t* reduced) {
  if (HighestInvalidRank(reduced) >= 0) return false;
  for (int f = 0; f < kDescriptorFields; ++f) {
    if (-reduced[f] != reduced[kDescriptorFields + f]) return false;
  }
  return true;
}

int64_t HighestInvalidRank(const int64_t* reduced) {
  return reduced[kDescriptorFields + kInvalidRank];
}

absl::Status CheckDescriptorAgreed(const OpDescriptor& d, const int64_t* reduced,
                                   absl::string_view label, absl::string_view invalid_message) {
  int64_t mine[kDescriptorFields];
  Fields(d, mine);
  const int64_t highest_invalid = HighestInvalidRank(reduced);
  if (highest_invalid >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": rank ", highest_invalid, " passed invalid arguments to its ", OpKindName(d.kind),
        invalid_message.empty() ? " (see that rank's error)" : ": ", invalid_message));
  }
  for (int f = 0; f < kDescriptorFields; ++f) {
    const int64_t lo = -reduced[f], hi = reduced[kDescriptorFields + f];
    if (lo == hi) continue;
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": ranks disagree on ", FieldName(f), ": ", FieldValue(f, lo), " vs ",
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
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": counts disagree: rank ", reports[r], " sends ", reports[r + 1],
                     " elements to rank ", rank, ", but rank ", rank, " expects ", reports[r + 2]));
  }
  return absl::OkStatus();
}

}  // namespace gradsum::collectives_internal
