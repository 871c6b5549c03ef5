#include "server/work_queue.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace flce {

WorkQueue::WorkQueue(int workers, int max_queued)
    : max_queued_(max_queued), workers_count_(workers) {
  for (int i = 0; i < workers; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

WorkQueue::~WorkQueue() { Shutdown(); }

absl::Status WorkQueue::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("server is shutting down");
  // Idle workers take tasks at once; beyond them at most max_queued_ wait.
  const int64_t idle = workers_count_ - running_;
  if (static_cast<int64_t>(tasks_.size()) >= max_queued_ + std::max<int64_t>(idle, 0)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("work queue: ", tasks_.size(), " requests waiting of at most ",
                     max_queued_, "; retry later"));
  }
  tasks_.push_back(std::move(task));
  return absl::OkStatus();
}

absl::Status WorkQueue::RunHereOrSubmit(std::function<void()> task) {
  bool here = false;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("server is shutting down");
    here = running_ < workers_count_ && tasks_.empty();
    if (here) ++running_;
  }
  if (!here) return Submit(std::move(task));
  task();
  absl::MutexLock lock(&mu_);
  --running_;
  return absl::OkStatus();
}

void WorkQueue::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      // A task runs when a worker's place is free (a task run by its
      // caller's thread takes one too).
      mu_.Await(absl::Condition(
          +[](WorkQueue* q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) {
            return (q->stopping_ && q->tasks_.empty()) ||
                   (!q->tasks_.empty() && q->running_ < q->workers_count_);
          },
          this));
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
      ++running_;
    }
    task();
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

void WorkQueue::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
  }
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
  workers_.clear();
}

int64_t WorkQueue::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(tasks_.size());
}

int64_t WorkQueue::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

}  // namespace flce
