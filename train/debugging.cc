#include "train/debugging.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/status_agreement.h"
#include "core/status.h"
#include "core/tensor.h"
#include "io/atomic_file.h"
#include "io/path_checks.h"
#include "io/proto_json.h"
#include "io/safetensors.h"
#include "train/config.h"

namespace gradsum::train {

namespace {

// DataLoss naming the file, the tensor and the first element that is NaN or infinite, with
// the count of such elements: a parameter file must hold finite values (training from one
// that does not fails at step 1 as "not finite", far from the cause).
absl::Status CheckFinite(const std::string& what, const std::string& name,
                         const std::vector<int64_t>& shape, const float* values, int64_t n) {
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(values[i])) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return absl::OkStatus();
  // The first bad element's index in the tensor's shape, row-major.
  std::vector<int64_t> index(shape.size());
  int64_t rest = first;
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] > 0 ? rest % shape[d] : 0;
    rest = shape[d] > 0 ? rest / shape[d] : 0;
  }
  return absl::DataLossError(
      absl::StrCat(what, ": tensor \"", name, "\" holds ", bad, " non-finite value",
                   bad == 1 ? "" : "s", " of ", n, ", the first ", values[first], " at [",
                   absl::StrJoin(index, ","), "]; a parameter file must hold finite values"));
}

}  // namespace

std::string ExpertBiasTensorName(int layer) {
  return absl::StrCat("layers.", layer, ".expert_bias");
}

absl::Status WriteParamsFile(const std::string& path, const ModelConfig& model,
                             const NamedParams& params, int64_t step,
                             const model::ExpertBias& expert_bias) {
  SafetensorsWriter w;
  for (const auto& [name, shape] : MoeLmParamShapes(model)) {
    GRADSUM_ASSIGN_OR_RETURN(
        TensorView view,
        TensorView::Create(const_cast<float*>(params.at(name).data()), DType::kF32, shape));
    GRADSUM_RETURN_IF_ERROR(w.Add(name, view));
  }
  if (!expert_bias.empty() && static_cast<int>(expert_bias.size()) != model.layers()) {
    return absl::InvalidArgumentError(absl::StrCat("expert bias of ", expert_bias.size(),
                                                   " layers for a model of ", model.layers()));
  }
  for (size_t l = 0; l < expert_bias.size(); ++l) {
    GRADSUM_ASSIGN_OR_RETURN(
        TensorView view, TensorView::Create(const_cast<float*>(expert_bias[l].data()), DType::kF32,
                                            {static_cast<int64_t>(expert_bias[l].size())}));
    GRADSUM_RETURN_IF_ERROR(w.Add(ExpertBiasTensorName(static_cast<int>(l)), view));
  }
  GRADSUM_RETURN_IF_ERROR(w.AddMetadata("step", absl::StrCat(step)));
  return w.WriteFile(path);
}

absl::StatusOr<NamedParams> ReadParamsFile(const std::string& path, const ModelConfig& model,
                                           model::ExpertBias* expert_bias) {
  const std::string what = absl::StrCat("--init_from=", path);
  GRADSUM_RETURN_IF_ERROR(CheckInputFile("--init_from", path));
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(path);
  if (!file.ok()) return Annotate(file.status(), what);
  const auto shapes = MoeLmParamShapes(model);
  std::set<std::string> expected;
  NamedParams params;
  for (const auto& [name, shape] : shapes) {
    expected.insert(name);
    absl::StatusOr<TensorView> t = file->Get(name);
    if (!t.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": no tensor \"", name,
                                                     "\", which this model needs with shape [",
                                                     absl::StrJoin(shape, ","), "]"));
    }
    if (t->dtype() != DType::kF32 || t->shape() != shape) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": tensor \"", name, "\" is ",
                                                     t->DebugString(), ", this model needs f32[",
                                                     absl::StrJoin(shape, ","), "]"));
    }
    const float* values = t->data<float>();
    GRADSUM_RETURN_IF_ERROR(CheckFinite(what, name, shape, values, t->numel()));
    params[name].assign(values, values + t->numel());
  }
  // §5.1's bias: every layer's or none.
  if (expert_bias != nullptr) {
    expert_bias->clear();
    int found = 0;
    for (int l = 0; l < model.layers(); ++l) found += file->Get(ExpertBiasTensorName(l)).ok();
    if (found > 0 && found < model.layers()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the expert bias of ", found, " of the ", model.layers(),
                       " layers; a file holds every layer's \"layers.{l}.expert_bias\" or none"));
    }
    for (int l = 0; l < found; ++l) {
      const std::string name = ExpertBiasTensorName(l);
      expected.insert(name);
      const std::vector<int64_t> shape = {model.experts()};
      GRADSUM_ASSIGN_OR_RETURN(TensorView t, file->Get(name));
      if (t.dtype() != DType::kF32 || t.shape() != shape) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": tensor \"", name, "\" is ",
                                                       t.DebugString(), ", this model needs f32[",
                                                       model.experts(), "]"));
      }
      const float* values = t.data<float>();
      GRADSUM_RETURN_IF_ERROR(CheckFinite(what, name, shape, values, t.numel()));
      expert_bias->emplace_back(values, values + t.numel());
    }
  }
  for (const std::string& name : file->names()) {
    if (expected.count(name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": tensor \"", name, "\" is not a parameter of this model"));
    }
  }
  return params;
}

