#ifndef FLCE_SERVER_WORK_QUEUE_H_
#define FLCE_SERVER_WORK_QUEUE_H_

// A bounded FIFO of tasks run by a fixed set of worker threads. The engine
// work of every RPC goes through it, so the number of concurrent engine
// calls and the backlog are both limited. A caller with a thread of its own
// to spare (a call channel's) may run its task there instead, taking a
// worker's place: at most `workers` tasks run at once either way.

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace flce {

class WorkQueue {
 public:
  // REQUIRES: workers >= 1, max_queued >= 0.
  WorkQueue(int workers, int max_queued);
  ~WorkQueue();  // Shutdown()
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `task`. RESOURCE_EXHAUSTED when every worker is busy and
  // max_queued tasks are already waiting,
  // UNAVAILABLE after Shutdown began. A task that is queued always runs.
  absl::Status Submit(std::function<void()> task);

  // Runs `task` on the calling thread, now, when fewer than `workers` tasks
  // run and none waits (it then counts as running); otherwise queues it as
  // Submit does. Errors as Submit's.
  absl::Status RunHereOrSubmit(std::function<void()> task);

  // Stops accepting tasks, runs those already queued, joins the workers.
  // Idempotent.
  void Shutdown();

  int64_t queued() const;
  int64_t running() const;
  int max_queued() const { return max_queued_; }

 private:
  void WorkerLoop();

  const int max_queued_;
  const int64_t workers_count_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> workers_;
};

}  // namespace flce

#endif  // FLCE_SERVER_WORK_QUEUE_H_
