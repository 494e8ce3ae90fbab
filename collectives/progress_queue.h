#ifndef GRADSUM_COLLECTIVES_PROGRESS_QUEUE_H_
#define GRADSUM_COLLECTIVES_PROGRESS_QUEUE_H_

// ProgressQueue: one communicator's issue-order queue of asynchronous operations and the
// worker thread that runs them, the one piece the thread and mpi backends share for it (an
// implementation detail of collectives/, not an API for callers).
//
// Operations run one at a time, in the order they were pushed: by the worker, or by a
// caller that claims execution for its own thread (a synchronous call when nothing is
// queued or running, TryClaim / ClaimWhenDrained; a Wait that runs the queue up to its own
// operation, RunUpTo). A task's Run() does the work under the claim, the queue then
// releases the claim, then calls Finish() (which signals the operation's completion): a
// waiter woken by Finish finds the queue free and can claim it at once.
//
//   auto queue = ProgressQueue::Start({.on_idle = [this] { AnswerAsks(); },
//                                      .idle_period = std::chrono::milliseconds(100)});
//   queue->Push(task);                       // async: the worker runs it in its turn
//   if (queue->TryClaim()) { ...; queue->Release(); }   // sync, on the caller's thread
//   queue->Stop();                           // in the owner's destructor
//
// Synchronisation is std::mutex / std::condition_variable (not absl::Mutex): the system
// abseil is not built with ThreadSanitizer, which then could not see the hand-offs. The
// caller that releases notifies after unlocking, and only when a sleeper can proceed (a
// sleeper woken while the notifier still holds the lock would block on it again: two more
// context switches per hand-off on a busy core).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace gradsum::collectives_internal {

class ProgressQueue {
 public:
  class Task {
   public:
    virtual ~Task() = default;
    // The operation, run under the execution claim (by the worker or a RunUpTo caller).
    virtual void Run() = 0;
    // After the claim is released: signal completion to the operation's waiters.
    virtual void Finish() {}

   private:
    friend class ProgressQueue;
    bool queued_ = false;  // guarded by the queue's mutex; true until taken off the queue
  };

  struct Options {
    // With a positive idle_period, the idle worker calls on_idle every idle_period (the mpi
    // backend answers where-is-everyone asks and watches blocking calls there); otherwise it
    // sleeps until there is work.
    std::function<void()> on_idle;
    std::chrono::nanoseconds idle_period{0};
  };

  // Creates the queue and starts its worker (no idle callback without options).
  static std::shared_ptr<ProgressQueue> Start(Options options);
  static std::shared_ptr<ProgressQueue> Start();
  ~ProgressQueue();  // Stop()s if the owner did not

  ProgressQueue(const ProgressQueue&) = delete;
  ProgressQueue& operator=(const ProgressQueue&) = delete;

  // Stopping, in two halves so that the owner can act in between (the thread backend breaks
  // its group when an operation was abandoned). BeginStop: no more claims or RunUpTo; the
  // worker will run what is queued, then exit. Returns whether a task was queued or running.
  bool BeginStop();
  // Joins the worker, then waits for a caller still running a claimed operation.
  void FinishStop();
  void Stop() {
    BeginStop();
    FinishStop();
  }

  // Queues a task; the worker runs it in its turn.
  void Push(std::shared_ptr<Task> task);

  // Claims execution for the calling thread when nothing is queued or running, the queue
  // is not stopping and `also()` (evaluated under the queue's lock, so state handed over
  // through it may be read) holds. End the claim with Release().
  template <typename Also>
  bool TryClaim(const Also& also) {
    std::lock_guard<std::mutex> lock(mu_);
    if (executing_ || !queue_.empty() || stopping_ || !also()) return false;
    executing_ = true;
    return true;
  }
  bool TryClaim() {
    return TryClaim([] { return true; });
  }
  // Waits until nothing is queued or running, then claims (each queued task is bounded by
  // its own deadline). False, without a claim, when the queue is stopping.
  bool ClaimWhenDrained();
  // Ends a claim made by TryClaim or ClaimWhenDrained.
  void Release();

  // Runs queued tasks on the calling thread, in order, up to and including `task`, while
  // nobody else runs one and the queue is not stopping (it returns early otherwise: the
  // worker, or whoever runs, will reach `task`).
  void RunUpTo(const Task* task);

  // Tasks queued or running, published with release when one is done: a caller that reads
  // 0 (acquire) sees everything the runs did, and with nothing queued the worker stays idle
  // until the caller pushes again (the mpi backend's sync fast path).
  int64_t pending() const { return pending_.load(std::memory_order_acquire); }

 private:
  explicit ProgressQueue(Options options) : options_(std::move(options)) {}
  void WorkerLoop();
  // Runs a task taken off the queue (the caller set executing_), releases, finishes it.
  void RunTaken(Task& task);
  // Whether a sleeper can proceed after a change. Caller holds mu_.
  bool NeedsWake() const {
    return (worker_idle_ && (!queue_.empty() || stopping_) && !executing_) || waiters_ > 0;
  }

  const Options options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Task>> queue_;  // guarded by mu_
  bool executing_ = false;                   // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  bool worker_idle_ = false;                 // guarded by mu_; the worker sleeps on cv_
  int waiters_ = 0;                          // guarded by mu_; others sleeping on cv_ (drain, stop)
  std::atomic<int64_t> pending_{0};
  std::thread worker_;
};

}  // namespace gradsum::collectives_internal

#endif  // GRADSUM_COLLECTIVES_PROGRESS_QUEUE_H_
