// Exact-gradient mode (FlatParamOptions::exact_grads, SEMANTICS.md §11): the reduced
// gradient and the global norm are the same bits for every world size, micro-batch count,
// sharding mode and reduction path (FlatParam's own, BucketedGradReducer), with the
// contributions ("sequences") split differently over ranks and micro-batches, and equal to
// an independent reference (testing/exact_sum_reference.h: __int128 sums of each
// contribution rounded to the LSB).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/exact_sum.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "sharding/bucketed_reduce.h"
#include "sharding/flat_param.h"
#include "sharding/grad_norm.h"
#include "sharding/test_util.h"
#include "testing/exact_sum_reference.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

namespace ref = exact_reference;
using sharding_testing::DenseSpecs;
using testing::RunRanks;

constexpr int kSequences = 24;

std::vector<std::vector<ParamSpec>> GroupSpecs() {
  return {DenseSpecs(), {{"w", {4, 6}}, {"b", {5}}}};
}

int64_t Numel(const ParamSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  return n;
}

// Sequence j's contribution to parameter (group, param): `count` values starting at
// element `offset` (some sequences touch only part of a parameter, like embedding rows).
struct Contribution {
  int64_t offset = 0;
  std::vector<float> values;
};
Contribution MakeContribution(int group, int param, int j, int64_t numel) {
  std::mt19937 rng(static_cast<uint32_t>(1000 * group + 100 * param + j + 1));
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-30, 0);
  Contribution c;
  if (numel > 0 && j % 3 == 2) {
    c.offset = static_cast<int64_t>(rng() % numel);
    c.values.resize(static_cast<size_t>(1 + rng() % (numel - c.offset)));
  } else {
    c.values.resize(static_cast<size_t>(numel));
  }
  for (float& v : c.values) v = std::ldexp(mant(rng), ex(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
  return c;
}

struct Result {
  std::vector<std::vector<float>> grads;  // per group, numel elements
  double norm = 0;
};

// The reference: per element, the __int128 sum of every sequence's rounded contribution.
Result Reference() {
  Result r;
  ref::i128 sq = 0;
  const auto specs = GroupSpecs();
  for (size_t g = 0; g < specs.size(); ++g) {
    std::vector<float> flat;
    for (size_t p = 0; p < specs[g].size(); ++p) {
      const int64_t n = Numel(specs[g][p]);
      std::vector<ref::i128> acc(n, 0);
      for (int j = 0; j < kSequences; ++j) {
        const Contribution c = MakeContribution(g, p, j, n);
        for (size_t i = 0; i < c.values.size(); ++i) {
          acc[c.offset + i] += ref::Units(c.values[i], exact::kLsbExponent);
        }
      }
      for (ref::i128 v : acc) {
        const float f = ref::ToFloat(v, exact::kLsbExponent);
        flat.push_back(f);
        sq += ref::Units(static_cast<double>(f) * f, -100);
      }
    }
    r.grads.push_back(std::move(flat));
  }
  r.norm = std::sqrt(ref::ToDouble(sq, -100));
  return r;
}

struct Config {
  int world;
  int micro_batches;
  ShardingMode mode;
  bool reduce_every_micro_batch;
  bool bucketed;  // replicated only: through BucketedGradReducer
  std::string Name() const {
    return absl::StrCat("world ", world, " G ", micro_batches, " ", ShardingModeName(mode),
                        reduce_every_micro_batch ? "" : " reduce-last", bucketed ? " bucketed" : "");
  }
};

// Sequence j goes to slot (j + shift) % (W * G): micro-batch slot / W, rank slot % W.
absl::StatusOr<Result> RunMesh(const Config& cfg, int shift, int nan_rank = -1) {
  const auto specs = GroupSpecs();
  Result out;
  for (const auto& s : specs) {
    int64_t n = 0;
    for (const auto& p : s) n += Numel(p);
    out.grads.emplace_back(n, -12345.0f);
  }
  std::mutex mu;
  std::vector<double> norms(cfg.world, 0.0);
  absl::Status s = RunRanks(cfg.world, [&](Communicator& comm) -> absl::Status {
    FlatParamOptions opts;
    opts.mode = cfg.mode;
    opts.exact_grads = true;
    opts.reduce_every_micro_batch = cfg.reduce_every_micro_batch;
    std::vector<std::unique_ptr<FlatParam>> groups;
    std::vector<FlatParam*> ptrs;
    for (size_t g = 0; g < specs.size(); ++g) {
      GRADSUM_ASSIGN_OR_RETURN(auto fp, FlatParam::Create(absl::StrCat("g", g), specs[g], &comm, opts));
      ptrs.push_back(fp.get());
      groups.push_back(std::move(fp));
    }
    std::unique_ptr<BucketedGradReducer> reducer;
    if (cfg.bucketed) {
      GRADSUM_ASSIGN_OR_RETURN(reducer, BucketedGradReducer::Create(ptrs, /*cap=*/256));
    }
    const int W = cfg.world, G = cfg.micro_batches;
    bool injected = false;  // nan_rank's first contribution to g0's second parameter
    for (int m = 0; m < G; ++m) {
      const bool last = m == G - 1;
      for (size_t g = 0; g < groups.size(); ++g) {
        FlatParam& fp = *groups[g];
        for (int j = 0; j < kSequences; ++j) {
          const int slot = (j + shift) % (W * G);
          if (slot / W != m || slot % W != comm.rank()) continue;
          for (int p = 0; p < fp.num_params(); ++p) {
            Contribution c = MakeContribution(g, p, j, fp.entries()[p].numel);
            if (comm.rank() == nan_rank && g == 0 && p == 1 && !injected) {
              c.values[0] = std::numeric_limits<float>::quiet_NaN();
              injected = true;
            }
            if (j % 2 == 0) {
              GRADSUM_RETURN_IF_ERROR(fp.AddExactGrad(p, c.offset, c.values));
            } else {
              // The lower-level route: the limb view and exact::AddFloats.
              GRADSUM_ASSIGN_OR_RETURN(absl::Span<int64_t> limbs, fp.exact_grad(p));
              int64_t rejected = 0;
              GRADSUM_RETURN_IF_ERROR(exact::AddFloats(
                  c.values,
                  limbs.subspan(c.offset * exact::kLimbs, c.values.size() * exact::kLimbs),
                  &rejected));
              fp.CountRejectedExactGrad(rejected);
            }
          }
        }
        if (cfg.bucketed) {
          if (!last) {
            GRADSUM_RETURN_IF_ERROR(fp.StartGradReduce(false));  // normalises only
          }
        } else {
          GRADSUM_RETURN_IF_ERROR(fp.StartGradReduce(last));
        }
      }
      if (cfg.bucketed && last) {
        for (int g = static_cast<int>(groups.size()) - 1; g >= 0; --g) {
          GRADSUM_RETURN_IF_ERROR(reducer->GroupReady(g));
        }
        GRADSUM_RETURN_IF_ERROR(reducer->Finish());
      }
      for (auto& fp : groups) GRADSUM_RETURN_IF_ERROR(fp->FinishGradReduce());
    }
    GRADSUM_ASSIGN_OR_RETURN(double norm, GlobalGradNorm(ptrs, comm));
    std::lock_guard<std::mutex> lock(mu);
    norms[comm.rank()] = norm;
    for (size_t g = 0; g < groups.size(); ++g) {
      absl::Span<const float> owned = groups[g]->owned_grad();
      std::copy(owned.begin(), owned.end(), out.grads[g].begin() + groups[g]->shard_offset());
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  for (int r = 1; r < cfg.world; ++r) {
    if (std::memcmp(&norms[r], &norms[0], sizeof(double)) != 0) {
      return absl::InternalError(absl::StrCat("rank ", r, " norm ", norms[r], " != ", norms[0]));
    }
  }
  out.norm = norms[0];
  return out;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<Config> AllConfigs() {
  std::vector<Config> c;
  for (int w : {1, 2, 3, 4}) {
    for (int g : {1, 2, 3}) {
      c.push_back({w, g, ShardingMode::kSharded, true, false});
      c.push_back({w, g, ShardingMode::kSharded, false, false});
      c.push_back({w, g, ShardingMode::kReplicated, true, false});
      c.push_back({w, g, ShardingMode::kReplicated, true, true});
    }
  }
  return c;
}

TEST(ExactGradTest, EveryMeshGivesTheReferenceBits) {
  const Result want = Reference();
  ASSERT_TRUE(std::isfinite(want.norm));
  for (const Config& cfg : AllConfigs()) {
    for (int shift : {0, 5}) {
      absl::StatusOr<Result> got = RunMesh(cfg, shift);
      ASSERT_TRUE(got.ok()) << cfg.Name() << ": " << got.status();
      for (size_t g = 0; g < want.grads.size(); ++g) {
        for (size_t i = 0; i < want.grads[g].size(); ++i) {
          ASSERT_EQ(Bits(got->grads[g][i]), Bits(want.grads[g][i]))
              << cfg.Name() << " shift " << shift << " group " << g << " element " << i << ": "
              << got->grads[g][i] << " vs " << want.grads[g][i];
        }
      }
      ASSERT_EQ(got->norm, want.norm) << cfg.Name();
    }
  }
}

TEST(ExactGradTest, AccurateAgainstLongDouble) {
  // The exact mode still equals the real sum to fp32 rounding (SEMANTICS.md §11).
  const Result want = Reference();
  const auto specs = GroupSpecs();
  for (size_t g = 0; g < specs.size(); ++g) {
    size_t base = 0;
    for (size_t p = 0; p < specs[g].size(); ++p) {
      const int64_t n = Numel(specs[g][p]);
      std::vector<long double> sum(n, 0.0L);
      for (int j = 0; j < kSequences; ++j) {
        const Contribution c = MakeContribution(g, p, j, n);
        for (size_t i = 0; i < c.values.size(); ++i) sum[c.offset + i] += c.values[i];
      }
      for (int64_t i = 0; i < n; ++i) {
        const long double err = std::fabs(want.grads[g][base + i] - sum[i]);
        EXPECT_LE(err, std::fabs(sum[i]) * std::ldexp(1.0L, -24) + std::ldexp(1.0L, -57));
      }
      base += n;
    }
  }
}

TEST(ExactGradTest, ARejectedContributionMakesTheGroupNaNOnEveryRank) {
  const Result want = Reference();
  for (const Config& cfg : {Config{2, 2, ShardingMode::kSharded, true, false},
                            Config{3, 1, ShardingMode::kReplicated, true, false},
                            Config{2, 2, ShardingMode::kReplicated, true, true}}) {
    absl::StatusOr<Result> got = RunMesh(cfg, 0, /*nan_rank=*/1);
    ASSERT_TRUE(got.ok()) << cfg.Name() << ": " << got.status();
    for (float x : got->grads[0]) ASSERT_TRUE(std::isnan(x)) << cfg.Name();
    for (size_t i = 0; i < want.grads[1].size(); ++i) {
      ASSERT_EQ(Bits(got->grads[1][i]), Bits(want.grads[1][i])) << cfg.Name();
    }
    EXPECT_TRUE(std::isnan(got->norm)) << cfg.Name();
  }
}

TEST(ExactGradTest, MisuseIsReported) {
  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    FlatParamOptions exact_opts;
    exact_opts.exact_grads = true;
    FlatParamOptions bf16 = exact_opts;
    bf16.reduce_dtype = DType::kBF16;
    auto bad = FlatParam::Create("x", DenseSpecs(), &comm, bf16);
    if (bad.status().code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError(absl::StrCat("bf16 reduce in exact mode: ", bad.status().ToString()));
    }
    GRADSUM_ASSIGN_OR_RETURN(auto ex, FlatParam::Create("ex", DenseSpecs(), &comm, exact_opts));
    GRADSUM_ASSIGN_OR_RETURN(auto plain, FlatParam::Create("plain", DenseSpecs(), &comm));
    if (ex->grad(0).status().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("fp32 grad() in exact mode was accepted");
    }
    if (plain->exact_grad(0).status().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("exact_grad() outside exact mode was accepted");
    }
    if (ex->exact_grad(99).status().code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("bad index accepted");
    }
    const std::vector<float> three(3, 1.0f);
    absl::Status range = ex->AddExactGrad(0, 5, three);  // param 0 has 7 elements
    if (range.code() != absl::StatusCode::kInvalidArgument ||
        range.message().find("offset 5") == absl::string_view::npos) {
      return absl::InternalError(absl::StrCat("out-of-range AddExactGrad: ", range.ToString()));
    }
    if (ex->AddExactGrad(0, -1, three).code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("negative offset accepted");
    }
    if (ex->FoldReducedGrad(std::vector<float>(ex->shard_numel()), true).code() !=
        absl::StatusCode::kUnimplemented) {
      return absl::InternalError("FoldReducedGrad in exact mode was accepted");
    }
    GRADSUM_RETURN_IF_ERROR(ex->StartGradReduce(true));
    if (ex->exact_grad(0).status().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("exact_grad() during a reduction was accepted");
    }
    GRADSUM_RETURN_IF_ERROR(ex->FinishGradReduce());
    std::vector<FlatParam*> mixed = {ex.get(), plain.get()};
    if (GlobalGradNorm(mixed, comm).status().code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("a norm over exact and fp32 groups was accepted");
    }
    FlatParamOptions rep = exact_opts;
    rep.mode = ShardingMode::kReplicated;
    GRADSUM_ASSIGN_OR_RETURN(auto r1, FlatParam::Create("r1", DenseSpecs(), &comm, rep));
    FlatParamOptions rep_plain;
    rep_plain.mode = ShardingMode::kReplicated;
    GRADSUM_ASSIGN_OR_RETURN(auto r2, FlatParam::Create("r2", DenseSpecs(), &comm, rep_plain));
    if (BucketedGradReducer::Create({r1.get(), r2.get()}).status().code() !=
        absl::StatusCode::kInvalidArgument) {
      return absl::InternalError("a reducer over exact and fp32 groups was accepted");
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum
