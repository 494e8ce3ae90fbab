#include "collectives/conformance.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "core/half.h"
#include "core/status.h"

namespace gradsum::conformance {
namespace {

using Bytes = std::vector<uint8_t>;

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t Hash(uint64_t seed, uint64_t tag, int rank, uint64_t i) {
  return Mix(Mix(Mix(seed * 0x100000001b3ull ^ tag) + static_cast<uint64_t>(rank)) + i);
}

// Element access in double / int64 (exact for every dtype's values that we generate).
double LoadF(DType t, const uint8_t* base, size_t i) {
  switch (t) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, base + 4 * i, 4);
      return v;
    }
    case DType::kF64: {
      double v;
      std::memcpy(&v, base + 8 * i, 8);
      return v;
    }
    case DType::kBF16: {
      BF16 v;
      std::memcpy(&v, base + 2 * i, 2);
      return v.ToFloat();
    }
    case DType::kF16: {
      F16 v;
      std::memcpy(&v, base + 2 * i, 2);
      return v.ToFloat();
    }
    case DType::kI32: {
      int32_t v;
      std::memcpy(&v, base + 4 * i, 4);
      return v;
    }
    case DType::kI64: {
      int64_t v;
      std::memcpy(&v, base + 8 * i, 8);
      return static_cast<double>(v);
    }
  }
  return 0;
}

int64_t LoadI(DType t, const uint8_t* base, size_t i) {
  if (t == DType::kI32) {
    int32_t v;
    std::memcpy(&v, base + 4 * i, 4);
    return v;
  }
  int64_t v;
  std::memcpy(&v, base + 8 * i, 8);
  return v;
}

// Stores a float-typed value rounded into a 32-bit-or-narrower floating dtype.
void StoreFloat(DType t, uint8_t* base, size_t i, float v) {
  if (t == DType::kF32) std::memcpy(base + 4 * i, &v, 4);
  if (t == DType::kBF16) {
    BF16 b = BF16::FromFloat(v);
    std::memcpy(base + 2 * i, &b, 2);
  }
  if (t == DType::kF16) {
    F16 h = F16::FromFloat(v);
    std::memcpy(base + 2 * i, &h, 2);
  }
}

void StoreDouble(uint8_t* base, size_t i, double v) { std::memcpy(base + 8 * i, &v, 8); }

void StoreInt(DType t, uint8_t* base, size_t i, int64_t v) {
  if (t == DType::kI32) {
    const int32_t x = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(v)));
    std::memcpy(base + 4 * i, &x, 4);
  } else {
    std::memcpy(base + 8 * i, &v, 8);
  }
}

// Rank `rank`'s input for stream `tag`: n elements of dtype t.
Bytes MakeInput(DType t, const CheckOptions& o, int rank, uint64_t tag, size_t n) {
  Bytes b(n * DTypeSize(t));
  for (size_t i = 0; i < n; ++i) {
    const uint64_t h = Hash(o.seed, tag, rank, i);
    if (!o.rank_ordered_sums) {
      const int64_t small = static_cast<int64_t>(h % 17) - 8;  // exact everywhere
      if (IsFloating(t)) {
        if (t == DType::kF64)
          StoreDouble(b.data(), i, static_cast<double>(small));
        else
          StoreFloat(t, b.data(), i, static_cast<float>(small));
      } else {
        StoreInt(t, b.data(), i, small);
      }
    } else if (IsFloating(t)) {
      // Full-mantissa values over a few binades, so rounding order is visible.
      const double u = static_cast<double>(h >> 11) * 0x1p-53 * 2.0 - 1.0;
      const double v = std::ldexp(u, static_cast<int>(h & 7) - 3);
      if (t == DType::kF64)
        StoreDouble(b.data(), i, v);
      else
        StoreFloat(t, b.data(), i, static_cast<float>(v));
    } else {
      StoreInt(t, b.data(), i, static_cast<int64_t>(h));  // full range: SUM wraps
    }
  }
  return b;
}

