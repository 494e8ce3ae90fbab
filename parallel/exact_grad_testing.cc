#include "parallel/exact_grad_testing.h"

#include <cmath>
#include <limits>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/exact_sum.h"
#include "core/status.h"
#include "optim/grad_norm.h"
#include "parallel/bucketed_reduce.h"
#include "parallel/test_util.h"
#include "testing/exact_sum_reference.h"

namespace gradsum::exact_grad_testing {
namespace {

namespace ref = exact_reference;

int64_t Numel(const ParamSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  return n;
}

}  // namespace

std::vector<std::vector<ParamSpec>> GroupSpecs() {
  return {sharding_testing::DenseSpecs(), {{"w", {4, 6}}, {"b", {5}}}};
}

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

std::string Config::Name() const {
  return absl::StrCat("world ", world, " G ", micro_batches, " ", ShardingModeName(mode),
                      reduce_every_micro_batch ? "" : " reduce-last", bucketed ? " bucketed" : "");
}

absl::Status RankStep(Communicator& comm, const Config& cfg, int shift, int nan_rank,
                      double max_norm, std::vector<std::vector<float>>* grads, double* norm) {
  const auto specs = GroupSpecs();
  FlatParamOptions opts;
  opts.mode = cfg.mode;
  opts.precision = GradPrecision::kExact;
  opts.reduce_every_micro_batch = cfg.reduce_every_micro_batch;
  std::vector<std::unique_ptr<FlatParam>> groups;
  std::vector<FlatParam*> ptrs;
  for (size_t g = 0; g < specs.size(); ++g) {
    GRADSUM_ASSIGN_OR_RETURN(auto fp,
                             FlatParam::Create(absl::StrCat("g", g), specs[g], &comm, opts));
    ptrs.push_back(fp.get());
    groups.push_back(std::move(fp));
  }
  std::unique_ptr<BucketedGradReducer> reducer;
  if (cfg.bucketed) {
    GRADSUM_ASSIGN_OR_RETURN(reducer, BucketedGradReducer::Create(ptrs, /*cap=*/256));
  }
  const int W = comm.size(), G = cfg.micro_batches;
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
                c.values, limbs.subspan(c.offset * exact::kLimbs, c.values.size() * exact::kLimbs),
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
  GRADSUM_ASSIGN_OR_RETURN(
      *norm, max_norm > 0 ? ClipGradNorm(ptrs, comm, max_norm) : GlobalGradNorm(ptrs, comm));
  for (size_t g = 0; g < groups.size(); ++g) {
    absl::Span<const float> owned = groups[g]->owned_grad();
    std::copy(owned.begin(), owned.end(), (*grads)[g].begin() + groups[g]->shard_offset());
  }
  return absl::OkStatus();
}

}  // namespace gradsum::exact_grad_testing
