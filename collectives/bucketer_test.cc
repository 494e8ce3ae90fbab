#include "collectives/bucketer.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/thread_backend.h"
#include "core/half.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "testing/run_ranks.h"
#include "testing/status_testing.h"

namespace gradsum {
namespace {

using ::gradsum::testing::RunRanks;
using ::gradsum::testing::RunRanksPerRank;

// Rank r's gradient value for element i of parameter id in a given step.
float GradValue(int rank, int id, int64_t i, int step) {
  uint64_t h = (static_cast<uint64_t>(rank) * 1000003u + id) * 2654435761u + i * 40503u + step;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  return static_cast<float>(static_cast<int64_t>(h % 20001) - 10000) / 1024.0f;
}

// Reference: the SUM over ranks in ascending rank order, fp32 accumulation, rounded once
// into the dtype (SEMANTICS.md §7), computed element by element.
float ExpectedSum(DType t, int world, int id, int64_t i, int step) {
  float acc = 0.0f;
  for (int r = 0; r < world; ++r) {
    float v = GradValue(r, id, i, step);
    if (t == DType::kBF16) v = BF16::FromFloat(v).ToFloat();  // what rank r stored
    acc = r == 0 ? v : acc + v;
  }
  return t == DType::kBF16 ? BF16::FromFloat(acc).ToFloat() : acc;
}

void WriteGrad(const TensorView& g, int rank, int id, int step) {
  for (int64_t i = 0; i < g.numel(); ++i) {
    const float v = GradValue(rank, id, i, step);
    if (g.dtype() == DType::kBF16)
      g.data<BF16>()[i] = BF16::FromFloat(v);
    else
      g.data<float>()[i] = v;
  }
}

float ReadElem(const TensorView& g, int64_t i) {
  return g.dtype() == DType::kBF16 ? g.data<BF16>()[i].ToFloat() : g.data<float>()[i];
}

absl::Status CheckGrad(const TensorView& g, int world, int id, int step) {
  for (int64_t i = 0; i < g.numel(); ++i) {
    const float want = ExpectedSum(g.dtype(), world, id, i, step);
    const float got = ReadElem(g, i);
    if (std::memcmp(&got, &want, sizeof(float)) != 0) {
      return absl::InternalError(absl::StrCat("step ", step, " param ", id, " element ", i,
                                              ": got ", got, ", expected ", want));
    }
  }
  return absl::OkStatus();
}

// 300 parameters of a small transformer's mix: f32 and bf16, sizes 1 .. ~6000 elements.
std::vector<std::pair<DType, int64_t>> MixedParams(int n) {
  std::mt19937 rng(12345);
  std::vector<std::pair<DType, int64_t>> params;
  for (int i = 0; i < n; ++i) {
    const DType t = (i % 3 == 2) ? DType::kBF16 : DType::kF32;
    const int64_t numel = 1 + static_cast<int64_t>(rng() % (i % 7 == 0 ? 6000 : 400));
    params.push_back({t, numel});
  }
  return params;
}

absl::Status RegisterAll(GradBucketer& b, const std::vector<std::pair<DType, int64_t>>& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    absl::StatusOr<int> id = b.Register(absl::StrCat("p", i), params[i].first, params[i].second);
    if (!id.ok()) return id.status();
    if (*id != static_cast<int>(i)) return absl::InternalError("ids are not 0, 1, 2, ...");
  }
  return b.Finalize();
}

TEST(GradBucketerTest, ReverseOrderGreedyBucketsUpToTheCap) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  GradBucketerOptions o;
  o.bucket_cap_bytes = 100;
  GradBucketer b((*comms)[0].get(), o);
  // f32 sizes 40, 40, 40, 20 bytes; reverse order: 20 + 40 + 40 = 100 fits, then 40 alone.
  for (int64_t n : {10, 10, 10, 5}) ASSERT_TRUE(b.Register("w", DType::kF32, n).ok());
  ASSERT_TRUE(b.Register("big", DType::kF32, 1000).ok());  // 4000 bytes > cap: alone
  GRADSUM_EXPECT_OK(b.Finalize());
  ASSERT_EQ(b.num_buckets(), 3);
  EXPECT_EQ(b.bucket(0).param_ids, (std::vector<int>{4}));
  EXPECT_EQ(b.bucket(1).param_ids, (std::vector<int>{3, 2, 1}));
  EXPECT_EQ(b.bucket(1).offsets, (std::vector<int64_t>{0, 5, 15}));
  EXPECT_EQ(b.bucket(1).numel, 25);
  EXPECT_EQ(b.bucket(2).param_ids, (std::vector<int>{0}));
  EXPECT_EQ(b.bucket_of(2), 1);
  EXPECT_EQ(b.bucket_of(5), -1);
  // Views: adjacent in storage, in reverse registration order.
  EXPECT_EQ(b.grad(2).data<float>(), b.grad(3).data<float>() + 5);
  EXPECT_EQ(b.grad(1).data<float>(), b.grad(2).data<float>() + 10);
  EXPECT_EQ(b.grad(1).numel(), 10);
  EXPECT_EQ(b.grad(1).dtype(), DType::kF32);
  EXPECT_EQ(b.grad(7).numel(), 0);  // out of range: empty view
}