absl::Status WriteDump(const TrainConfig& config, int rank, const NamedParams& weights,
                       const NamedParams& grads, const std::vector<data::MicroBatch>& batches,
                       const StepMetrics& record, const model::ExpertBias& expert_bias) {
  const std::string& dir = config.debug().dump_dir();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("--dump_dir=", dir, ": ", ec.message()));
  // Every rank writes its own micro-batches.
  for (size_t m = 0; m < batches.size(); ++m) {
    const data::MicroBatch& mb = batches[m];
    // The rank's tokens of each row (its slice under sequence parallelism), and the
    // document starts of the whole rows (SEMANTICS.md §10: where attention is cut).
    const int64_t local = mb.local_seq_len > 0 ? mb.local_seq_len : mb.seq_len;
    std::vector<int64_t> tok(mb.tokens.begin(), mb.tokens.end()),
        lab(mb.labels.begin(), mb.labels.end()), msk(mb.mask.begin(), mb.mask.end()),
        sid(mb.sample_ids.begin(), mb.sample_ids.end()),
        pos(mb.positions.begin(), mb.positions.end()),
        starts(mb.doc_start.begin(), mb.doc_start.end());
    SafetensorsWriter w;
    for (auto& [name, v, width] :
         {std::tuple<const char*, std::vector<int64_t>*, int64_t>{"tokens", &tok, local},
          {"labels", &lab, local},
          {"mask", &msk, local},
          {"sample_ids", &sid, local},
          {"positions", &pos, local},
          {"doc_start", &starts, int64_t{mb.seq_len}}}) {
      if (static_cast<int64_t>(v->size()) != int64_t{mb.batch} * width) continue;  // absent
      GRADSUM_ASSIGN_OR_RETURN(TensorView view,
                               TensorView::Create(v->data(), DType::kI64, {mb.batch, width}));
      GRADSUM_RETURN_IF_ERROR(w.Add(name, view));
    }
    // The global index of each row in the data stream (data/packer.h).
    std::vector<int64_t> seq(mb.sequence_ids.begin(), mb.sequence_ids.end());
    GRADSUM_ASSIGN_OR_RETURN(TensorView seq_view,
                             TensorView::Create(seq.data(), DType::kI64, {mb.batch}));
    GRADSUM_RETURN_IF_ERROR(w.Add("sequence_ids", seq_view));
    GRADSUM_RETURN_IF_ERROR(
        w.WriteFile(absl::StrCat(dir, "/batch.r", rank, ".m", m, ".safetensors")));
  }
  if (rank != 0) return absl::OkStatus();
  GRADSUM_RETURN_IF_ERROR(WriteParamsFile(absl::StrCat(dir, "/weights.safetensors"), config.model(),
                                          weights, 1, expert_bias));
  GRADSUM_RETURN_IF_ERROR(
      WriteParamsFile(absl::StrCat(dir, "/grads.safetensors"), config.model(), grads, 1));
  DumpedLosses j;
  j.set_step(1);
  j.set_ce(record.ce());
  j.set_z(record.z());
  j.set_bal(record.bal());
  if (record.has_z_out()) j.set_z_out(record.z_out());
  for (double v : record.mtp()) j.add_mtp(v);
  j.set_loss(record.loss());
  j.set_valid_tokens(record.valid_tokens());
  j.set_routed_tokens(record.routed_tokens());
  j.set_config(ConfigToShortText(config));
  GRADSUM_ASSIGN_OR_RETURN(std::string text, ProtoToJson(j, {.int64_as_numbers = true}));
  return WriteFileAtomically(absl::StrCat(dir, "/losses.json"), text + "\n");
}

}  // namespace gradsum::train