// The reference reduction of element i over `ins` (ascending rank order), written to
// out[out_i]: SEMANTICS.md §7 (fp32 accumulation for bf16/f16/f32, fp64 for f64,
// rounded once; integers wrap; AVG = SUM / size; MAX propagates NaN).
void RefReduce(DType t, ReduceOp op, const std::vector<const uint8_t*>& ins, size_t i, uint8_t* out,
               size_t out_i) {
  const int w = static_cast<int>(ins.size());
  if (t == DType::kI32 || t == DType::kI64) {
    uint64_t sum = 0;
    int64_t max = LoadI(t, ins[0], i);
    for (int p = 0; p < w; ++p) {
      const int64_t v = LoadI(t, ins[p], i);
      sum += static_cast<uint64_t>(v);
      if (v > max) max = v;
    }
    StoreInt(t, out, out_i, op == ReduceOp::kMax ? max : static_cast<int64_t>(sum));
    return;
  }
  if (t == DType::kF64) {
    double acc = LoadF(t, ins[0], i);
    for (int p = 1; p < w; ++p) {
      const double v = LoadF(t, ins[p], i);
      if (op == ReduceOp::kMax)
        acc = (std::isnan(v) || v > acc) ? v : acc;
      else
        acc = acc + v;
    }
    if (op == ReduceOp::kAvg) acc = acc / w;
    StoreDouble(out, out_i, acc);
    return;
  }
  float acc = static_cast<float>(LoadF(t, ins[0], i));
  for (int p = 1; p < w; ++p) {
    const float v = static_cast<float>(LoadF(t, ins[p], i));
    if (op == ReduceOp::kMax)
      acc = (std::isnan(v) || v > acc) ? v : acc;
    else
      acc = acc + v;
  }
  if (op == ReduceOp::kAvg) acc = acc / static_cast<float>(w);
  StoreFloat(t, out, out_i, acc);
}

std::string Bits(DType t, const uint8_t* base, size_t i) {
  const size_t el = DTypeSize(t);
  uint64_t bits = 0;
  std::memcpy(&bits, base + el * i, el);
  return absl::StrFormat("0x%0*x", static_cast<int>(2 * el), bits);
}

std::string Show(DType t, const uint8_t* base, size_t i) {
  if (IsFloating(t))
    return absl::StrCat(absl::StrFormat("%.9g", LoadF(t, base, i)), " (", Bits(t, base, i), ")");
  return absl::StrCat(LoadI(t, base, i));
}

// Compares n elements of got[got_off..] with want[want_off..] bit for bit.
absl::Status Compare(const std::string& what, DType t, const uint8_t* got, size_t got_off,
                     const uint8_t* want, size_t want_off, size_t n) {
  const size_t el = DTypeSize(t);
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(got + (got_off + i) * el, want + (want_off + i) * el, el) != 0) {
      return absl::InternalError(absl::StrCat(what, ": element ", i, " is ",
                                              Show(t, got, got_off + i), ", expected ",
                                              Show(t, want, want_off + i)));
    }
  }
  return absl::OkStatus();
}

absl::Status WaitFor(Communicator& comm, absl::StatusOr<std::unique_ptr<Work>> work) {
  if (!work.ok()) return work.status();
  return (*work)->Wait(comm.OperationWaitLimit());
}

uint64_t Tag(int kind, DType t, int op, size_t count) {
  return Mix((static_cast<uint64_t>(kind) << 40) ^ (static_cast<uint64_t>(t) << 32) ^
             (static_cast<uint64_t>(op) << 28) ^ count);
}

// One collective under test: buffers prepared for this rank, issued async, verified
// against the reference. Sync checks are Issue + Wait + Verify.
class Case {
 public:
  virtual ~Case() = default;
  virtual absl::StatusOr<std::unique_ptr<Work>> Issue(Communicator& comm) = 0;
  virtual absl::Status Verify() = 0;
  const std::string& name() const { return name_; }

 protected:
  std::string name_;
};

