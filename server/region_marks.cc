#include "server/region_marks.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace flce {

void MarkBoard::Post(uint64_t mark, const absl::Status& outcome) {
  absl::MutexLock lock(&mu_);
  if (!posted_.emplace(mark, outcome).second) return;  // the first post wins
  order_.push_back(mark);
  if (order_.size() > kMaxPosts) {
    posted_.erase(order_.front());
    order_.pop_front();
  }
}

std::optional<absl::Status> MarkBoard::Await(uint64_t mark, absl::Time deadline,
                                             const std::function<bool()>& stop,
                                             absl::Duration poll) {
  absl::MutexLock lock(&mu_);
  auto posted = [this, mark]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return posted_.contains(mark); };
  while (!posted()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) return std::nullopt;
    mu_.Unlock();
    const bool stopped = stop && stop();
    mu_.Lock();
    if (stopped) return std::nullopt;
    mu_.AwaitWithDeadline(absl::Condition(&posted), std::min(deadline, now + poll));
  }
  return posted_.at(mark);
}

}  // namespace flce
