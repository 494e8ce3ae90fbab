#include "parallel/flat_param.h"

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/thread_backend.h"
#include "core/half.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "parallel/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

using sharding_testing::DenseSpecs;
using sharding_testing::InitGroup;
using sharding_testing::InitValue;
using sharding_testing::Noise;
using testing::RunRanks;

int64_t DenseNumel() {
  int64_t n = 0;
  for (const ParamSpec& p : DenseSpecs()) {
    int64_t k = 1;
    for (int64_t d : p.shape) k *= d;
    n += k;
  }
  return n;
}

TEST(FlatParamTest, LayoutPadsToGroupSizeAndOwnedSlicesTile) {
  const int64_t numel = DenseNumel();  // 36
  for (int world = 1; world <= 8; ++world) {
    auto comms = CreateThreadCommunicators(world);
    ASSERT_TRUE(comms.ok());
    int64_t covered = 0;
    for (int r = 0; r < world; ++r) {
      auto fp = FlatParam::Create("dense", DenseSpecs(), (*comms)[r].get());
      ASSERT_TRUE(fp.ok()) << fp.status();
      const FlatParam& g = **fp;
      EXPECT_EQ(g.numel(), numel);
      EXPECT_EQ(g.padded_numel() % world, 0);
      EXPECT_GE(g.padded_numel(), numel);
      EXPECT_LT(g.padded_numel() - numel, world);
      EXPECT_EQ(g.shard_numel() * world, g.padded_numel());
      EXPECT_EQ(g.shard_offset(), covered);
      covered += g.local_numel();
      EXPECT_EQ(g.master().size(), static_cast<size_t>(g.local_numel()));
      EXPECT_EQ(g.entries()[4].offset, 7 + 13 + 1 + 0);
      EXPECT_EQ(g.entries()[4].numel, 15);
    }
    // Shards are contiguous; only the last ranks' slices contain padding.
    EXPECT_EQ(covered, numel) << "world " << world;
  }
}

