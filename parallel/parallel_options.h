#ifndef GRADSUM_PARALLEL_PARALLEL_OPTIONS_H_
#define GRADSUM_PARALLEL_PARALLEL_OPTIONS_H_

// How a model's parameters are distributed over the mesh (parallel/parallelize.h): the
// sharding mode, the wrap policy, the unit schedule's choices, the dtypes, and the
// gradient precision. The mesh itself (world, EP and EDP groups) is given beside it.

#include <cstddef>

#include "core/dtype.h"
#include "core/grad_precision.h"
#include "parallel/flat_param.h"

namespace gradsum::parallel {

struct ParallelOptions {
  ShardingMode sharding = ShardingMode::kSharded;
  // Parameters as forward reads them: f32, or bf16 (rounded to nearest even and
  // all-gathered in bf16, half the bytes; the CPU kernels widen them exactly to fp32).
  // Gradients and the master weights stay fp32 either way.
  DType compute_dtype = DType::kF32;
  // How gradients are held and summed, chosen once for a run (core/grad_precision.h): f32,
  // bf16 on the wire, or exact limbs (then the compute hands each packed sequence's
  // contribution on its own: ModelParams::RowBlock, model/ops.h row blocks).
  GradPrecision precision = GradPrecision::kF32;
  // Wrap policy: layers per parameter unit (their dense parameters in one unit, their
  // experts in one per EP slot).
  int layers_per_unit = 1;
  // Sharded mode: free units after their forward (re-gathered for backward).
  bool reshard_after_forward = true;
  // Sharded mode: reduce-scatter every micro-batch (true) or only the last one's
  // accumulated full gradient (false).
  bool reduce_every_micro_batch = true;
  // kExact: the row block of every contribution, in tokens; 0 means the tokens this rank
  // holds of each sequence (the whole sequence without sequence parallelism). Parameters
  // are the same bits at every SP size S whose seq_len / S is a multiple of it
  // (SEMANTICS.md §12).
  int64_t repro_block = 0;
  // Replicated mode: GradBucketer caps (collectives/bucketer.h).
  size_t bucket_cap_bytes = size_t{25} << 20;
  size_t first_bucket_cap_bytes = size_t{1} << 20;

  // The FlatParam options every unit is created with.
  FlatParamOptions flat_param_options() const {
    FlatParamOptions o;
    o.mode = sharding;
    o.compute_dtype = compute_dtype;
    o.precision = precision;
    o.reduce_every_micro_batch = reduce_every_micro_batch;
    return o;
  }
};

}  // namespace gradsum::parallel

#endif  // GRADSUM_PARALLEL_PARALLEL_OPTIONS_H_