class AllReduceCase : public Case {
 public:
  AllReduceCase(Communicator& comm, DType t, ReduceOp op, size_t n, bool in_place,
                const CheckOptions& o)
      : t_(t), op_(op), n_(n), in_place_(in_place), rank_(comm.rank()) {
    name_ = absl::StrCat("all_reduce ", DTypeName(t), " ", ReduceOpName(op), " count ", n,
                         in_place ? " in place" : "", " on rank ", rank_, " of ", comm.size());
    const uint64_t tag = Tag(1, t, static_cast<int>(op), n);
    std::vector<Bytes> inputs;
    std::vector<const uint8_t*> ptrs;
    for (int p = 0; p < comm.size(); ++p) inputs.push_back(MakeInput(t, o, p, tag, n));
    for (const Bytes& b : inputs) ptrs.push_back(b.data());
    want_.resize(n * DTypeSize(t));
    for (size_t i = 0; i < n; ++i) RefReduce(t, op, ptrs, i, want_.data(), i);
    send_ = inputs[rank_];
    original_ = send_;
    recv_.assign(want_.size(), 0xAB);
  }
  absl::StatusOr<std::unique_ptr<Work>> Issue(Communicator& comm) override {
    return comm.AllReduceAsync(send_.data(), in_place_ ? send_.data() : recv_.data(), n_, t_, op_);
  }
  absl::Status Verify() override {
    if (in_place_) return Compare(name_, t_, send_.data(), 0, want_.data(), 0, n_);
    GRADSUM_RETURN_IF_ERROR(Compare(name_, t_, recv_.data(), 0, want_.data(), 0, n_));
    return Compare(name_ + " (send buffer changed)", t_, send_.data(), 0, original_.data(), 0, n_);
  }

 private:
  DType t_;
  ReduceOp op_;
  size_t n_;
  bool in_place_;
  int rank_;
  Bytes send_, recv_, want_, original_;
};

class ReduceScatterCase : public Case {
 public:
  ReduceScatterCase(Communicator& comm, DType t, ReduceOp op, size_t n, bool in_place,
                    const CheckOptions& o)
      : t_(t), op_(op), n_(n), in_place_(in_place), rank_(comm.rank()) {
    name_ = absl::StrCat("reduce_scatter ", DTypeName(t), " ", ReduceOpName(op), " recv_count ", n,
                         in_place ? " in place" : "", " on rank ", rank_, " of ", comm.size());
    const int w = comm.size();
    const uint64_t tag = Tag(2, t, static_cast<int>(op), n);
    std::vector<Bytes> inputs;
    std::vector<const uint8_t*> ptrs;
    for (int p = 0; p < w; ++p) inputs.push_back(MakeInput(t, o, p, tag, n * w));
    for (const Bytes& b : inputs) ptrs.push_back(b.data());
    want_.resize(n * DTypeSize(t));
    for (size_t i = 0; i < n; ++i) RefReduce(t, op, ptrs, rank_ * n + i, want_.data(), i);
    send_ = inputs[rank_];
    recv_.assign(want_.size(), 0xAB);
  }
  absl::StatusOr<std::unique_ptr<Work>> Issue(Communicator& comm) override {
    return comm.ReduceScatterAsync(send_.data(), RecvPtr(), n_, t_, op_);
  }
  absl::Status Verify() override { return Compare(name_, t_, RecvPtr(), 0, want_.data(), 0, n_); }

 private:
  uint8_t* RecvPtr() {
    return in_place_ ? send_.data() + rank_ * n_ * DTypeSize(t_) : recv_.data();
  }
  DType t_;
  ReduceOp op_;
  size_t n_;
  bool in_place_;
  int rank_;
  Bytes send_, recv_, want_;
};

class AllGatherCase : public Case {
 public:
  AllGatherCase(Communicator& comm, DType t, size_t n, bool in_place, const CheckOptions& o)
      : t_(t), n_(n), in_place_(in_place), rank_(comm.rank()) {
    name_ = absl::StrCat("all_gather ", DTypeName(t), " send_count ", n,
                         in_place ? " in place" : "", " on rank ", rank_, " of ", comm.size());
    const int w = comm.size();
    const size_t el = DTypeSize(t);
    const uint64_t tag = Tag(3, t, 0, n);
    for (int p = 0; p < w; ++p) {
      const Bytes in = MakeInput(t, o, p, tag, n);
      want_.insert(want_.end(), in.begin(), in.end());
      if (p == rank_) send_ = in;
    }
    recv_.assign(want_.size(), 0xAB);
    if (in_place_ && n > 0) std::memcpy(recv_.data() + rank_ * n * el, send_.data(), n * el);
  }
  absl::StatusOr<std::unique_ptr<Work>> Issue(Communicator& comm) override {
    const void* send = in_place_ ? recv_.data() + rank_ * n_ * DTypeSize(t_) : send_.data();
    return comm.AllGatherAsync(send, recv_.data(), n_, t_);
  }
  absl::Status Verify() override {
    return Compare(name_, t_, recv_.data(), 0, want_.data(), 0, want_.size() / DTypeSize(t_));
  }

