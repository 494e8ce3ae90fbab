#include "core/thread_pool.h"

#include <sched.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace gradsum {
namespace {

TEST(ThreadPoolTest, RunsEveryTaskExactlyOnce) {
  ThreadPool pool(3);
  for (int threads : {1, 2, 4, 8}) {
    std::vector<std::atomic<int>> hits(1000);
    pool.Run(threads, static_cast<int64_t>(hits.size()), [&](int64_t t) { ++hits[t]; });
    for (size_t t = 0; t < hits.size(); ++t) ASSERT_EQ(hits[t].load(), 1) << t << " " << threads;
  }
}

TEST(ThreadPoolTest, ZeroAndOneTask) {
  ThreadPool pool(2);
  int calls = 0;
  pool.Run(4, 0, [&](int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
  pool.Run(4, 1, [&](int64_t t) { calls += 1 + static_cast<int>(t); });
  EXPECT_EQ(calls, 1);
}

// A call never uses more than max_threads threads at once, caller included.
TEST(ThreadPoolTest, RespectsMaxThreads) {
  ThreadPool pool(7);
  for (int max_threads : {1, 2, 3}) {
    std::atomic<int> inside{0}, most{0};
    pool.Run(max_threads, 64, [&](int64_t) {
      const int now = ++inside;
      int seen = most.load();
      while (now > seen && !most.compare_exchange_weak(seen, now)) {
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      --inside;
    });
    EXPECT_LE(most.load(), max_threads);
    EXPECT_GE(most.load(), 1);
  }
}

// With no workers every task runs on the caller.
TEST(ThreadPoolTest, NoWorkersRunsInline) {
  ThreadPool pool(0);
  const std::thread::id me = std::this_thread::get_id();
  int on_caller = 0;
  pool.Run(4, 10, [&](int64_t) { on_caller += std::this_thread::get_id() == me; });
  EXPECT_EQ(on_caller, 10);
}

// Several callers (ranks of the thread backend) at once, and a task that itself calls Run().
TEST(ThreadPoolTest, ConcurrentAndNestedCallers) {
  ThreadPool pool(2);
  constexpr int kCallers = 4, kOuter = 8, kInner = 50;
  std::vector<std::atomic<int64_t>> sums(kCallers);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 20; ++rep) {
        pool.Run(3, kOuter, [&](int64_t o) {
          pool.Run(2, kInner, [&](int64_t i) { sums[c] += o * kInner + i; });
        });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  const int64_t n = kOuter * kInner;
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(sums[c].load(), 20 * n * (n - 1) / 2) << c;
}

TEST(ThreadPoolTest, SharedPoolParallelFor) {
  std::vector<int> out(100, 0);
  ParallelFor(4, 100, [&](int64_t t) { out[t] = static_cast<int>(t) * 2; });
  for (int t = 0; t < 100; ++t) ASSERT_EQ(out[t], 2 * t);
  EXPECT_EQ(ThreadPool::Shared().num_workers(), AvailableCores() - 1);
}

// The count is the process's CPU affinity mask (taskset, cpusets), read here independently.
TEST(ThreadPoolTest, AvailableCoresIsTheAffinityMask) {
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_EQ(AvailableCores(), CPU_COUNT(&set));
  EXPECT_GE(AvailableCores(), 1);
  EXPECT_LE(AvailableCores(), static_cast<int>(std::thread::hardware_concurrency()));
}

TEST(ThreadPoolTest, ScopedComputeThreadsNestsAndIsPerThread) {
  EXPECT_EQ(ComputeThreads(), 1);
  {
    ScopedComputeThreads outer(3);
    EXPECT_EQ(ComputeThreads(), 3);
    int other = 0;
    std::thread([&] { other = ComputeThreads(); }).join();
    EXPECT_EQ(other, 1);
    {
      ScopedComputeThreads inner(0);
      EXPECT_EQ(ComputeThreads(), 1);
    }
    EXPECT_EQ(ComputeThreads(), 3);
  }
  EXPECT_EQ(ComputeThreads(), 1);
}

// Every task runs, and the error reported is the lowest-numbered failing task's, at any
// thread count.
TEST(ThreadPoolTest, ParallelForStatusRunsAllAndReportsTheFirstErrorInTaskOrder) {
  for (int threads : {1, 2, 4}) {
    std::vector<std::atomic<int>> runs(64);
    const absl::Status s = ParallelForStatus(threads, 64, [&](int64_t t) {
      ++runs[t];
      if (t == 41 || t == 17 || t == 63) {
        return absl::InvalidArgumentError(absl::StrCat("task ", t));
      }
      return absl::OkStatus();
    });
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << threads;
    EXPECT_EQ(s.message(), "task 17") << threads;
    for (int t = 0; t < 64; ++t) EXPECT_EQ(runs[t].load(), 1) << t;
  }
  EXPECT_TRUE(ParallelForStatus(2, 0, [](int64_t) { return absl::InternalError("no"); }).ok());
}

}  // namespace
}  // namespace gradsum
