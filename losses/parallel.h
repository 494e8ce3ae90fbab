#ifndef GRADSUM_LOSSES_PARALLEL_H_
#define GRADSUM_LOSSES_PARALLEL_H_

// ParallelFor: runs `fn(task)` for task in [0, num_tasks) on up to `num_threads` threads
// (the caller's thread included), handing out tasks dynamically. The loss kernels use it
// to split rows over this machine's few cores; results must not depend on which thread
// ran a task (the kernels write per-row outputs and reduce them in row order).
//
//   ParallelFor(2, num_blocks, [&](int64_t b) { ProcessBlock(b); });
//
// Spawns short-lived std::threads: cheap next to the multi-millisecond kernels that use it,
// and it keeps the library free of a global pool. num_threads <= 1 or num_tasks <= 1 runs
// inline on the caller's thread.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace gradsum::losses {

template <typename Fn>
void ParallelFor(int num_threads, int64_t num_tasks, const Fn& fn) {
  if (num_tasks <= 0) return;
  const int64_t threads = std::min<int64_t>(std::max(num_threads, 1), num_tasks);
  if (threads <= 1) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) fn(t);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int64_t i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& th : pool) th.join();
}

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_PARALLEL_H_