 private:
  DType t_;
  size_t n_;
  bool in_place_;
  int rank_;
  Bytes send_, recv_, want_;
};

class BroadcastCase : public Case {
 public:
  BroadcastCase(Communicator& comm, DType t, size_t n, int root, const CheckOptions& o)
      : t_(t), n_(n), root_(root) {
    name_ = absl::StrCat("broadcast ", DTypeName(t), " count ", n, " root ", root, " on rank ",
                         comm.rank(), " of ", comm.size());
    const uint64_t tag = Tag(4, t, root, n);
    want_ = MakeInput(t, o, root, tag, n);
    buf_ = comm.rank() == root ? want_ : MakeInput(t, o, comm.rank(), tag + 1, n);
  }
  absl::StatusOr<std::unique_ptr<Work>> Issue(Communicator& comm) override {
    return comm.BroadcastAsync(buf_.data(), n_, t_, root_);
  }
  absl::Status Verify() override { return Compare(name_, t_, buf_.data(), 0, want_.data(), 0, n_); }

 private:
  DType t_;
  size_t n_;
  int root_;
  Bytes buf_, want_;
};

// Deterministic uneven all-to-all-v layout, identical on every rank.
struct AllToAllLayout {
  AllToAllLayout(int w, size_t max_count, uint64_t seed) : counts(w, std::vector<size_t>(w)) {
    for (int p = 0; p < w; ++p) {
      for (int q = 0; q < w; ++q) {
        const uint64_t h = Hash(seed, 0xa11ull, p, static_cast<uint64_t>(q));
        counts[p][q] = (max_count == 0 || h % 4 == 0) ? 0 : 1 + (h >> 8) % max_count;
        if (w > 2 && p == 1) counts[p][q] = 0;  // a rank that sends nothing at all
      }
    }
  }
  // Sender p's blocks in reverse peer order with a one-element gap before each.
  std::vector<size_t> SendOffsets(int p) const {
    const int w = static_cast<int>(counts.size());
    std::vector<size_t> off(w);
    size_t at = 0;
    for (int q = w - 1; q >= 0; --q) {
      at += 1;
      off[q] = at;
      at += counts[p][q];
    }
    return off;
  }
  size_t SendSize(int p) const {
    size_t n = 0;
    for (size_t c : counts[p]) n += c + 1;
    return n;
  }
  // Receiver r's blocks in peer order with a two-element gap before each.
  std::vector<size_t> RecvOffsets(int r) const {
    const int w = static_cast<int>(counts.size());
    std::vector<size_t> off(w);
    size_t at = 0;
    for (int p = 0; p < w; ++p) {
      at += 2;
      off[p] = at;
      at += counts[p][r];
    }
    return off;
  }
  size_t RecvSize(int r) const {
    size_t n = 2;
    for (size_t p = 0; p < counts.size(); ++p) n += counts[p][r] + 2;
    return n;
  }
  std::vector<std::vector<size_t>> counts;  // counts[sender][receiver]
};

class AllToAllVCase : public Case {
 public:
  AllToAllVCase(Communicator& comm, DType t, size_t max_count, const CheckOptions& o)
      : t_(t), rank_(comm.rank()), layout_(comm.size(), max_count, o.seed ^ max_count) {
    name_ = absl::StrCat("all_to_all_v ", DTypeName(t), " max_count ", max_count, " on rank ",
                         rank_, " of ", comm.size());
    const int w = comm.size();
    const uint64_t tag = Tag(5, t, 0, max_count);
    send_ = MakeInput(t, o, rank_, tag, layout_.SendSize(rank_));
    for (int q = 0; q < w; ++q) send_counts_.push_back(layout_.counts[rank_][q]);
    send_offsets_ = layout_.SendOffsets(rank_);
    for (int p = 0; p < w; ++p) recv_counts_.push_back(layout_.counts[p][rank_]);
    recv_offsets_ = layout_.RecvOffsets(rank_);
    recv_.assign(layout_.RecvSize(rank_) * DTypeSize(t), 0x5A);
    want_ = recv_;  // gaps must keep the sentinel
    const size_t el = DTypeSize(t);
    for (int p = 0; p < w; ++p) {
      const Bytes peer_send = MakeInput(t, o, p, tag, layout_.SendSize(p));
      const size_t from = layout_.SendOffsets(p)[rank_];
      std::memcpy(want_.data() + recv_offsets_[p] * el, peer_send.data() + from * el,
                  recv_counts_[p] * el);
    }
  }
  absl::StatusOr<std::unique_ptr<Work>> Issue(Communicator& comm) override {
    return comm.AllToAllVAsync(send_.data(), send_counts_, send_offsets_, recv_.data(),
                               recv_counts_, recv_offsets_, t_);
  }
  absl::Status Verify() override {
    return Compare(name_, t_, recv_.data(), 0, want_.data(), 0, want_.size() / DTypeSize(t_));
  }