// DDP's small first bucket: the first bucket backward completes has its own cap, the
// others the normal one.
TEST(GradBucketerTest, FirstBucketHasItsOwnCap) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  GradBucketerOptions o;
  o.bucket_cap_bytes = 100;
  o.first_bucket_cap_bytes = 40;
  GradBucketer b((*comms)[0].get(), o);
  // f32 sizes 20, 20, 20, 20, 20, 20 bytes; reverse order: {5, 4} (40), then {3, 2, 1, 0}.
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(b.Register("w", DType::kF32, 5).ok());
  GRADSUM_EXPECT_OK(b.Finalize());
  ASSERT_EQ(b.num_buckets(), 2);
  EXPECT_EQ(b.bucket(0).param_ids, (std::vector<int>{5, 4}));
  EXPECT_EQ(b.bucket(1).param_ids, (std::vector<int>{3, 2, 1, 0}));
}

TEST(GradBucketerTest, OneDTypePerBucketOrderedByCompletionInBackward) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  GradBucketer b((*comms)[0].get());
  ASSERT_TRUE(b.Register("a", DType::kF32, 3).ok());
  ASSERT_TRUE(b.Register("b", DType::kBF16, 3).ok());
  ASSERT_TRUE(b.Register("c", DType::kF32, 3).ok());
  ASSERT_TRUE(b.Register("d", DType::kBF16, 3).ok());
  GRADSUM_EXPECT_OK(b.Finalize());
  ASSERT_EQ(b.num_buckets(), 2);
  // Backward marks d, c, b, a: the bf16 bucket {d, b} completes before the f32 one {c, a}.
  EXPECT_EQ(b.bucket(0).dtype, DType::kBF16);
  EXPECT_EQ(b.bucket(0).param_ids, (std::vector<int>{3, 1}));
  EXPECT_EQ(b.bucket(1).dtype, DType::kF32);
  EXPECT_EQ(b.bucket(1).param_ids, (std::vector<int>{2, 0}));
}