TEST(FlatParamTest, CreateRejectsBadArguments) {
  auto comms = CreateThreadCommunicators(1);
  ASSERT_TRUE(comms.ok());
  Communicator* c = (*comms)[0].get();
  EXPECT_EQ(FlatParam::Create("g", DenseSpecs(), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FlatParam::Create("", DenseSpecs(), c).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto dup = FlatParam::Create("g", {{"a", {2}}, {"a", {3}}}, c);
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("\"a\""), std::string::npos);
  EXPECT_EQ(FlatParam::Create("g", {{"", {2}}}, c).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FlatParam::Create("g", {{"a", {2, -1}}}, c).status().code(),
            absl::StatusCode::kInvalidArgument);
  FlatParamOptions f16;
  f16.compute_dtype = DType::kF16;
  auto bad_dtype = FlatParam::Create("g", DenseSpecs(), c, f16);
  EXPECT_EQ(bad_dtype.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_dtype.status().message().find("f16"), std::string::npos);
  FlatParamOptions bad_precision;
  bad_precision.precision = static_cast<GradPrecision>(7);
  EXPECT_EQ(FlatParam::Create("g", DenseSpecs(), c, bad_precision).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto fp = FlatParam::Create("g", DenseSpecs(), c);
  ASSERT_TRUE(fp.ok());
  EXPECT_EQ((*fp)->SetFullValue(0, std::vector<float>(6)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*fp)->SetFullValue(9, std::vector<float>(7)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*fp)->grad(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*fp)->param(0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*fp)->WaitUnshard().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*fp)->IndexOf("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*(*fp)->IndexOf("head"), 4);
}

// Unshard gathers exactly the initial values (fp32) or their bf16 roundings, for every
// world size and both modes; the empty parameter stays empty.
TEST(FlatParamTest, UnshardReturnsFullValuesForWorldSizes1To8) {
  for (int world = 1; world <= 8; ++world) {
    for (ShardingMode mode : {ShardingMode::kSharded, ShardingMode::kReplicated}) {
      for (DType compute : {DType::kF32, DType::kBF16}) {
        absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
          FlatParamOptions opts;
          opts.mode = mode;
          opts.compute_dtype = compute;
          GRADSUM_ASSIGN_OR_RETURN(auto fp, FlatParam::Create("dense", DenseSpecs(), &comm, opts));
          GRADSUM_RETURN_IF_ERROR(InitGroup(*fp));
          for (int round = 0; round < 2; ++round) {  // unshard, reshard, unshard again
            GRADSUM_RETURN_IF_ERROR(fp->Unshard());
            for (int p = 0; p < fp->num_params(); ++p) {
              const FlatParamEntry& e = fp->entries()[p];
              GRADSUM_ASSIGN_OR_RETURN(TensorView t, fp->param(p));
              const std::vector<float> want = InitValue(e.name, e.numel);
              if (t.shape() != e.shape || t.dtype() != compute) {
                return absl::InternalError(absl::StrCat("bad view ", t.DebugString()));
              }
              for (int64_t i = 0; i < e.numel; ++i) {
                const float got =
                    compute == DType::kBF16 ? t.data<BF16>()[i].ToFloat() : t.data<float>()[i];
                const float expect =
                    compute == DType::kBF16 ? BF16::FromFloat(want[i]).ToFloat() : want[i];
                if (got != expect) {
                  return absl::InternalError(
                      absl::StrCat(e.name, "[", i, "] = ", got, ", want ", expect));
                }
              }
            }
            GRADSUM_RETURN_IF_ERROR(fp->Reshard());
            if (fp->is_unsharded()) return absl::InternalError("still unsharded after Reshard");
          }
          return absl::OkStatus();
        });
        EXPECT_TRUE(s.ok()) << "world " << world << " mode " << ShardingModeName(mode) << " "
                            << DTypeName(compute) << ": " << s;
      }
    }
  }
}

TEST(FlatParamTest, PrefetchOverlapsAndInFlightMisuseIsRefused) {
  absl::Status s = RunRanks(4, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(auto a, FlatParam::Create("a", {{"x", {5}}}, &comm));
    GRADSUM_ASSIGN_OR_RETURN(auto b, FlatParam::Create("b", {{"y", {9}}}, &comm));
    GRADSUM_RETURN_IF_ERROR(InitGroup(*a));
    GRADSUM_RETURN_IF_ERROR(InitGroup(*b));
    GRADSUM_RETURN_IF_ERROR(a->Unshard());
    GRADSUM_RETURN_IF_ERROR(b->StartUnshard());  // prefetch b while a is in use
    // The gather stays "in flight" until WaitUnshard, whether or not the peers finished.
    if (!b->unshard_in_flight()) return absl::InternalError("prefetch not in flight");
    if (b->param(0).status().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("param() during an in-flight gather was accepted");
    }
    if (b->Reshard().code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("Reshard during an in-flight gather was accepted");
    }
    if (b->SetFullValue(0, std::vector<float>(9)).code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("SetFullValue during an in-flight gather was accepted");
    }
    GRADSUM_ASSIGN_OR_RETURN(TensorView x, a->param(0));
    if (x.data<float>()[4] != InitValue("x", 5)[4]) return absl::InternalError("a wrong");
    GRADSUM_RETURN_IF_ERROR(b->WaitUnshard());
    GRADSUM_ASSIGN_OR_RETURN(TensorView y, b->param(0));
    for (int i = 0; i < 9; ++i) {
      if (y.data<float>()[i] != InitValue("y", 9)[i]) return absl::InternalError("b wrong");
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

// Rank r's gradient for micro-batch m (arbitrary fp32 values).
float Grad(const std::string& name, int64_t i, int rank, int micro) {
  return static_cast<float>(Noise(name, i, rank, micro, 5));
}
// Small dyadic values: every partial sum of up to 8 ranks x 4 micro-batches is exact in fp32.
float DyadicGrad(const std::string& name, int64_t i, int rank, int micro) {
  return static_cast<float>(std::floor(Noise(name, i, rank, micro, 9) * 1024.0) / 256.0);
}

struct ReduceCase {
  ShardingMode mode;
  GradPrecision precision;
  int micro_batches;
  bool dyadic;
};

// Runs G micro-batches of gradient reduction on `world` ranks; returns each rank's owned
// gradient slice and master_grad() (the whole gradient in replicated mode).
absl::Status ReduceOnRanks(int world, const ReduceCase& c, std::vector<std::vector<float>>* owned,
                           std::vector<double>* norms_sq) {
  owned->assign(world, {});
  norms_sq->assign(world, 0.0);
  return RunRanks(world, [&](Communicator& comm) -> absl::Status {
    FlatParamOptions opts;
    opts.mode = c.mode;
    opts.precision = c.precision;
    GRADSUM_ASSIGN_OR_RETURN(auto fp, FlatParam::Create("dense", DenseSpecs(), &comm, opts));
    for (int m = 0; m < c.micro_batches; ++m) {
      for (int p = 0; p < fp->num_params(); ++p) {
        const FlatParamEntry& e = fp->entries()[p];
        GRADSUM_ASSIGN_OR_RETURN(TensorView g, fp->grad(p));
        for (int64_t i = 0; i < e.numel; ++i) {
          g.data<float>()[i] +=
              c.dyadic ? DyadicGrad(e.name, i, comm.rank(), m) : Grad(e.name, i, comm.rank(), m);
        }
      }
      GRADSUM_RETURN_IF_ERROR(fp->ReduceGrad(m == c.micro_batches - 1));
    }
    absl::Span<const float> og = fp->owned_grad();
    (*owned)[comm.rank()].assign(og.begin(), og.end());
    (*norms_sq)[comm.rank()] = fp->OwnedGradSquaredNorm();
    if (c.mode == ShardingMode::kReplicated) {
      // The full copy on every rank equals the owned slices (checked by the caller) here.
      absl::Span<const float> full = fp->master_grad();
      if (full.size() != static_cast<size_t>(fp->numel())) return absl::InternalError("size");
      for (size_t i = 0; i < og.size(); ++i) {
        if (std::memcmp(&og[i], &full[fp->shard_offset() + i], 4) != 0) {
          return absl::InternalError("owned slice is not the full copy's slice");
        }
      }
    }
    return absl::OkStatus();
  });
}

// Concatenates the owned slices of all ranks (the flat gradient without padding).
std::vector<float> Concat(const std::vector<std::vector<float>>& owned) {
  std::vector<float> out;
  for (const auto& o : owned) out.insert(out.end(), o.begin(), o.end());
  return out;
}

// Single-process double reference of the summed flat gradient.
std::vector<double> ReferenceGrad(int world, int micro_batches, bool dyadic) {
  std::vector<double> out;
  for (const ParamSpec& p : DenseSpecs()) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    for (int64_t i = 0; i < n; ++i) {
      double s = 0;
      for (int r = 0; r < world; ++r) {
        for (int m = 0; m < micro_batches; ++m) {
          s += dyadic ? DyadicGrad(p.name, i, r, m) : Grad(p.name, i, r, m);
        }
      }
      out.push_back(s);
    }
  }
  return out;
}

TEST(FlatParamTest, SumReductionMatchesReferenceInBothModes) {
  for (int world = 1; world <= 8; ++world) {
    const std::vector<double> ref = ReferenceGrad(world, 3, false);
    for (ShardingMode mode : {ShardingMode::kSharded, ShardingMode::kReplicated}) {
      std::vector<std::vector<float>> owned;
      std::vector<double> norms;
      absl::Status s = ReduceOnRanks(world, {mode, GradPrecision::kF32, 3, false}, &owned, &norms);
      ASSERT_TRUE(s.ok()) << s;
      const std::vector<float> got = Concat(owned);
      ASSERT_EQ(got.size(), ref.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        // fp32 sums of world*3 terms of magnitude < 1.
        EXPECT_NEAR(got[i], ref[i], 3 * world * 3 * 6e-8) << "world " << world << " i " << i;
      }
      // The owned norms add up to the norm of the whole gradient: padding is not counted.
      double norm_sq = 0, ref_sq = 0;
      for (double x : norms) norm_sq += x;
      for (float g : got) ref_sq += static_cast<double>(g) * g;
      EXPECT_NEAR(norm_sq, ref_sq, ref_sq * 1e-14);
    }
  }
}

TEST(FlatParamTest, ShardedAndReplicatedAreBitIdentical) {
  for (int world = 1; world <= 8; ++world) {
    // G == 1, arbitrary values: both modes sum the same terms in ascending rank order.
    // G > 1 with dyadic values: every partial sum is exact, so order cannot matter.
    for (const auto& [micro, dyadic] : {std::pair<int, bool>{1, false}, {4, true}}) {
      std::vector<std::vector<float>> sharded, replicated;
      std::vector<double> n1, n2;
      const GradPrecision f32 = GradPrecision::kF32;
      ASSERT_TRUE(
          ReduceOnRanks(world, {ShardingMode::kSharded, f32, micro, dyadic}, &sharded, &n1).ok());
      ASSERT_TRUE(
          ReduceOnRanks(world, {ShardingMode::kReplicated, f32, micro, dyadic}, &replicated, &n2)
              .ok());
      const std::vector<float> a = Concat(sharded), b = Concat(replicated);
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "world " << world;
      EXPECT_EQ(n1, n2);
      if (dyadic) {
        const std::vector<double> ref = ReferenceGrad(world, micro, true);
        for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(a[i], ref[i]) << i;
      }
    }
  }
}

TEST(FlatParamTest, Bf16ReduceIsARealSumWithinBf16Rounding) {
  for (int world : {1, 2, 3, 5, 8}) {
    for (ShardingMode mode : {ShardingMode::kSharded, ShardingMode::kReplicated}) {
      std::vector<std::vector<float>> owned32, owned16;
      std::vector<double> n;
      ASSERT_TRUE(ReduceOnRanks(world, {mode, GradPrecision::kF32, 1, false}, &owned32, &n).ok());
      ASSERT_TRUE(
          ReduceOnRanks(world, {mode, GradPrecision::kBF16Wire, 1, false}, &owned16, &n).ok());
      const std::vector<float> f32 = Concat(owned32), bf16 = Concat(owned16);
      size_t i = 0;
      for (const ParamSpec& p : DenseSpecs()) {
        int64_t numel = 1;
        for (int64_t d : p.shape) numel *= d;
        for (int64_t k = 0; k < numel; ++k, ++i) {
          // The exact sum of the bf16-rounded inputs, rounded once to bf16: what a real
          // bf16 SUM with fp32 accumulation gives (up to fp32 accumulation error).
          double exact = 0, abs_sum = 0;
          for (int r = 0; r < world; ++r) {
            const float g = Grad(p.name, k, r, 0);
            exact += BF16::FromFloat(g).ToFloat();
            abs_sum += std::fabs(g);
          }
          EXPECT_TRUE(BF16::FromFloat(bf16[i]).ToFloat() == bf16[i]) << "not a bf16 value";
          const double ulp = std::ldexp(1.0, std::ilogb(std::fabs(exact) + 1e-30) - 7);
          EXPECT_LE(std::fabs(bf16[i] - exact), 0.5 * ulp + abs_sum * 1e-7)
              << "world " << world << " " << p.name << "[" << k << "]";
          // And against the fp32 reduction: input and output rounding of bf16 only.
          // bf16 keeps 8 significant bits: unit roundoff 2^-8 per input and once for the output.
          EXPECT_LE(std::fabs(bf16[i] - f32[i]),
                    abs_sum * 0x1p-8 * (1 + 0x1p-8) + std::fabs(f32[i]) * 0x1p-8);
        }
      }
    }
  }
  // A real SUM, not an average: eight ranks of 1.0 give 8.0, and tiny values do not
  // vanish (a pre-divided sum of 1e-38 / 8 would fall into bf16 subnormals).
  for (float v : {1.0f, 3e-38f}) {
    absl::Status s = RunRanks(8, [&](Communicator& comm) -> absl::Status {
      FlatParamOptions opts;
      opts.precision = GradPrecision::kBF16Wire;
      GRADSUM_ASSIGN_OR_RETURN(auto fp, FlatParam::Create("g", {{"w", {8}}}, &comm, opts));
      GRADSUM_ASSIGN_OR_RETURN(TensorView g, fp->grad(0));
      for (int i = 0; i < 8; ++i) g.data<float>()[i] = v;
      GRADSUM_RETURN_IF_ERROR(fp->ReduceGrad(true));
      const float want = BF16::FromFloat(8 * BF16::FromFloat(v).ToFloat()).ToFloat();
      if (fp->master_grad()[0] != want) {
        return absl::InternalError(absl::StrCat("sum ", fp->master_grad()[0], " want ", want));
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(FlatParamTest, GradReduceMisuseIsRefused) {
  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(auto fp, FlatParam::Create("g", {{"w", {3}}}, &comm));
    GRADSUM_RETURN_IF_ERROR(fp->StartGradReduce(true));
    const bool refused =
        fp->StartGradReduce(true).code() == absl::StatusCode::kFailedPrecondition &&
        fp->grad(0).status().code() == absl::StatusCode::kFailedPrecondition &&
        fp->ZeroGrad().code() == absl::StatusCode::kFailedPrecondition;
    GRADSUM_RETURN_IF_ERROR(fp->FinishGradReduce());
    if (!refused) return absl::InternalError("misuse during an in-flight reduction accepted");
    return fp->FinishGradReduce();  // nothing in flight: OK
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(FlatParamTest, MasterVersionCountsAnnouncedChanges) {
  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(auto fp, FlatParam::Create("g", {{"w", {3}}, {"b", {2}}}, &comm));
    const uint64_t v0 = fp->master_version();
    GRADSUM_RETURN_IF_ERROR(fp->SetFullValue(0, {1, 2, 3}));
    const uint64_t v1 = fp->master_version();
    GRADSUM_RETURN_IF_ERROR(fp->Unshard());  // reading does not change it
    GRADSUM_RETURN_IF_ERROR(fp->ReduceGrad(true));
    const uint64_t v2 = fp->master_version();
    GRADSUM_RETURN_IF_ERROR(fp->MasterUpdated());
    const uint64_t v3 = fp->master_version();
    if (!(v1 > v0 && v2 == v1 && v3 > v2)) {
      return absl::InternalError(absl::StrCat("versions ", v0, " ", v1, " ", v2, " ", v3));
    }
    // A refused change does not count.
    if (fp->SetFullValue(0, {1, 2}).ok() || fp->master_version() != v3) {
      return absl::InternalError("a rejected SetFullValue changed the version");
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

// A gradient reduced elsewhere (the GPU path reduces on the device with NCCL) folds in as
// the FlatParam's own reduction would: the test plays the device, summing the ranks'
// dyadic gradients exactly, and checks owned_grad() against the single-process reference.
TEST(FlatParamTest, FoldReducedGradAccumulatesExternalReductions) {
  for (int world : {1, 3, 4}) {
    const int G = 3;
    const std::vector<double> ref = ReferenceGrad(world, G, /*dyadic=*/true);
    for (ShardingMode mode : {ShardingMode::kSharded, ShardingMode::kReplicated}) {
      std::vector<std::vector<float>> owned(world);
      absl::Status s = RunRanks(world, [&](Communicator& comm) -> absl::Status {
        FlatParamOptions opts;
        opts.mode = mode;
        GRADSUM_ASSIGN_OR_RETURN(auto fp, FlatParam::Create("dense", DenseSpecs(), &comm, opts));
        // Micro-batch m's SUM over ranks (sharded), or the step's sum (replicated), of the
        // flat gradient with its padding.
        auto reduced = [&](int first_m, int last_m) {
          std::vector<float> full(fp->padded_numel(), 0.0f);
          for (const FlatParamEntry& e : fp->entries()) {
            for (int64_t i = 0; i < e.numel; ++i) {
              double sum = 0;
              for (int r = 0; r < world; ++r) {
                for (int m = first_m; m <= last_m; ++m) sum += DyadicGrad(e.name, i, r, m);
              }
              full[e.offset + i] = static_cast<float>(sum);
            }
          }
          return full;
        };
        if (mode == ShardingMode::kSharded) {
          for (int m = 0; m < G; ++m) {
            std::vector<float> full = reduced(m, m);
            // Garbage in the shard's padding must not survive.
            for (int64_t i = fp->numel(); i < fp->padded_numel(); ++i) full[i] = 1e30f;
            GRADSUM_RETURN_IF_ERROR(fp->FoldReducedGrad(
                absl::MakeConstSpan(full).subspan(fp->shard_offset(), fp->shard_numel()),
                m == G - 1));
          }
        } else {
          std::vector<float> full = reduced(0, G - 1);
          if (fp->FoldReducedGrad(full, /*last_micro_batch=*/false).code() !=
              absl::StatusCode::kInvalidArgument) {
            return absl::InternalError("replicated fold before the last micro-batch accepted");
          }
          GRADSUM_RETURN_IF_ERROR(fp->FoldReducedGrad(full, true));
        }
        // Wrong sizes are refused, naming the expected count.
        absl::Status bad = fp->FoldReducedGrad(std::vector<float>(fp->padded_numel() + 1), true);
        if (bad.code() != absl::StatusCode::kInvalidArgument ||
            bad.message().find("expected") == absl::string_view::npos) {
          return absl::InternalError(absl::StrCat("wrong-size fold: ", bad.ToString()));
        }
        absl::Span<const float> og = fp->owned_grad();
        owned[comm.rank()].assign(og.begin(), og.end());
        double norm_sq = 0;
        for (float g : og) norm_sq += static_cast<double>(g) * g;
        if (norm_sq != fp->OwnedGradSquaredNorm()) return absl::InternalError("padding counted");
        return absl::OkStatus();
      });
      ASSERT_TRUE(s.ok()) << s;
      const std::vector<float> got = Concat(owned);
      ASSERT_EQ(got.size(), ref.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        EXPECT_EQ(got[i], ref[i]) << ShardingModeName(mode) << " world " << world << " i " << i;
      }
    }
  }
}

// ---- HSDP (SEMANTICS.md §7): sharded over shard groups of N consecutive ranks, replicated
// across the world / N groups. ----

struct HsdpResult {
  std::vector<float> flat;                 // the owned slices at their offsets (the flat gradient)
  std::vector<int> owners;                 // per flat element: how many ranks own it
  std::vector<double> norms_sq;            // per rank: OwnedGradSquaredNorm
  std::vector<std::vector<float>> shards;  // per rank: master_grad() (its whole shard)
};

// G micro-batches of reduction on `world` ranks in shard groups of `n` (n == world: no
// replicas, plain sharded mode). `advance`: the last micro-batch goes through
// AdvanceGradReduce before FinishGradReduce, as the unit schedule does. `external`: the
// in-group reduce-scatter happens outside, as a GPU's NCCL does (here the shard group's sum
// computed directly), and FoldReducedGrad folds it, its last call starting the sum across
// the replicas, which FinishGradReduce completes.
absl::Status HsdpReduceOnRanks(int world, int n, GradPrecision precision, int micro_batches,
                               bool advance, HsdpResult* out, bool external = false) {
  const int64_t numel = DenseNumel();
  std::vector<std::vector<float>> owned(world);
  std::vector<int64_t> offsets(world);
  out->norms_sq.assign(world, 0.0);
  out->shards.assign(world, {});
  GRADSUM_RETURN_IF_ERROR(RunRanks(world, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank() / n, q = comm.rank() % n;
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> shard, comm.Split(r, q));
    GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> replica, comm.Split(q, r));
    FlatParamOptions opts;
    opts.precision = precision;
    opts.replica_group = replica.get();
    GRADSUM_ASSIGN_OR_RETURN(auto fp, FlatParam::Create("dense", DenseSpecs(), shard.get(), opts));
    const int R = world / n;
    if (fp->padded_numel() % world != 0 || fp->owned_group_size() != world ||
        fp->owned_group_rank() != q * R + r || fp->shard_numel() * n != fp->padded_numel()) {
      return absl::InternalError(absl::StrCat("layout: padded ", fp->padded_numel(), " owned ",
                                              fp->owned_group_rank(), "/", fp->owned_group_size()));
    }
    for (int m = 0; m < micro_batches && external; ++m) {
      // The shard group's SUM of micro-batch m's flat gradient, this rank's shard of it.
      std::vector<float> full(fp->padded_numel(), 0.0f);
      for (const FlatParamEntry& e : fp->entries()) {
        for (int64_t i = 0; i < e.numel; ++i) {
          float sum = 0.0f;
          for (int member = 0; member < n; ++member) sum += Grad(e.name, i, r * n + member, m);
          full[e.offset + i] = sum;
        }
      }
      const bool last = m == micro_batches - 1;
      GRADSUM_RETURN_IF_ERROR(fp->FoldReducedGrad(
          absl::MakeConstSpan(full).subspan(fp->shard_offset(), fp->shard_numel()), last));
      // The last fold leaves the replica stage in flight (with replicas), until
      // FinishGradReduce.
      if (last && fp->grad_reduce_in_flight() != (world / n > 1)) {
        return absl::InternalError("the replica stage is not in flight after the last fold");
      }
    }
    if (external) GRADSUM_RETURN_IF_ERROR(fp->FinishGradReduce());
    for (int m = 0; m < micro_batches && !external; ++m) {
      for (int p = 0; p < fp->num_params(); ++p) {
        const FlatParamEntry& e = fp->entries()[p];
        std::vector<float> g(e.numel);
        for (int64_t i = 0; i < e.numel; ++i) g[i] = Grad(e.name, i, comm.rank(), m);
        if (IsExact(precision)) {
          GRADSUM_RETURN_IF_ERROR(fp->AddExactGrad(p, 0, g));
        } else {
          GRADSUM_ASSIGN_OR_RETURN(TensorView t, fp->grad(p));
          for (int64_t i = 0; i < e.numel; ++i) t.data<float>()[i] += g[i];
        }
      }
      const bool last = m == micro_batches - 1;
      GRADSUM_RETURN_IF_ERROR(fp->StartGradReduce(last));
      if (last && advance) {
        GRADSUM_RETURN_IF_ERROR(fp->AdvanceGradReduce());
        if (R > 1 && !fp->grad_reduce_in_flight()) {
          return absl::InternalError("the cross-replica stage is not in flight after Advance");
        }
      }
      GRADSUM_RETURN_IF_ERROR(fp->FinishGradReduce());
    }
    absl::Span<const float> og = fp->owned_grad();
    owned[comm.rank()].assign(og.begin(), og.end());
    offsets[comm.rank()] = fp->owned_offset();
    out->norms_sq[comm.rank()] = fp->OwnedGradSquaredNorm();
    absl::Span<const float> mg = fp->master_grad();
    out->shards[comm.rank()].assign(mg.begin(), mg.end());
    return absl::OkStatus();
  }));
  out->flat.assign(numel, 0.0f);
  out->owners.assign(numel, 0);
  for (int w = 0; w < world; ++w) {
    for (size_t i = 0; i < owned[w].size(); ++i) {
      out->flat[offsets[w] + i] = owned[w][i];
      ++out->owners[offsets[w] + i];
    }
  }
  return absl::OkStatus();
}

TEST(FlatParamTest, HsdpSumsOverTheWorldAndOwnsEachElementOnce) {
  for (const auto& [world, n] :
       {std::pair<int, int>{2, 1}, {4, 2}, {6, 3}, {6, 2}, {8, 2}, {8, 4}}) {
    for (int G : {1, 3}) {
      const std::vector<double> ref = ReferenceGrad(world, G, false);
      HsdpResult h;
      ASSERT_TRUE(HsdpReduceOnRanks(world, n, GradPrecision::kF32, G, /*advance=*/G == 3, &h).ok());
      double norm_sq = 0, ref_sq = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        EXPECT_EQ(h.owners[i], 1) << "world " << world << " n " << n << " element " << i;
        EXPECT_NEAR(h.flat[i], ref[i], 3 * world * G * 6e-8) << "world " << world << " n " << n;
        ref_sq += static_cast<double>(h.flat[i]) * h.flat[i];
      }
      for (double x : h.norms_sq) norm_sq += x;
      EXPECT_NEAR(norm_sq, ref_sq, ref_sq * 1e-14) << "world " << world << " n " << n;
      // Every replica of a shard holds the same reduced shard, bit for bit.
      for (int w = n; w < world; ++w) {
        EXPECT_EQ(h.shards[w], h.shards[w % n]) << "world " << world << " rank " << w;
      }
    }
  }
}

// The GPU path's HSDP (parallel/cuda): the shard group's reduce-scatter is NCCL's, folded
// with FoldReducedGrad, and the last fold sums the accumulated shard across the replicas
// over the host replica group. The result is the world's SUM, each element owned once, and
// every replica of a shard holds the same bits.
TEST(FlatParamTest, HsdpFoldedFromOutsideSumsAcrossTheReplicas) {
  for (const auto& [world, n] : {std::pair<int, int>{2, 1}, {4, 2}, {6, 3}, {8, 4}}) {
    for (int G : {1, 3}) {
      const std::vector<double> ref = ReferenceGrad(world, G, false);
      HsdpResult h;
      const absl::Status s =
          HsdpReduceOnRanks(world, n, GradPrecision::kF32, G, false, &h, /*external=*/true);
      ASSERT_TRUE(s.ok()) << s;
      for (size_t i = 0; i < ref.size(); ++i) {
        EXPECT_EQ(h.owners[i], 1) << "world " << world << " n " << n << " element " << i;
        EXPECT_NEAR(h.flat[i], ref[i], 3 * world * G * 6e-8) << "world " << world << " n " << n;
      }
      for (int w = n; w < world; ++w) {
        EXPECT_EQ(h.shards[w], h.shards[w % n]) << "world " << world << " rank " << w;
      }
    }
  }
}

TEST(FlatParamTest, HsdpExactIsBitIdenticalToSharded) {
  for (const auto& [world, n] : {std::pair<int, int>{2, 1}, {4, 2}, {6, 3}, {8, 2}}) {
    for (int G : {1, 2}) {
      HsdpResult flat_sharded, hsdp, hsdp_advanced;
      ASSERT_TRUE(
          HsdpReduceOnRanks(world, world, GradPrecision::kExact, G, false, &flat_sharded).ok());
      ASSERT_TRUE(HsdpReduceOnRanks(world, n, GradPrecision::kExact, G, false, &hsdp).ok());
      ASSERT_TRUE(HsdpReduceOnRanks(world, n, GradPrecision::kExact, G, true, &hsdp_advanced).ok());
      const std::vector<double> ref = ReferenceGrad(world, G, false);
      for (size_t i = 0; i < ref.size(); ++i) {
        EXPECT_NEAR(hsdp.flat[i], ref[i], std::abs(ref[i]) * 1.2e-7 + 1e-30) << i;
      }
      EXPECT_EQ(std::memcmp(hsdp.flat.data(), flat_sharded.flat.data(), hsdp.flat.size() * 4), 0)
          << "world " << world << " n " << n << " G " << G;
      EXPECT_EQ(hsdp.flat, hsdp_advanced.flat);
      EXPECT_EQ(hsdp.owners, std::vector<int>(ref.size(), 1));
    }
  }
}

TEST(FlatParamTest, HsdpNeedsShardedMode) {
  absl::Status s = RunRanks(2, [&](Communicator& comm) -> absl::Status {
    FlatParamOptions opts;
    opts.mode = ShardingMode::kReplicated;
    opts.replica_group = &comm;
    absl::StatusOr<std::unique_ptr<FlatParam>> fp =
        FlatParam::Create("g", DenseSpecs(), &comm, opts);
    if (fp.status().code() != absl::StatusCode::kInvalidArgument ||
        fp.status().message().find("replicated") == std::string::npos) {
      return absl::InternalError(
          absl::StrCat("replicated + replica group: ", fp.status().ToString()));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace gradsum
