#include "server/region_marks.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace flce {

void MarkBoard::Post(uint64_t mark, const absl::Status& outcome) {
  absl::MutexLock lock(&mu_);
  if (!posted_.emplace(mark, outcome).second) return;  // the first post wins
  written_.erase(mark);
  order_.push_back(mark);
  if (order_.size() > kMaxPosts) {
    posted_.erase(order_.front());
    order_.pop_front();
  }
}

void MarkBoard::Progress(uint64_t mark, int64_t begin, int64_t end) {
  absl::MutexLock lock(&mu_);
  if (posted_.contains(mark)) return;
  auto [at, added] = written_.try_emplace(mark, begin, end);
  if (!added && at->second.first == begin) at->second.second = std::max(at->second.second, end);
}

std::optional<absl::Status> MarkBoard::Await(uint64_t mark, absl::Time deadline,
                                             const std::function<bool()>& stop, absl::Duration poll,
                                             int64_t offset, int64_t length) {
  absl::MutexLock lock(&mu_);
  auto in = [this, mark, offset, length]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (length < 0) return false;
    auto at = written_.find(mark);
    return at != written_.end() && at->second.first <= offset &&
           offset + length <= at->second.second;
  };
  auto posted = [this, mark, &in]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return posted_.contains(mark) || in(); };
  while (!posted()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) return std::nullopt;
    mu_.Unlock();
    const bool stopped = stop && stop();
    mu_.Lock();
    if (stopped) return std::nullopt;
    mu_.AwaitWithDeadline(absl::Condition(&posted), std::min(deadline, now + poll));
  }
  auto at = posted_.find(mark);
  return at != posted_.end() ? at->second : absl::OkStatus();  // else its bytes are in
}

}  // namespace flce