TEST(GradBucketerTest, LayoutOf300MixedParameters) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  GradBucketerOptions o;
  o.bucket_cap_bytes = 16 << 10;
  GradBucketer b((*comms)[0].get(), o);
  const auto params = MixedParams(300);
  GRADSUM_EXPECT_OK(RegisterAll(b, params));
  std::vector<int> seen(params.size(), 0);
  int prev_min_id = static_cast<int>(params.size());
  for (int k = 0; k < b.num_buckets(); ++k) {
    const GradBucketInfo& info = b.bucket(k);
    size_t bytes = 0;
    for (size_t j = 0; j < info.param_ids.size(); ++j) {
      const int id = info.param_ids[j];
      ++seen[id];
      EXPECT_EQ(params[id].first, info.dtype) << "bucket " << k << " mixes dtypes";
      if (j > 0) {
        EXPECT_LT(id, info.param_ids[j - 1]) << "not in reverse order";
      }
      EXPECT_EQ(b.bucket_of(id), k);
      bytes += params[id].second * DTypeSize(info.dtype);
    }
    if (info.param_ids.size() > 1) {
      EXPECT_LE(bytes, o.bucket_cap_bytes) << "bucket " << k;
    }
    EXPECT_EQ(static_cast<int64_t>(bytes / DTypeSize(info.dtype)), info.numel);
    EXPECT_LT(info.param_ids.back(), prev_min_id) << "buckets out of completion order";
    prev_min_id = info.param_ids.back();
  }
  for (size_t id = 0; id < params.size(); ++id) EXPECT_EQ(seen[id], 1) << "param " << id;
  // Greedy: a bucket was closed only because the next same-dtype parameter (in reverse
  // order) did not fit, so buckets are few: fewer than twice the lower bound per dtype.
  size_t total[2] = {0, 0};
  for (const auto& [t, n] : params) total[t == DType::kBF16] += n * DTypeSize(t);
  const size_t lower = (total[0] + o.bucket_cap_bytes - 1) / o.bucket_cap_bytes +
                       (total[1] + o.bucket_cap_bytes - 1) / o.bucket_cap_bytes;
  EXPECT_LT(static_cast<size_t>(b.num_buckets()), 2 * lower + 2);
}

// The issue's case: 300 tensors of mixed sizes, each rank marking them in its own random
// order, over several steps with ZeroGrads in between; every gradient must equal the
// reference SUM over ranks.
TEST(GradBucketerTest, RandomReadyOrderPerRankOverSteps) {
  const auto params = MixedParams(300);
  for (int world : {1, 2, 3, 4, 8}) {
    absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
      GradBucketerOptions o;
      o.bucket_cap_bytes = 32 << 10;
      GradBucketer b(&comm, o);
      GRADSUM_RETURN_IF_ERROR(RegisterAll(b, params));
      std::mt19937 rng(777 + comm.rank());
      std::vector<int> order(params.size());
      std::iota(order.begin(), order.end(), 0);
      for (int step = 0; step < 3; ++step) {
        GRADSUM_RETURN_IF_ERROR(b.ZeroGrads());
        for (int id = 0; id < b.num_params(); ++id) {
          const TensorView g = b.grad(id);
          for (int64_t i = 0; i < g.numel(); ++i) {
            if (ReadElem(g, i) != 0.0f) return absl::InternalError("ZeroGrads left a value");
          }
        }
        std::shuffle(order.begin(), order.end(), rng);
        for (int id : order) {
          WriteGrad(b.grad(id), comm.rank(), id, step);
          GRADSUM_RETURN_IF_ERROR(b.MarkReady(id));
        }
        GRADSUM_RETURN_IF_ERROR(b.Finish());
        for (int id = 0; id < b.num_params(); ++id) {
          GRADSUM_RETURN_IF_ERROR(CheckGrad(b.grad(id), world, id, step));
        }
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok()) << "world " << world << ": " << s;
  }
}

