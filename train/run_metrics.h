#ifndef GRADSUM_TRAIN_RUN_METRICS_H_
#define GRADSUM_TRAIN_RUN_METRICS_H_

// The step record's measurements beyond the step itself (issue 49): the step's FLOPs over
// the global batch's documents (model/flops.h) and the MFU against a peak, the tokens and
// sequences consumed so far (continued across a --resume), and the process's peak
// resident memory. One RunMeters per rank; no communication: every rank replays the
// packing of the global stream from the document lengths alone (data/packer.h), as the
// loader itself does, so the global count needs no collective.
//
//   GRADSUM_ASSIGN_OR_RETURN(auto meters, RunMeters::Create(corpus, config));
//   meters->Resume(loader.position());         // after a --resume (replays the lengths)
//   meters->SetPeakFlopsPerSecond(world_peak);  // configured, or MeasureGemmFlopsPerThread
//   per step: meters->BeginStep(loader.position());  // before NextStep
//             ... the step ...; record.set_step_s(...);
//             meters->Fill(&record);

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "data/document_source.h"
#include "data/packer.h"
#include "model/flops.h"
#include "model/moe_lm_spec.h"
#include "train/config.pb.h"
#include "train/metrics.pb.h"

namespace gradsum::train {

class RunMeters {
 public:
  // The corpus the run trains on and its config (model sizes, seq_len, the global batch
  // train/config.h GlobalBatch sequences, --recompute). Errors of the
  // packer (data/packer.h) for a corpus the loader would refuse too.
  static absl::StatusOr<std::unique_ptr<RunMeters>> Create(
      std::shared_ptr<const data::DocumentSource> corpus, const TrainConfig& config);

  // A resumed run at `position` (the loader's, steps done): the tokens of the sequences
  // before it, replayed from the stream's start (lengths only), so consumed_tokens goes on.
  void Resume(const data::DataPosition& position);
  // The world's peak FLOP/s that mfu divides by (0: none, mfu 0).
  void SetPeakFlopsPerSecond(double flops_per_s) { peak_ = flops_per_s; }
  double peak_flops_per_second() const { return peak_; }

  // Counts the step whose global batch starts at `position` (the loader's before its
  // NextStep): its documents' FLOPs and tokens.
  void BeginStep(const data::DataPosition& position);
  const model::StepFlops& step_flops() const { return flops_; }

  // Sets model_flops, hardware_flops, flops_per_s and mfu (from record->step_s()),
  // consumed_tokens, consumed_sequences, peak_rss_bytes, skipped_steps and
  // nonfinite_steps of the step BeginStep counted.
  void Fill(StepMetrics* record) const;

 private:
  RunMeters(data::SequencePacker packer, const model::MoeLmConfig& model, int64_t per_step,
            bool recompute_full)
      : packer_(std::move(packer)),
        model_(model),
        sequences_per_step_(per_step),
        recompute_full_(recompute_full) {}

  data::SequencePacker packer_;  // a replay of the global stream (lengths only)
  model::MoeLmConfig model_;
  int64_t sequences_per_step_ = 0;
  bool recompute_full_ = false;
  std::vector<int64_t> lengths_;  // the step's document lengths
  model::StepFlops flops_;
  int64_t tokens_before_ = 0, step_tokens_ = 0;
  int64_t sequences_after_ = 0;
  double peak_ = 0;
};

// FLOP/s of one thread's BLAS GEMM (core/gemm.h) at the shape of the step benchmarks'
// limit, [2048, 128] x [128, 128] (the README model's expert up-projection): the fastest of
// the GEMMs run over `min_time` (one GEMM is about a millisecond), so that a busy machine
// still gives its peak: the per-thread peak MFU divides by.
double MeasureGemmFlopsPerThread(absl::Duration min_time = absl::Milliseconds(200));

// The process's peak resident set size in bytes (getrusage); 0 if unavailable.
int64_t PeakRssBytes();

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_RUN_METRICS_H_