 private:
  DType t_;
  int rank_;
  AllToAllLayout layout_;
  Bytes send_, recv_, want_;
  std::vector<size_t> send_counts_, send_offsets_, recv_counts_, recv_offsets_;
};

absl::Status RunSync(Communicator& comm, Case& c) {
  GRADSUM_RETURN_IF_ERROR(Annotate(WaitFor(comm, c.Issue(comm)), c.name()));
  return c.Verify();
}

// Expects InvalidArgument whose message contains `word`.
absl::Status ExpectInvalid(absl::Status s, const std::string& what, const std::string& word) {
  if (s.code() != absl::StatusCode::kInvalidArgument) {
    return absl::InternalError(absl::StrCat(what, ": expected InvalidArgument mentioning '", word,
                                            "', got ", s.ToString()));
  }
  if (s.message().find(word) == absl::string_view::npos) {
    return absl::InternalError(
        absl::StrCat(what, ": InvalidArgument does not mention '", word, "': ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckAllReduce(Communicator& comm, DType dtype, ReduceOp op, size_t count,
                            bool in_place, const CheckOptions& options) {
  AllReduceCase c(comm, dtype, op, count, in_place, options);
  return RunSync(comm, c);
}

absl::Status CheckReduceScatter(Communicator& comm, DType dtype, ReduceOp op, size_t recv_count,
                                bool in_place, const CheckOptions& options) {
  ReduceScatterCase c(comm, dtype, op, recv_count, in_place, options);
  return RunSync(comm, c);
}

absl::Status CheckAllGather(Communicator& comm, DType dtype, size_t send_count, bool in_place,
                            const CheckOptions& options) {
  AllGatherCase c(comm, dtype, send_count, in_place, options);
  return RunSync(comm, c);
}

absl::Status CheckAllToAllV(Communicator& comm, DType dtype, size_t max_count,
                            const CheckOptions& options) {
  AllToAllVCase c(comm, dtype, max_count, options);
  return RunSync(comm, c);
}

absl::Status CheckBroadcast(Communicator& comm, DType dtype, size_t count, int root,
                            const CheckOptions& options) {
  BroadcastCase c(comm, dtype, count, root, options);
  return RunSync(comm, c);
}

absl::Status CheckAsyncInIssueOrder(Communicator& comm, const CheckOptions& options) {
  std::vector<std::unique_ptr<Case>> cases;
  cases.push_back(
      std::make_unique<AllReduceCase>(comm, DType::kF32, ReduceOp::kSum, 1000, true, options));
  cases.push_back(std::make_unique<AllGatherCase>(comm, DType::kI32, 37, false, options));
  cases.push_back(
      std::make_unique<BroadcastCase>(comm, DType::kBF16, 513, comm.size() - 1, options));
  cases.push_back(
      std::make_unique<AllReduceCase>(comm, DType::kF64, ReduceOp::kMax, 77, false, options));
  cases.push_back(std::make_unique<AllToAllVCase>(comm, DType::kF16, 9, options));
  cases.push_back(
      std::make_unique<ReduceScatterCase>(comm, DType::kI64, ReduceOp::kSum, 5, true, options));
  std::vector<std::unique_ptr<Work>> works;
  for (auto& c : cases) {
    absl::StatusOr<std::unique_ptr<Work>> w = c->Issue(comm);
    if (!w.ok()) return Annotate(w.status(), c->name());
    works.push_back(std::move(*w));
  }
  for (size_t i = works.size(); i-- > 0;) {
    GRADSUM_RETURN_IF_ERROR(Annotate(works[i]->Wait(comm.OperationWaitLimit()), cases[i]->name()));
    if (!works[i]->IsCompleted()) {
      return absl::InternalError(
          absl::StrCat(cases[i]->name(), ": Wait returned OK but IsCompleted is false"));
    }
    GRADSUM_RETURN_IF_ERROR(cases[i]->Verify());
  }
  GRADSUM_RETURN_IF_ERROR(Annotate(comm.Barrier(), "barrier after async operations"));
  // A completed handle answers at once, even with a zero timeout.
  return Annotate(works[0]->Wait(absl::ZeroDuration()), "zero-timeout Wait on a completed op");
}

absl::Status CheckSplit(Communicator& comm, const CheckOptions& options) {
  const int w = comm.size();
  const int r = comm.rank();
  // Parity groups; key -r orders the new ranks by descending old rank.
  std::vector<int32_t> members;
  for (int p = w - 1; p >= 0; --p) {
    if (p % 2 == r % 2) members.push_back(p);
  }
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, comm.Split(r % 2, -r));
  const std::string what = absl::StrCat("split(color ", r % 2, ", key ", -r, ") on rank ", r);
  if (sub == nullptr) return absl::InternalError(what + ": returned nullptr");
  const int want_rank =
      static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
  if (sub->size() != static_cast<int>(members.size()) || sub->rank() != want_rank) {
    return absl::InternalError(absl::StrCat(what, ": got rank ", sub->rank(), " of ", sub->size(),
                                            ", expected rank ", want_rank, " of ", members.size()));
  }
  std::vector<int32_t> gathered(members.size(), -1);
  const int32_t me = r;
  GRADSUM_RETURN_IF_ERROR(Annotate(sub->AllGather(&me, gathered.data(), 1, DType::kI32), what));
  if (gathered != members) {
    return absl::InternalError(absl::StrCat(what, ": sub-communicator members by new rank are {",
                                            absl::StrJoin(gathered, ", "), "}, expected {",
                                            absl::StrJoin(members, ", "), "}"));
  }
  // Sub-of-sub: pairs of consecutive sub ranks.
  const int pair = sub->rank() / 2;
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> subsub, sub->Split(pair, sub->rank()));
  if (subsub == nullptr) return absl::InternalError(what + ": sub-split returned nullptr");
  int64_t want_sum = 0;
  int want_size = 0;
  for (int i = 2 * pair; i < std::min<int>(2 * pair + 2, static_cast<int>(members.size())); ++i) {
    want_sum += members[i];
    ++want_size;
  }
  int64_t sum = r;
  GRADSUM_RETURN_IF_ERROR(
      Annotate(subsub->AllReduce(&sum, &sum, 1, DType::kI64, ReduceOp::kSum), what + " sub-split"));
  if (subsub->size() != want_size || subsub->rank() != sub->rank() % 2 || sum != want_sum) {
    return absl::InternalError(absl::StrCat(what, ": sub-split gave rank ", subsub->rank(), " of ",
                                            subsub->size(), " with sum of old ranks ", sum,
                                            "; expected rank ", sub->rank() % 2, " of ", want_size,
                                            " with sum ", want_sum));
  }
  // The children work independently of the parent: a full-size op on the parent still works.
  GRADSUM_RETURN_IF_ERROR(CheckAllReduce(comm, DType::kF32, ReduceOp::kSum, 33, true, options));
  // A negative color leaves the last rank out.
  const bool out = r == w - 1;
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> rest, comm.Split(out ? -1 : 7, 0));
  if (out) {
    if (rest != nullptr) return absl::InternalError(what + ": negative color must give nullptr");
    return absl::OkStatus();
  }
  if (rest == nullptr || rest->size() != w - 1 || rest->rank() != r) {
    return absl::InternalError(absl::StrCat(
        what, ": split leaving out the last rank gave ",
        rest == nullptr ? "nullptr" : absl::StrCat("rank ", rest->rank(), " of ", rest->size())));
  }
  return CheckAllReduce(*rest, DType::kBF16, ReduceOp::kSum, 100, false, options);
}

