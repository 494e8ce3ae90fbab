#include "parallel/test_util.h"

#include "absl/strings/str_cat.h"
#include "core/half.h"
#include "core/status.h"
#include "optim/grad_norm.h"

namespace gradsum::sharding_testing {
namespace {

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

double Noise(absl::string_view name, uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) h = Mix(h ^ ch);
  h = Mix(h ^ a);
  h = Mix(h ^ (b + 0x100));
  h = Mix(h ^ (c + 0x10000));
  h = Mix(h ^ (d + 0x1000000));
  return static_cast<double>(h >> 11) * 0x1.0p-52 - 1.0;
}

std::vector<ParamSpec> DenseSpecs() {
  return {{"emb", {7}}, {"proj", {13}}, {"scale", {1}}, {"empty", {0}}, {"head", {3, 5}}};
}

std::vector<ParamSpec> ExpertSpecs(int slot, int experts_per_slot) {
  std::vector<ParamSpec> out;
  for (int e = slot * experts_per_slot; e < (slot + 1) * experts_per_slot; ++e) {
    out.push_back({absl::StrCat("expert", e, ".w1"), {3, 2}});
    out.push_back({absl::StrCat("expert", e, ".w2"), {5}});
  }
  return out;
}

std::vector<float> InitValue(absl::string_view param_name, int64_t numel) {
  std::vector<float> v(numel);
  for (int64_t i = 0; i < numel; ++i) v[i] = static_cast<float>(Noise(param_name, i, 777));
  return v;
}

absl::Status InitGroup(FlatParam& group) {
  for (int i = 0; i < group.num_params(); ++i) {
    const FlatParamEntry& e = group.entries()[i];
    GRADSUM_RETURN_IF_ERROR(group.SetFullValue(i, InitValue(e.name, e.numel)));
  }
  return absl::OkStatus();
}

void ToyGrad(absl::string_view param_name, int world_rank, int micro, int64_t step,
             const float* theta, int64_t numel, float* grad_out) {
  for (int64_t i = 0; i < numel; ++i) {
    const float a = static_cast<float>(0.75 + 0.25 * Noise(param_name, i, world_rank, micro, step));
    const float c = static_cast<float>(Noise(param_name, i, world_rank + 1000, micro, step));
    grad_out[i] += a * (theta[i] - c);
  }
}

absl::Status ToyTrainStep(const std::vector<FlatParam*>& groups, ShardedAdamW& opt,
                          Communicator& world, int micro_batches, double max_norm) {
  std::vector<float> theta;
  for (int m = 0; m < micro_batches; ++m) {
    const bool last = m == micro_batches - 1;
    if (!groups.empty()) GRADSUM_RETURN_IF_ERROR(groups[0]->StartUnshard());
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      FlatParam& g = *groups[gi];
      GRADSUM_RETURN_IF_ERROR(g.WaitUnshard());
      // Prefetch the next group's all-gather while this one "computes".
      if (gi + 1 < groups.size()) GRADSUM_RETURN_IF_ERROR(groups[gi + 1]->StartUnshard());
      for (int p = 0; p < g.num_params(); ++p) {
        GRADSUM_ASSIGN_OR_RETURN(TensorView w, g.param(p));
        GRADSUM_ASSIGN_OR_RETURN(TensorView gr, g.grad(p));
        theta.resize(w.numel());
        for (int64_t i = 0; i < w.numel(); ++i) {
          theta[i] = w.dtype() == DType::kBF16 ? w.data<BF16>()[i].ToFloat() : w.data<float>()[i];
        }
        ToyGrad(g.entries()[p].name, world.rank(), m, opt.step(), theta.data(), w.numel(),
                gr.data<float>());
      }
      GRADSUM_RETURN_IF_ERROR(g.Reshard());
      GRADSUM_RETURN_IF_ERROR(g.StartGradReduce(last));
    }
    for (FlatParam* g : groups) GRADSUM_RETURN_IF_ERROR(g->FinishGradReduce());
  }
  if (max_norm > 0) GRADSUM_RETURN_IF_ERROR(ClipGradNorm(groups, world, max_norm).status());
  GRADSUM_RETURN_IF_ERROR(opt.Step());
  for (FlatParam* g : groups) GRADSUM_RETURN_IF_ERROR(g->ZeroGrad());
  return absl::OkStatus();
}

}  // namespace gradsum::sharding_testing
