#include "collectives/progress_queue.h"

#include <utility>

namespace gradsum::collectives_internal {

std::shared_ptr<ProgressQueue> ProgressQueue::Start(Options options) {
  std::shared_ptr<ProgressQueue> q(new ProgressQueue(std::move(options)));
  ProgressQueue* raw = q.get();
  q->worker_ = std::thread([raw] { raw->WorkerLoop(); });
  return q;
}

std::shared_ptr<ProgressQueue> ProgressQueue::Start() { return Start(Options()); }

ProgressQueue::~ProgressQueue() { Stop(); }

bool ProgressQueue::BeginStop() {
  std::lock_guard<std::mutex> lock(mu_);
  stopping_ = true;
  cv_.notify_all();
  return executing_ || !queue_.empty();
}

void ProgressQueue::FinishStop() {
  if (worker_.joinable()) worker_.join();
  // A caller running a claimed operation finishes it before the owner goes away.
  std::unique_lock<std::mutex> lock(mu_);
  ++waiters_;
  cv_.wait(lock, [&] { return !executing_; });
  --waiters_;
}

void ProgressQueue::Push(std::shared_ptr<Task> task) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    task->queued_ = true;
    queue_.push_back(std::move(task));
    pending_.fetch_add(1, std::memory_order_relaxed);
    wake = NeedsWake();
  }
  if (wake) cv_.notify_all();
}

bool ProgressQueue::ClaimWhenDrained() {
  std::unique_lock<std::mutex> lock(mu_);
  ++waiters_;
  cv_.wait(lock, [&] { return stopping_ || (!executing_ && queue_.empty()); });
  --waiters_;
  if (stopping_) return false;
  executing_ = true;
  return true;
}

void ProgressQueue::Release() {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    executing_ = false;
    wake = NeedsWake();
  }
  if (wake) cv_.notify_all();
}

void ProgressQueue::RunTaken(Task& task) {
  task.Run();
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    executing_ = false;
    pending_.fetch_sub(1, std::memory_order_release);
    wake = NeedsWake();
  }
  if (wake) cv_.notify_all();
  task.Finish();
}

void ProgressQueue::RunUpTo(const Task* task) {
  for (;;) {
    std::shared_ptr<Task> front;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (executing_ || stopping_ || !task->queued_) return;
      front = std::move(queue_.front());
      queue_.pop_front();
      front->queued_ = false;
      executing_ = true;
    }
    RunTaken(*front);
    if (front.get() == task) return;
  }
}

void ProgressQueue::WorkerLoop() {
  const bool periodic = options_.on_idle && options_.idle_period.count() > 0;
  for (;;) {
    std::shared_ptr<Task> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      worker_idle_ = true;
      const auto ready = [&] { return !executing_ && (stopping_ || !queue_.empty()); };
      while (!ready()) {
        if (!periodic) {
          cv_.wait(lock);
          continue;
        }
        if (cv_.wait_for(lock, options_.idle_period) == std::cv_status::timeout) {
          lock.unlock();
          options_.on_idle();
          lock.lock();
        }
      }
      worker_idle_ = false;
      if (queue_.empty()) return;  // stopping, with everything run
      task = std::move(queue_.front());
      queue_.pop_front();
      task->queued_ = false;
      executing_ = true;
    }
    RunTaken(*task);
  }
}

}  // namespace gradsum::collectives_internal