TEST(GradBucketerTest, BucketsIssueWhenCompleteAndInBucketOrder) {
  GRADSUM_EXPECT_OK(RunRanks(2, [](Communicator& comm) -> absl::Status {
    GradBucketerOptions o;
    o.bucket_cap_bytes = 8;  // two f32 per bucket
    GradBucketer b(&comm, o);
    for (int i = 0; i < 6; ++i) {
      if (!b.Register(absl::StrCat("p", i), DType::kF32, 1).ok()) return absl::InternalError("reg");
    }
    GRADSUM_RETURN_IF_ERROR(b.Finalize());
    // Buckets: 0 = {5, 4}, 1 = {3, 2}, 2 = {1, 0}.
    if (b.num_buckets() != 3 || b.bucket(0).param_ids != std::vector<int>{5, 4}) {
      return absl::InternalError("unexpected buckets");
    }
    const auto mark = [&](int id) {
      b.grad(id).data<float>()[0] = static_cast<float>(10 * id + comm.rank());
      return b.MarkReady(id);
    };
    const auto expect_issued = [&](int n, const char* when) -> absl::Status {
      if (b.issued_buckets() != n) {
        return absl::InternalError(
            absl::StrCat(when, ": issued ", b.issued_buckets(), ", expected ", n));
      }
      return absl::OkStatus();
    };
    GRADSUM_RETURN_IF_ERROR(mark(5));
    GRADSUM_RETURN_IF_ERROR(expect_issued(0, "half of bucket 0"));
    GRADSUM_RETURN_IF_ERROR(mark(1));
    GRADSUM_RETURN_IF_ERROR(mark(0));
    GRADSUM_RETURN_IF_ERROR(expect_issued(0, "bucket 2 complete, bucket 0 not"));
    GRADSUM_RETURN_IF_ERROR(mark(4));
    GRADSUM_RETURN_IF_ERROR(expect_issued(1, "bucket 0 complete"));
    GRADSUM_RETURN_IF_ERROR(mark(2));
    GRADSUM_RETURN_IF_ERROR(mark(3));
    GRADSUM_RETURN_IF_ERROR(expect_issued(3, "all complete"));
    GRADSUM_RETURN_IF_ERROR(b.Finish());
    for (int id = 0; id < 6; ++id) {
      const float want = static_cast<float>(20 * id + 1);  // (10 id + 0) + (10 id + 1)
      if (b.grad(id).data<float>()[0] != want) {
        return absl::InternalError(absl::StrCat("param ", id, " = ", b.grad(id).data<float>()[0]));
      }
    }
    return expect_issued(0, "after Finish");
  }));
}

