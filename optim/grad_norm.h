#ifndef GRADSUM_OPTIM_GRAD_NORM_H_
#define GRADSUM_OPTIM_GRAD_NORM_H_

// Global gradient norm and clipping over flat parameter groups (SEMANTICS.md §7).
//
//   std::vector<FlatParam*> groups = {...};   // every group this rank holds
//   GRADSUM_ASSIGN_OR_RETURN(double norm, ClipGradNorm(groups, *world, /*max_norm=*/1.0));
//   if (!std::isfinite(norm)) ... skip the step ...
//
// ||g||^2 = SUM over the world of each rank's owned-slice norm^2, in fp64. Each element is
// counted exactly once when every group's parameters are held by exactly one set of ranks:
// a dense group sharded (or replicated) over the world owns one slice per rank; an expert
// group over an EDP group of F ranks owns one slice per EDP rank, and the P EP slots hold
// different experts. Padding is never counted. Both sharding modes give the same value
// (bit for bit when their gradients are). The groups' precision decides the sum: fp64
// for f32 and bf16 wire; exact for GradPrecision::kExact (every group or none:
// InvalidArgument otherwise), each square summed exactly (core/exact_sum.h) and the words
// reduced as one int64 SUM all-reduce, so the norm is the same bits at every mesh.

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "parallel/flat_param.h"

namespace gradsum {

// The global L2 norm of the reduced gradients of `groups` (collective over `world`: one
// f64 SUM all-reduce). FailedPrecondition if a group's reduction is still in flight;
// the collective's error otherwise. A NaN or Inf gradient gives a NaN or Inf norm.
absl::StatusOr<double> GlobalGradNorm(absl::Span<FlatParam* const> groups, Communicator& world);

// GlobalGradNorm, then, if it exceeds `max_norm`, scales every group's master_grad() by
// max_norm / (norm + 1e-6) (PyTorch's clip_grad_norm_ coefficient). Returns the norm
// before clipping. A non-finite norm leaves the gradients unchanged (the caller should
// skip the step). InvalidArgument unless max_norm > 0.
absl::StatusOr<double> ClipGradNorm(absl::Span<FlatParam* const> groups, Communicator& world,
                                    double max_norm);

}  // namespace gradsum

#endif  // GRADSUM_OPTIM_GRAD_NORM_H_
