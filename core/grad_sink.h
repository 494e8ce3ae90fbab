#ifndef GRADSUM_CORE_GRAD_SINK_H_
#define GRADSUM_CORE_GRAD_SINK_H_

// Where reproducible mode (docs/REPRODUCIBILITY.md) puts weight gradients. A kernel that
// reduces over token rows (dW = X^T dY) computes each row block's contribution on its own,
// in a fixed order, into fp32 scratch, and hands it to an ExactGradSink, which adds it
// exactly (fixed point; the exact GradPrecision's UnitGrad, parallel/unit_grad.h, makes
// the sinks). The sum over blocks then has the same bits whatever the order, grouping or
// rank of the additions.
//
//   std::vector<float> contribution(D * E);
//   Sgemm(Trans::kYes, Trans::kNo, D, E, rows_of_block, 1.0f, a_block, D, du_block, E, 0.0f,
//         contribution, E);
//   GRADSUM_RETURN_IF_ERROR(sink->Add(/*offset=*/0, contribution));
//
// Row blocks are packed sequences (dense weights) or the rows one sequence sends to one
// expert (expert weights): both are the same at every mesh.

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace gradsum {

class ExactGradSink {
 public:
  virtual ~ExactGradSink() = default;
  // Adds contribution[i] exactly to element offset + i of the gradient this sink stands
  // for. Calls on disjoint element ranges may run concurrently; calls on overlapping
  // ranges must not. InvalidArgument for a range outside the gradient or a non-finite
  // value (naming it).
  virtual absl::Status Add(int64_t offset, absl::Span<const float> contribution) = 0;
};

// Where one weight's gradient goes, as the model's compute sees it: ADDED straight into
// an fp32 buffer (`accumulate`, numel() elements in the compute device's memory), or, in
// exact mode, into an ExactGradSink (host), one row block's contribution at a time. Exactly
// one of the two is set. Move-only: an exact sink reports what it rejected when it goes
// away, so a target lives for one kernel call, before the unit's reduction starts.
class GradTarget {
 public:
  GradTarget() = default;
  static GradTarget Accumulate(float* buffer, int64_t numel) {
    GradTarget t;
    t.accumulate_ = buffer;
    t.numel_ = numel;
    return t;
  }
  static GradTarget Exact(std::unique_ptr<ExactGradSink> sink, int64_t numel) {
    GradTarget t;
    t.exact_ = std::move(sink);
    t.numel_ = numel;
    return t;
  }

  float* accumulate() const { return accumulate_; }
  ExactGradSink* exact() const { return exact_.get(); }
  int64_t numel() const { return numel_; }

 private:
  float* accumulate_ = nullptr;
  std::unique_ptr<ExactGradSink> exact_;
  int64_t numel_ = 0;
};

}  // namespace gradsum

#endif  // GRADSUM_CORE_GRAD_SINK_H_
