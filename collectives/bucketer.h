#ifndef GRADSUM_COLLECTIVES_BUCKETER_H_
#define GRADSUM_COLLECTIVES_BUCKETER_H_

// GradBucketer: coalesces many gradients into a few SUM collectives that overlap with
// backward (the DDP reducer's bucketing, written once against Communicator).
//
// Parameters are registered in forward order. Finalize() assigns them to buckets in
// reverse order (backward produces gradients last-first), one dtype per bucket, each
// bucket up to `bucket_cap_bytes` (a larger parameter gets a bucket of its own; the very
// first bucket up to `first_bucket_cap_bytes` when set). Each
// gradient is a view into its bucket's flat storage, so nothing is copied before the
// collective. When the last gradient of a bucket is marked ready, the bucket's coalesced
// SUM all-reduce (or reduce-scatter) is issued asynchronously; buckets are issued in
// bucket order on every rank (a complete bucket waits for the earlier ones), so ranks
// that mark gradients in different orders still issue identical collectives.
// Gradients are summed, never averaged (SEMANTICS.md §2, §7).
//
//   GradBucketer bucketer(&comm);
//   GRADSUM_ASSIGN_OR_RETURN(int w_id, bucketer.Register("layer0.w", DType::kF32, 4096));
//   ...                                                  // every parameter, forward order
//   GRADSUM_RETURN_IF_ERROR(bucketer.Finalize());
//   for (int step = 0; ...; ++step) {
//     GRADSUM_RETURN_IF_ERROR(bucketer.ZeroGrads());
//     // backward: write each gradient into bucketer.grad(id), then
//     GRADSUM_RETURN_IF_ERROR(bucketer.MarkReady(id));
//     GRADSUM_RETURN_IF_ERROR(bucketer.Finish());      // all buckets reduced
//     // bucketer.grad(id) now holds the SUM over ranks.
//   }
//
// Every rank of the communicator must register the same parameters (names, dtypes and
// sizes, in the same order) and use the same options. A GradBucketer is used by one
// thread at a time. The communicator must outlive it.
//
// The storage is host memory unless GradBucketerOptions::memory places it elsewhere (a
// GPU model's device memory, reduced by NCCL). Then grad() and shard() are
// views of that memory, readable only by its device.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "collectives/communicator.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace gradsum {

// Where a GradBucketer's bucket storage lives, and how it is zeroed and read back.
class BucketMemory {
 public:
  virtual ~BucketMemory() = default;
  // `bytes` (>= 1) of zeroed storage, aligned for every dtype; freed by Free().
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* storage) = 0;
  virtual absl::Status Zero(void* storage, size_t bytes) = 0;
  // Copies `bytes` of storage (after its collective finished) into host memory.
  virtual absl::Status CopyToHost(const void* storage, void* host, size_t bytes) = 0;
};

// Plain host memory (the default).
BucketMemory& HostBucketMemory();

struct GradBucketerOptions {
  enum class Mode {
    // Every rank ends with the full SUM of every gradient (replicated, DDP-like).
    kAllReduce,
    // Each bucket's storage is padded to a multiple of the group size with zeros and
    // reduce-scattered in place: rank r ends with block r of the SUM (shard(b)); the
    // gradient views then hold partial data (sharded, ZeRO-like, SEMANTICS.md §7).
    kReduceScatter,
  };
  Mode mode = Mode::kAllReduce;
  // Upper bound on a bucket's gradient bytes (a single larger parameter is alone in its
  // bucket). Must be >= 1.
  size_t bucket_cap_bytes = size_t{25} << 20;
  // Cap of the first bucket backward completes (DDP's small first bucket: its
  // collective starts early, behind only the last layers' gradients). 0: the same as
  // bucket_cap_bytes.
  size_t first_bucket_cap_bytes = 0;
  // Where the buckets live (not owned, must outlive the bucketer); null: host memory.
  BucketMemory* memory = nullptr;
};

// What Finalize() decided for one bucket (for tests, logging and the sharding layer).
struct GradBucketInfo {
  DType dtype = DType::kF32;
  int64_t numel = 0;             // gradient elements
  int64_t padded_numel = 0;      // storage elements (numel rounded up to the group size in
                                 // reduce-scatter mode, else numel)
  std::vector<int> param_ids;    // storage order = reverse registration order
  std::vector<int64_t> offsets;  // element offset of each param_ids[i] in the storage
};