absl::Status CheckMismatchesFail(Communicator& comm) {
  const int w = comm.size();
  if (w < 2) return absl::OkStatus();
  const int r = comm.rank();
  const bool odd = r == w - 1;
  std::vector<double> buf(16 * static_cast<size_t>(w), 1.0);
  std::vector<double> out(16 * static_cast<size_t>(w), 0.0);
  const std::string where = absl::StrCat(" on rank ", r);
  GRADSUM_RETURN_IF_ERROR(ExpectInvalid(
      comm.AllReduce(buf.data(), out.data(), odd ? 12 : 10, DType::kF32, ReduceOp::kSum),
      "all_reduce with a different count" + where, "count"));
  GRADSUM_RETURN_IF_ERROR(ExpectInvalid(
      comm.AllReduce(buf.data(), out.data(), 8, odd ? DType::kF64 : DType::kF32, ReduceOp::kSum),
      "all_reduce with a different dtype" + where, "dtype"));
  GRADSUM_RETURN_IF_ERROR(ExpectInvalid(
      comm.AllReduce(buf.data(), out.data(), 8, DType::kF32, odd ? ReduceOp::kMax : ReduceOp::kSum),
      "all_reduce with a different reduce op" + where, "op"));
  GRADSUM_RETURN_IF_ERROR(ExpectInvalid(comm.Broadcast(buf.data(), 8, DType::kF32, odd ? 0 : 1),
                                        "broadcast with a different root" + where, "root"));
  GRADSUM_RETURN_IF_ERROR(
      ExpectInvalid(odd ? comm.AllGather(buf.data(), out.data(), 4, DType::kF32)
                        : comm.AllReduce(buf.data(), out.data(), 4, DType::kF32, ReduceOp::kSum),
                    "all_gather on one rank, all_reduce on the others" + where, "all_"));
  std::vector<size_t> ones(w, 1), offsets(w);
  for (int p = 0; p < w; ++p) offsets[p] = 2 * static_cast<size_t>(p);
  std::vector<size_t> recv_counts = ones;
  if (odd) recv_counts[0] = 2;  // expects 2 from rank 0, which sends 1
  GRADSUM_RETURN_IF_ERROR(ExpectInvalid(
      comm.AllToAllV(buf.data(), ones, offsets, out.data(), recv_counts, offsets, DType::kF64),
      "all_to_all_v with an inconsistent count matrix" + where, "rank"));
  return absl::OkStatus();
}

