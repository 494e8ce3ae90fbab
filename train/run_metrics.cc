#include "train/run_metrics.h"

#include <sys/resource.h>

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"
#include "core/gemm.h"
#include "core/status.h"
#include "train/config.h"
#include "train/moe_lm.h"

namespace gradsum::train {

absl::StatusOr<std::unique_ptr<RunMeters>> RunMeters::Create(
    std::shared_ptr<const data::DocumentSource> corpus, const TrainConfig& config) {
  GRADSUM_ASSIGN_OR_RETURN(
      data::SequencePacker packer,
      data::SequencePacker::Create(std::move(corpus), config.data().seq_len()));
  return std::unique_ptr<RunMeters>(new RunMeters(
      std::move(packer), ToMoeLmConfig(config.model(), config.loss()), GlobalBatch(config),
      config.parallelism().recompute() == ParallelismConfig::full));
}

void RunMeters::Resume(const data::DataPosition& position) {
  (void)packer_.Seek({0, 0});
  tokens_before_ = 0;
  for (int64_t s = 0; s < position.sequences; ++s) {
    for (int64_t doc : packer_.NextSequence()) {
      tokens_before_ += packer_.corpus().DocumentLength(doc);
    }
  }
  step_tokens_ = 0;
  sequences_after_ = position.sequences;
}

void RunMeters::BeginStep(const data::DataPosition& position) {
  tokens_before_ += step_tokens_;
  lengths_.clear();
  step_tokens_ = 0;
  if (packer_.Seek(position).ok()) {
    for (int64_t s = 0; s < sequences_per_step_; ++s) {
      for (int64_t doc : packer_.NextSequence()) {
        lengths_.push_back(packer_.corpus().DocumentLength(doc));
        step_tokens_ += lengths_.back();
      }
    }
  }
  sequences_after_ = position.sequences + sequences_per_step_;
  flops_ = model::CountStepFlops(model_, lengths_, recompute_full_);
}

void RunMeters::Fill(StepMetrics* r) const {
  r->set_model_flops(flops_.model);
  r->set_hardware_flops(flops_.hardware);
  const double rate = r->step_s() > 0 ? flops_.model / r->step_s() : 0;
  r->set_flops_per_s(rate);
  r->set_mfu(peak_ > 0 ? rate / peak_ : 0);
  r->set_consumed_tokens(tokens_before_ + step_tokens_);
  r->set_consumed_sequences(sequences_after_);
  r->set_peak_rss_bytes(PeakRssBytes());
  r->set_skipped_steps(0);  // no step is skipped: a non-finite norm ends the run
  r->set_nonfinite_steps(0);
  const data::DocumentSource& corpus = packer_.corpus();
  if (corpus.EntropyFloorNats() >= 0) r->set_entropy_floor(corpus.EntropyFloorNats());
  if (corpus.ContextFloorNats() >= 0) r->set_context_floor(corpus.ContextFloorNats());
}

double MeasureGemmFlopsPerThread(absl::Duration min_time) {
  constexpr int64_t kRows = 2048, kD = 128, kH = 128;
  std::vector<float> a(kRows * kD, 0.5f), b(kD * kH, 0.25f), c(kRows * kH);
  // The best single GEMM's rate over the time: on a shared machine the mean is the
  // scheduler's share, while no GEMM can run faster than the machine's peak.
  double best = 0;
  const absl::Time start = absl::Now();
  absl::Time now = start;
  do {
    const absl::Time t0 = now;
    (void)Sgemm(Trans::kNo, Trans::kNo, kRows, kH, kD, 1.0f, a, kD, b, kH, 0.0f, absl::MakeSpan(c),
                kH);
    now = absl::Now();
    const double seconds = absl::ToDoubleSeconds(now - t0);
    if (seconds > 0) best = std::max(best, 2.0 * kRows * kD * kH / seconds);
  } while (now - start < min_time);
  return best;
}

int64_t PeakRssBytes() {
  struct rusage usage;
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return int64_t{usage.ru_maxrss} * 1024;  // Linux: kilobytes
}

}  // namespace gradsum::train