TEST(GradBucketerTest, FinishWithMissingGradientThenRecover) {
  auto statuses = RunRanksPerRank(2, [](Communicator& comm) -> absl::Status {
    GradBucketerOptions o;
    o.bucket_cap_bytes = 8;
    GradBucketer b(&comm, o);
    for (int i = 0; i < 4; ++i) {
      if (!b.Register(absl::StrCat("layer", i), DType::kF32, 1).ok())
        return absl::InternalError("reg");
    }
    GRADSUM_RETURN_IF_ERROR(b.Finalize());
    for (int id = 3; id >= 1; --id) {
      b.grad(id).data<float>()[0] = 1.0f;
      GRADSUM_RETURN_IF_ERROR(b.MarkReady(id));
    }
    absl::Status again = b.MarkReady(3);
    if (again.code() != absl::StatusCode::kFailedPrecondition ||
        !absl::StrContains(again.message(), "layer3")) {
      return absl::InternalError(absl::StrCat("double mark gave ", again.ToString()));
    }
    if (comm.rank() == 1) {
      absl::Status missing = b.Finish();
      if (missing.code() != absl::StatusCode::kFailedPrecondition ||
          !absl::StrContains(missing.message(), "layer0") ||
          !absl::StrContains(missing.message(), "1 of 4 missing")) {
        return absl::InternalError(absl::StrCat("missing gradient gave ", missing.ToString()));
      }
      if (b.ZeroGrads().code() != absl::StatusCode::kFailedPrecondition) {
        return absl::InternalError("ZeroGrads accepted while a step is open");
      }
    }
    b.grad(0).data<float>()[0] = 1.0f;
    GRADSUM_RETURN_IF_ERROR(b.MarkReady(0));
    GRADSUM_RETURN_IF_ERROR(b.Finish());
    for (int id = 0; id < 4; ++id) {
      if (b.grad(id).data<float>()[0] != 2.0f) return absl::InternalError("bad sum");
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(statuses.ok());
  for (const absl::Status& s : *statuses) GRADSUM_EXPECT_OK(s);
}

// A step that failed part-way (some buckets issued, some gradients never marked) is
// dropped: every gradient may be marked again, the storage is zero, and the next step
// reduces only its own values. CopyBucketToHost reads a bucket's reduced storage.
TEST(GradBucketerTest, AbandonStepDropsAPartialStepAndCopyBucketToHostReadsTheSum) {
  GRADSUM_EXPECT_OK(RunRanks(2, [](Communicator& comm) -> absl::Status {
    GradBucketerOptions o;
    o.bucket_cap_bytes = 8;  // two f32 gradients of one element per bucket
    GradBucketer b(&comm, o);
    if (b.AbandonStep().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("AbandonStep before Finalize accepted");
    }
    for (int i = 0; i < 4; ++i) {
      GRADSUM_RETURN_IF_ERROR(b.Register(absl::StrCat("p", i), DType::kF32, 1).status());
    }
    GRADSUM_RETURN_IF_ERROR(b.Finalize());
    for (int id = 3; id >= 1; --id) {  // bucket 0 (ids 3, 2) is issued, bucket 1 is not
      b.grad(id).data<float>()[0] = 5.0f;
      GRADSUM_RETURN_IF_ERROR(b.MarkReady(id));
    }
    if (b.issued_buckets() != 1) return absl::InternalError("bucket 0 was not issued");
    GRADSUM_RETURN_IF_ERROR(b.AbandonStep());
    if (b.issued_buckets() != 0) return absl::InternalError("the step is still open");
    for (int id = 0; id < 4; ++id) {
      if (b.grad(id).data<float>()[0] != 0.0f) return absl::InternalError("storage not zeroed");
    }
    for (int id = 3; id >= 0; --id) {
      b.grad(id).data<float>()[0] = static_cast<float>(id + 1);
      GRADSUM_RETURN_IF_ERROR(b.MarkReady(id));
    }
    GRADSUM_RETURN_IF_ERROR(b.Finish());
    float host[2] = {0, 0};
    GRADSUM_RETURN_IF_ERROR(b.CopyBucketToHost(1, host));  // ids 1, 0 in storage order
    if (host[0] != 4.0f || host[1] != 2.0f) {
      return absl::InternalError(absl::StrCat("bucket 1 holds ", host[0], ", ", host[1]));
    }
    if (b.CopyBucketToHost(2, host).code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("bucket out of range accepted");
    }
    return absl::OkStatus();
  }));
}

TEST(GradBucketerTest, MisuseIsReported) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  Communicator* comm = (*comms)[0].get();
  GradBucketer b(comm);
  EXPECT_EQ(b.Register("neg", DType::kF32, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(b.Register("neg", DType::kF32, -1).status().message(), "-1"));
  EXPECT_EQ(b.Register("bad", static_cast<DType>(9), 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.MarkReady(0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b.Finish().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b.ZeroGrads().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(b.Register("x", DType::kF32, 4).ok());
  ASSERT_TRUE(b.Register("empty", DType::kF32, 0).ok());
  GRADSUM_EXPECT_OK(b.Finalize());
  EXPECT_EQ(b.Finalize().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b.Register("late", DType::kF32, 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b.MarkReady(2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.MarkReady(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.shard(0).numel(), 0);  // all-reduce mode has no shards
  // A zero-size gradient still has to be marked.
  GRADSUM_EXPECT_OK(b.MarkReady(0));
  EXPECT_EQ(b.Finish().code(), absl::StatusCode::kFailedPrecondition);
  GRADSUM_EXPECT_OK(b.MarkReady(1));
  GRADSUM_EXPECT_OK(b.Finish());

  GradBucketerOptions zero_cap;
  zero_cap.bucket_cap_bytes = 0;
  GradBucketer z(comm, zero_cap);
  EXPECT_EQ(z.Finalize().code(), absl::StatusCode::kInvalidArgument);
  GradBucketer null_comm(nullptr);
  EXPECT_EQ(null_comm.Finalize().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GradBucketerTest, ReduceScatterModeShardsThePaddedBucket) {
  const auto params = MixedParams(40);
  for (int world : {2, 3}) {
    absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
      GradBucketerOptions o;
      o.mode = GradBucketerOptions::Mode::kReduceScatter;
      o.bucket_cap_bytes = 8 << 10;
      GradBucketer b(&comm, o);
      GRADSUM_RETURN_IF_ERROR(RegisterAll(b, params));
      for (int id = b.num_params() - 1; id >= 0; --id) {
        WriteGrad(b.grad(id), comm.rank(), id, 0);
        GRADSUM_RETURN_IF_ERROR(b.MarkReady(id));
      }
      GRADSUM_RETURN_IF_ERROR(b.Finish());
      for (int k = 0; k < b.num_buckets(); ++k) {
        const GradBucketInfo& info = b.bucket(k);
        if (info.padded_numel % world != 0 || info.padded_numel < info.numel ||
            info.padded_numel >= info.numel + world) {
          return absl::InternalError(absl::StrCat("bucket ", k, " padded to ", info.padded_numel));
        }
        const TensorView shard = b.shard(k);
        const int64_t block = info.padded_numel / world;
        if (shard.numel() != block) return absl::InternalError("shard size");
        // Expected value of bucket element e (padding is zero on every rank: sums to 0).
        for (int64_t j = 0; j < block; ++j) {
          const int64_t e = comm.rank() * block + j;
          float want = 0.0f;
          for (size_t m = 0; m < info.param_ids.size(); ++m) {
            const int id = info.param_ids[m];
            if (e >= info.offsets[m] && e < info.offsets[m] + params[id].second) {
              want = ExpectedSum(info.dtype, world, id, e - info.offsets[m], 0);
            }
          }
          const float got = ReadElem(shard, j);
          if (got != want) {
            return absl::InternalError(absl::StrCat("bucket ", k, " shard element ", j, ": got ",
                                                    got, ", expected ", want));
          }
        }
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok()) << "world " << world << ": " << s;
  }
}

// int64 parameters (the exact-gradient limbs of reproducible mode) share buckets with
// nothing else and are summed exactly, wrapping modulo 2^64 like the backends (never UB).
TEST(GradBucketerTest, Int64ParametersSumExactlyAndWrap) {
  for (int world : {2, 3}) {
    absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
      GradBucketerOptions o;
      o.bucket_cap_bytes = 256;
      GradBucketer b(&comm, o);
      GRADSUM_ASSIGN_OR_RETURN(int f, b.Register("f", DType::kF32, 10));
      GRADSUM_ASSIGN_OR_RETURN(int i, b.Register("limbs", DType::kI64, 50));
      GRADSUM_RETURN_IF_ERROR(b.Finalize());
      for (int k = 0; k < b.num_buckets(); ++k) {
        for (int id : b.bucket(k).param_ids) {
          if (b.bucket(k).dtype != (id == i ? DType::kI64 : DType::kF32)) {
            return absl::InternalError(absl::StrCat("bucket ", k, " mixes dtypes"));
          }
        }
      }
      // Element j on rank r: big values whose sum overflows int64 for j odd.
      auto value = [](int r, int64_t j) -> int64_t {
        return j % 2 ? INT64_MAX - r : (int64_t{1} << 40) * (r + 1) - j;
      };
      int64_t* g = b.grad(i).data<int64_t>();
      for (int64_t j = 0; j < 50; ++j) g[j] = value(comm.rank(), j);
      std::fill_n(b.grad(f).data<float>(), 10, 1.0f);
      GRADSUM_RETURN_IF_ERROR(b.MarkReady(i));
      GRADSUM_RETURN_IF_ERROR(b.MarkReady(f));
      GRADSUM_RETURN_IF_ERROR(b.Finish());
      for (int64_t j = 0; j < 50; ++j) {
        uint64_t want = 0;
        for (int r = 0; r < comm.size(); ++r) want += static_cast<uint64_t>(value(r, j));
        const int64_t got = b.grad(i).data<int64_t>()[j];
        if (static_cast<uint64_t>(got) != want) {
          return absl::InternalError(absl::StrCat("element ", j, ": got ", got));
        }
      }
      if (b.grad(f).data<float>()[9] != static_cast<float>(comm.size())) {
        return absl::InternalError("f32 parameter");
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok()) << "world " << world << ": " << s;
  }
}

}  // namespace
}  // namespace gradsum