absl::Status CheckSendRecv(Communicator& comm, DType dtype, size_t count,
                           const CheckOptions& options) {
  const int w = comm.size(), r = comm.rank();
  const int next = (r + 1) % w, prev = (r + w - 1) % w;
  // Three messages on tag 0 (ordered), one on tag 7 (posted last by the sender, first by
  // the receiver: tags are independent streams), one to this rank itself.
  constexpr int kStream = 3;
  const auto input = [&](int rank, int i) {
    return MakeInput(dtype, options, rank, Tag(20 + i, dtype, 0, count), count);
  };
  std::vector<Bytes> sent, got;
  for (int i = 0; i <= kStream + 1; ++i) {
    sent.push_back(input(r, i));
    got.push_back(Bytes(count * DTypeSize(dtype), 0xA5));
  }
  std::vector<std::unique_ptr<Work>> works;
  const auto post = [&](absl::StatusOr<std::unique_ptr<Work>> work) -> absl::Status {
    if (!work.ok()) return work.status();
    works.push_back(std::move(*work));
    return absl::OkStatus();
  };
  const auto sends = [&]() -> absl::Status {
    for (int i = 0; i < kStream; ++i) {
      GRADSUM_RETURN_IF_ERROR(post(comm.SendAsync(sent[i].data(), count, dtype, next)));
    }
    return post(comm.SendAsync(sent[kStream].data(), count, dtype, next, /*tag=*/7));
  };
  const auto recvs = [&]() -> absl::Status {
    GRADSUM_RETURN_IF_ERROR(post(comm.RecvAsync(got[kStream].data(), count, dtype, prev, 7)));
    for (int i = 0; i < kStream; ++i) {
      GRADSUM_RETURN_IF_ERROR(post(comm.RecvAsync(got[i].data(), count, dtype, prev)));
    }
    return absl::OkStatus();
  };
  // Even ranks send first, odd ranks receive first: neither order may block the other.
  if (r % 2 == 0) {
    GRADSUM_RETURN_IF_ERROR(sends());
    GRADSUM_RETURN_IF_ERROR(recvs());
  } else {
    GRADSUM_RETURN_IF_ERROR(recvs());
    GRADSUM_RETURN_IF_ERROR(sends());
  }
  GRADSUM_RETURN_IF_ERROR(
      post(comm.RecvAsync(got[kStream + 1].data(), count, dtype, r, /*tag=*/3)));
  GRADSUM_RETURN_IF_ERROR(post(comm.SendAsync(sent[kStream + 1].data(), count, dtype, r, 3)));
  // Waited for in reverse order of issue.
  for (auto it = works.rbegin(); it != works.rend(); ++it) {
    GRADSUM_RETURN_IF_ERROR((*it)->Wait(comm.OperationWaitLimit()));
  }
  for (int i = 0; i <= kStream + 1; ++i) {
    const int from = i == kStream + 1 ? r : prev;
    const Bytes want = input(from, i);
    GRADSUM_RETURN_IF_ERROR(Compare(absl::StrCat("recv #", i, " of ", count, " ", DTypeName(dtype),
                                                 " from rank ", from, " on rank ", r),
                                    dtype, got[i].data(), 0, want.data(), 0, count));
  }
  return absl::OkStatus();
}

