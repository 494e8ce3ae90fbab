// ProgressQueue: issue order whoever runs, claims, RunUpTo, the idle callback and stopping.
// The backends' own tests (thread_backend_test, mpi_backend_test) cover it in use.

#include "collectives/progress_queue.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace gradsum::collectives_internal {
namespace {

// Appends its id to a shared log when run; records that Finish came after the release.
class Recorder final : public ProgressQueue::Task {
 public:
  Recorder(int id, std::vector<int>* log, std::mutex* mu) : id_(id), log_(log), mu_(mu) {}
  void Run() override {
    std::lock_guard<std::mutex> lock(*mu_);
    log_->push_back(id_);
  }
  void Finish() override { finished.store(true); }
  std::atomic<bool> finished{false};

 private:
  const int id_;
  std::vector<int>* log_;
  std::mutex* mu_;
};

TEST(ProgressQueueTest, WorkerAndRunUpToKeepPushOrder) {
  std::vector<int> log;
  std::mutex mu;
  auto queue = ProgressQueue::Start();
  std::vector<std::shared_ptr<Recorder>> tasks;
  for (int i = 0; i < 200; ++i) {
    tasks.push_back(std::make_shared<Recorder>(i, &log, &mu));
    queue->Push(tasks.back());
    if (i % 7 == 0) queue->RunUpTo(tasks.back().get());  // the caller helps now and then
  }
  queue->RunUpTo(tasks.back().get());
  while (!tasks.back()->finished.load()) std::this_thread::yield();
  queue->Stop();
  ASSERT_EQ(log.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(log[i], i);
  for (const auto& t : tasks) EXPECT_TRUE(t->finished.load());
  EXPECT_EQ(queue->pending(), 0);
}

TEST(ProgressQueueTest, ClaimsOnlyWhenNothingIsQueuedOrRunning) {
  auto queue = ProgressQueue::Start();
  ASSERT_TRUE(queue->TryClaim());
  EXPECT_FALSE(queue->TryClaim());  // claimed
  std::vector<int> log;
  std::mutex mu;
  auto task = std::make_shared<Recorder>(1, &log, &mu);
  queue->Push(task);  // waits: the claim holds the queue
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(task->finished.load());
  EXPECT_EQ(queue->pending(), 1);
  queue->Release();
  // A drained claim waits for the queued task first.
  ASSERT_TRUE(queue->ClaimWhenDrained());
  EXPECT_TRUE(log.size() == 1);
  EXPECT_EQ(queue->pending(), 0);
  EXPECT_FALSE(queue->TryClaim([] { return true; }));
  queue->Release();
  EXPECT_FALSE(queue->TryClaim([] { return false; }));  // the caller's own condition
  queue->Stop();
  EXPECT_FALSE(queue->TryClaim());  // stopped
}

TEST(ProgressQueueTest, IdleCallbackRunsWhileIdleAndStopRunsWhatIsQueued) {
  std::atomic<int> idle{0};
  auto queue = ProgressQueue::Start(
      {.on_idle = [&] { idle.fetch_add(1); }, .idle_period = std::chrono::milliseconds(1)});
  while (idle.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::vector<int> log;
  std::mutex mu;
  ASSERT_TRUE(queue->TryClaim());  // hold the queue so that the tasks are still queued
  std::vector<std::shared_ptr<Recorder>> tasks;
  for (int i = 0; i < 5; ++i) {
    tasks.push_back(std::make_shared<Recorder>(i, &log, &mu));
    queue->Push(tasks.back());
  }
  EXPECT_TRUE(queue->BeginStop());  // busy
  queue->Release();
  queue->FinishStop();  // the worker ran the five before exiting
  ASSERT_EQ(log.size(), 5u);
  for (const auto& t : tasks) EXPECT_TRUE(t->finished.load());
}

}  // namespace
}  // namespace gradsum::collectives_internal
