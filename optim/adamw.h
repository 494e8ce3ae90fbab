#ifndef GRADSUM_OPTIM_ADAMW_H_
#define GRADSUM_OPTIM_ADAMW_H_

// AdamW on the fp32 master values of flat parameter groups: each rank updates what it
// stores (its shard in sharded mode, the full copy in replicated mode). Purely local, no
// communication: the gradients are already SUM-reduced (SEMANTICS.md §7).
//
//   GRADSUM_ASSIGN_OR_RETURN(auto opt, ShardedAdamW::Create(groups, {.lr = 3e-4,
//                                                            .weight_decay = 0.1}));
//   ... reduce gradients, ClipGradNorm ...
//   GRADSUM_RETURN_IF_ERROR(opt->Step());        // then ZeroGrad() each group
//
// Update per element (t = step() after increment; decoupled weight decay, as torch.optim.AdamW):
//   p <- p * (1 - lr * weight_decay)      (skipped for 1-D parameters without decay_vectors)
//   m <- beta1 * m + (1 - beta1) * g
//   v <- beta2 * v + (1 - beta2) * g^2
//   p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// computed in fp32 with the scalar factors computed in fp64, deterministic.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "parallel/flat_param.h"

namespace gradsum {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // Whether weight decay also applies to 1-D parameters (norm gains, biases): true as
  // torch.optim.AdamW over every parameter; false exempts them, as GPT-style recipes
  // (Megatron, Hugging Face's Trainer) do. Parameters of two or more dimensions (matrices,
  // embeddings) decay either way.
  bool decay_vectors = true;
};

class ShardedAdamW {
 public:
  // `groups` (not owned) must outlive the optimizer. InvalidArgument: a null group, or
  // options outside lr >= 0, 0 <= beta < 1, eps > 0, weight_decay >= 0 (naming the value).
  static absl::StatusOr<std::unique_ptr<ShardedAdamW>> Create(std::vector<FlatParam*> groups,
                                                              AdamWOptions options);

  // One update of every group's master() from its master_grad(); increments step() and
  // tells each group its master changed (the next Unshard() gathers the new values).
  // FailedPrecondition while a group has a reduction or an all-gather in flight.
  absl::Status Step();

  // Changes the learning rate for later steps (schedules). InvalidArgument if negative.
  absl::Status set_lr(double lr);
  const AdamWOptions& options() const { return options_; }

  // Number of steps taken (0 before the first).
  int64_t step() const { return step_; }
  const std::vector<FlatParam*>& groups() const { return groups_; }

  // The moment estimates of group `g`, beside its master() element for element.
  absl::Span<float> exp_avg(int g) { return absl::MakeSpan(exp_avg_[g]); }
  absl::Span<float> exp_avg_sq(int g) { return absl::MakeSpan(exp_avg_sq_[g]); }
  absl::Span<const float> exp_avg(int g) const { return exp_avg_[g]; }
  absl::Span<const float> exp_avg_sq(int g) const { return exp_avg_sq_[g]; }

  // For checkpoint restore: sets the step count. InvalidArgument if negative.
  absl::Status set_step(int64_t step);

 private:
  ShardedAdamW() = default;
  std::vector<FlatParam*> groups_;
  AdamWOptions options_;
  int64_t step_ = 0;
  std::vector<std::vector<float>> exp_avg_;
  std::vector<std::vector<float>> exp_avg_sq_;
};

}  // namespace gradsum

#endif  // GRADSUM_OPTIM_ADAMW_H_