absl::Status CheckSendRecvMismatchFails(Communicator& comm) {
  if (comm.size() < 2 || comm.rank() > 1) return absl::OkStatus();
  const int r = comm.rank(), peer = 1 - r;
  std::vector<float> buf(16, 1.0f);
  // Rank 0 sends 10 floats, rank 1 expects 12: both fail naming the other.
  absl::Status s = r == 0 ? comm.Send(buf.data(), 10, DType::kF32, peer, 5)
                          : comm.Recv(buf.data(), 12, DType::kF32, peer, 5);
  GRADSUM_RETURN_IF_ERROR(
      ExpectInvalid(s, absl::StrCat("mismatched recv on rank ", r), absl::StrCat("rank ", peer)));
  GRADSUM_RETURN_IF_ERROR(ExpectInvalid(s, absl::StrCat("mismatched recv on rank ", r), "12"));
  // The pair still works afterwards.
  std::vector<float> mine(4, static_cast<float>(r)), theirs(4, -1.0f);
  absl::StatusOr<std::unique_ptr<Work>> recv = comm.RecvAsync(theirs.data(), 4, DType::kF32, peer);
  GRADSUM_RETURN_IF_ERROR(comm.Send(mine.data(), 4, DType::kF32, peer));
  GRADSUM_RETURN_IF_ERROR(WaitFor(comm, std::move(recv)));
  if (theirs[3] != static_cast<float>(peer)) {
    return absl::InternalError(
        absl::StrCat("rank ", r, ": after a mismatch, got ", theirs[3], " from rank ", peer));
  }
  return absl::OkStatus();
}

absl::Status CheckPointToPoint(Communicator& comm, const CheckOptions& options) {
  for (DType t : kAllDTypes) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{1000}}) {
      GRADSUM_RETURN_IF_ERROR(CheckSendRecv(comm, t, n, options));
    }
  }
  GRADSUM_RETURN_IF_ERROR(CheckSendRecv(comm, DType::kF32, size_t{1} << 18, options));
  return CheckSendRecvMismatchFails(comm);
}

absl::Status CheckAll(Communicator& comm, const CheckOptions& options) {
  const size_t kCounts[] = {0, 1, 13, 1000, 4099};
  for (DType t : kAllDTypes) {
    for (size_t n : kCounts) {
      for (bool in_place : {false, true}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
          if (op == ReduceOp::kAvg && !IsFloating(t)) continue;
          GRADSUM_RETURN_IF_ERROR(CheckAllReduce(comm, t, op, n, in_place, options));
          if (op != ReduceOp::kMax) {
            GRADSUM_RETURN_IF_ERROR(CheckReduceScatter(comm, t, op, n / 4, in_place, options));
          }
        }
        GRADSUM_RETURN_IF_ERROR(CheckAllGather(comm, t, n / 4, in_place, options));
      }
      GRADSUM_RETURN_IF_ERROR(
          CheckBroadcast(comm, t, n, static_cast<int>(n % comm.size()), options));
    }
    GRADSUM_RETURN_IF_ERROR(CheckAllToAllV(comm, t, 0, options));
    GRADSUM_RETURN_IF_ERROR(CheckAllToAllV(comm, t, 300, options));
  }
  GRADSUM_RETURN_IF_ERROR(CheckAsyncInIssueOrder(comm, options));
  GRADSUM_RETURN_IF_ERROR(CheckSplit(comm, options));
  return absl::OkStatus();
}

}  // namespace gradsum::conformance
