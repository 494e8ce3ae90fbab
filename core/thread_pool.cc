#include "core/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>

namespace gradsum {

// One Run() call: lives on the caller's stack until every helper has left it.
struct ThreadPool::Job {
  absl::FunctionRef<void(int64_t)> fn;
  int64_t num_tasks;
  int max_helpers;               // workers that may join (the caller is not counted)
  std::atomic<int64_t> next{0};  // next unclaimed task
  int helpers = 0;               // workers inside Drain(); guarded by mu_
};

namespace {
thread_local int tls_compute_threads = 1;
}  // namespace

ThreadPool::ThreadPool(int num_workers) {
  workers_.reserve(std::max(num_workers, 0));
  for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

ThreadPool& ThreadPool::Shared() {
  // Never destroyed: kernels may still run from other static destructors' threads.
  static ThreadPool* const pool = new ThreadPool(AvailableCores() - 1);
  return *pool;
}

void ThreadPool::Drain(Job* job) {
  for (int64_t t = job->next.fetch_add(1); t < job->num_tasks; t = job->next.fetch_add(1)) {
    job->fn(t);
  }
}

void ThreadPool::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    Job* job = nullptr;
    work_cv_.wait(lock, [&] {
      if (stop_) return true;
      for (Job* j : jobs_) {
        if (j->helpers < j->max_helpers && j->next.load(std::memory_order_relaxed) < j->num_tasks) {
          job = j;
          return true;
        }
      }
      return false;
    });
    if (job == nullptr) return;  // stop_
    ++job->helpers;
    lock.unlock();
    Drain(job);
    lock.lock();
    if (--job->helpers == 0) done_cv_.notify_all();
  }
}

void ThreadPool::Run(int max_threads, int64_t num_tasks, absl::FunctionRef<void(int64_t)> fn) {
  const int64_t helpers =
      std::min<int64_t>({max_threads - 1, num_tasks - 1, static_cast<int64_t>(workers_.size())});
  if (helpers <= 0) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  Job job{fn, num_tasks, static_cast<int>(helpers)};
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(&job);
  }
  if (helpers == 1) {
    work_cv_.notify_one();
  } else {
    work_cv_.notify_all();
  }
  Drain(&job);
  std::unique_lock<std::mutex> lock(mu_);
  jobs_.remove(&job);
  done_cv_.wait(lock, [&] { return job.helpers == 0; });
}

int AvailableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

int ComputeThreads() { return tls_compute_threads; }

ScopedComputeThreads::ScopedComputeThreads(int num_threads) : previous_(tls_compute_threads) {
  tls_compute_threads = std::max(1, num_threads);
}

ScopedComputeThreads::~ScopedComputeThreads() { tls_compute_threads = previous_; }

}  // namespace gradsum