class GradBucketer {
 public:
  // comm: not owned, must outlive the bucketer.
  explicit GradBucketer(Communicator* comm, GradBucketerOptions options = {});
  // Waits (up to the communicator's timeout) for collectives still in flight, so that
  // they never write into freed storage.
  ~GradBucketer();

  GradBucketer(const GradBucketer&) = delete;
  GradBucketer& operator=(const GradBucketer&) = delete;

  // Adds a parameter (forward order) and returns its id (0, 1, 2, ...).
  // InvalidArgument: numel < 0 or an invalid dtype. FailedPrecondition: after Finalize().
  absl::StatusOr<int> Register(absl::string_view name, DType dtype, int64_t numel);

  // Assigns buckets and allocates zeroed storage. FailedPrecondition if called twice;
  // InvalidArgument if the options are invalid (bucket_cap_bytes == 0, null comm).
  absl::Status Finalize();

  // The gradient of parameter `id`: a 1-D view into its bucket's storage, valid for the
  // bucketer's lifetime. An empty view if `id` is out of range or before Finalize().
  TensorView grad(int id) const;

  // Declares gradient `id` final for this step; issues every bucket that is complete and
  // whose predecessors are issued. InvalidArgument: id out of range. FailedPrecondition:
  // before Finalize(), or `id` already marked in this step. Errors from issuing a
  // collective are returned here and again from Finish().
  absl::Status MarkReady(int id);

  // Waits for every bucket's collective and ends the step (the next MarkReady starts a
  // new one). FailedPrecondition naming the first missing gradient (and how many are
  // missing) if some gradient was not marked; the step then stays open, so the caller
  // may mark it and call Finish() again. Otherwise the first collective error, if any.
  absl::Status Finish();

  // Sets all storage (gradients and padding) to zero. FailedPrecondition while a step is
  // open (some gradient marked but Finish() not yet returned OK) or before Finalize().
  absl::Status ZeroGrads();

  // Drops the current step (one that failed part-way): waits for the collectives in
  // flight (up to the communicator's timeout; their results are discarded), unmarks every
  // gradient and zeroes the storage. Returns the first wait error; the step is dropped
  // either way. FailedPrecondition before Finalize().
  absl::Status AbandonStep();

  // Copies bucket b's storage (padded_numel elements, after Finish()) into `host`, which
  // holds at least that many bytes. InvalidArgument for b out of range.
  absl::Status CopyBucketToHost(int b, void* host) const;

  // Reduce-scatter mode, after Finish(): this rank's block of bucket b's reduced storage,
  // padded_numel / size() elements starting at rank() * that. An empty view in
  // all-reduce mode, before Finalize() or for b out of range.
  TensorView shard(int b) const;

  bool finalized() const { return finalized_; }
  int num_params() const { return static_cast<int>(params_.size()); }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Precondition: 0 <= b < num_buckets().
  const GradBucketInfo& bucket(int b) const { return buckets_[b].info; }
  // The bucket holding parameter id, or -1 (out of range or before Finalize()).
  int bucket_of(int id) const;
  // Precondition: 0 <= id < num_params().
  const std::string& name(int id) const { return params_[id].name; }
  // Buckets whose collective has been issued in the current step (they are issued in
  // bucket order, so these are buckets 0 .. issued_buckets() - 1).
  int issued_buckets() const { return next_to_issue_; }

 private:
  struct Param {
    std::string name;
    DType dtype;
    int64_t numel;
    int bucket = -1;
    int64_t offset = 0;  // elements into the bucket storage
    bool ready = false;
  };
  struct Bucket {
    GradBucketInfo info;
    void* storage = nullptr;  // from memory_, padded_numel elements
    int pending = 0;          // gradients not yet marked this step
    std::unique_ptr<Work> work;
  };

  absl::Status IssueReadyBuckets();
  absl::Status WaitAll();
  void ResetStep();  // the next MarkReady starts a new step

  Communicator* comm_;
  GradBucketerOptions options_;
  BucketMemory* memory_;
  bool finalized_ = false;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  int next_to_issue_ = 0;
  int marked_ = 0;            // gradients marked in the current step
  absl::Status issue_error_;  // first error from issuing, reported by Finish()
};

}  // namespace gradsum

#endif  // GRADSUM_COLLECTIVES_BUCKETER_H_
