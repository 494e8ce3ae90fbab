#ifndef GRADSUM_CORE_THREAD_POOL_H_
#define GRADSUM_CORE_THREAD_POOL_H_

// One persistent pool of worker threads for the CPU compute kernels (loss kernels, GEMMs),
// and the per-thread compute budget that says how many threads a caller may use.
//
//   ThreadPool& pool = ThreadPool::Shared();            // process-wide, started lazily
//   pool.Run(/*max_threads=*/2, num_blocks, [&](int64_t b) { ProcessBlock(b); });
//   ParallelFor(2, num_blocks, fn);                     // the same, on the shared pool
//
//   ScopedComputeThreads budget(cores_of_this_rank);    // on the rank's thread
//   ... ParallelFor(ComputeThreads(), n, fn) ...        // kernels that take no thread count
//
// Run() hands tasks out dynamically to the calling thread and up to `max_threads - 1` idle
// workers, and returns when every task has finished. The caller always works too, so Run()
// never waits on a busy pool: several ranks (threads of one process, the thread backend)
// may call it at once, each bounded by its own `max_threads`, and a task may itself call
// Run(). Callers must not rely on which thread runs a task: the kernels write per-task
// outputs and reduce them in task order, so results do not depend on the thread count.
//
// The shared pool has AvailableCores() - 1 workers (the caller is the last thread);
// the budget of a rank is what bounds it: with the thread backend each of W ranks gets
// cores / W threads, so W ranks never run more than `cores` threads together.

#include <condition_variable>
#include <cstdint>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace gradsum {

class ThreadPool {
 public:
  // Starts `num_workers` >= 0 threads (negative counts as 0).
  explicit ThreadPool(int num_workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process-wide pool, started on first use with AvailableCores() - 1 workers.
  static ThreadPool& Shared();

  int num_workers() const { return static_cast<int>(workers_.size()); }

  // Runs fn(task) for every task in [0, num_tasks) on the calling thread and at most
  // max_threads - 1 workers; returns when all have run. max_threads <= 1 or
  // num_tasks <= 1 runs inline on the caller.
  void Run(int max_threads, int64_t num_tasks, absl::FunctionRef<void(int64_t)> fn);

 private:
  struct Job;
  void WorkerLoop();
  static void Drain(Job* job);

  std::mutex mu_;
  std::condition_variable work_cv_;  // workers wait here for a job with room
  std::condition_variable done_cv_;  // callers wait here for their job's helpers to leave
  std::list<Job*> jobs_;             // open jobs (each lives on its caller's stack)
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// ThreadPool::Shared().Run(num_threads, num_tasks, fn).
inline void ParallelFor(int num_threads, int64_t num_tasks, absl::FunctionRef<void(int64_t)> fn) {
  if (num_threads <= 1 || num_tasks <= 1) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  ThreadPool::Shared().Run(num_threads, num_tasks, fn);
}

// ParallelFor over tasks that can fail: runs fn(t) for every t < num_tasks (all of them,
// whichever fail) and returns the first error in task order, so which error is reported
// does not depend on the thread count.
inline absl::Status ParallelForStatus(int num_threads, int64_t num_tasks,
                                      absl::FunctionRef<absl::Status(int64_t)> fn) {
  std::vector<absl::Status> status(static_cast<size_t>(num_tasks));
  ParallelFor(num_threads, num_tasks, [&](int64_t t) { status[t] = fn(t); });
  for (absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// The cores this process may run on (its CPU affinity mask, so taskset and cpusets count),
// at least 1; hardware_concurrency() where the mask cannot be read.
int AvailableCores();

// The number of threads compute kernels started from this thread may use (>= 1; 1 unless
// a ScopedComputeThreads is active on this thread).
int ComputeThreads();

// Sets ComputeThreads() on this thread for its lifetime (values below 1 count as 1);
// restores the previous value on destruction.
class ScopedComputeThreads {
 public:
  explicit ScopedComputeThreads(int num_threads);
  ~ScopedComputeThreads();
  ScopedComputeThreads(const ScopedComputeThreads&) = delete;
  ScopedComputeThreads& operator=(const ScopedComputeThreads&) = delete;

 private:
  int previous_;
};

}  // namespace gradsum

#endif  // GRADSUM_CORE_THREAD_POOL_H_
