#include "server/session_store.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/random_id.h"

namespace flce {
namespace {

// Ended ids are remembered for max(TTL, kMinTombstoneAge) so a late Backward
// learns what happened (consumed, released, expired) rather than "unknown".
// Past kMaxTombstones (about 25 MiB) the next reap forgets them all.
constexpr size_t kMaxTombstones = size_t{1} << 18;
constexpr absl::Duration kMinTombstoneAge = absl::Minutes(10);
// How long a Backward waits for a consuming Backward's answer to settle
// (normally microseconds; it matters to a client retrying at once).
constexpr absl::Duration kSettleWait = absl::Seconds(2);

std::string Short(const std::string& id) { return id.substr(0, 8); }

}  // namespace

Reservation::Reservation(Reservation&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      principal_(std::move(other.principal_)) {}

Reservation& Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    if (store_ != nullptr) store_->Unreserve(bytes_, principal_);
    store_ = std::exchange(other.store_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    principal_ = std::move(other.principal_);
  }
  return *this;
}

Reservation::~Reservation() {
  if (store_ != nullptr) store_->Unreserve(bytes_, principal_);
}

SessionStore::SessionStore(SessionLimits limits, Clock clock)
    : limits_(limits), clock_(std::move(clock)) {}

bool SessionStore::Fits(int64_t bytes) const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(live_.size()) + reserved_count_ < limits_.max_sessions &&
         live_bytes_ + reserved_bytes_ + bytes <= limits_.memory_budget_bytes;
}

absl::StatusOr<Reservation> SessionStore::Reserve(int64_t bytes, const std::string& principal) {
  absl::MutexLock lock(&mu_);
  auto mine_it = usage_.find(principal);
  const Usage mine = mine_it == usage_.end() ? Usage() : mine_it->second;
  if (limits_.max_sessions_per_principal > 0 &&
      mine.sessions >= limits_.max_sessions_per_principal) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sessions: this principal has ", mine.sessions, " live of at most ",
        limits_.max_sessions_per_principal,
        " per principal; release sessions (Backward or ReleaseSession) first"));
  }
  if (limits_.memory_bytes_per_principal > 0 &&
      mine.bytes + bytes > limits_.memory_bytes_per_principal) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session memory: this session needs ", bytes, " bytes, this principal's sessions hold ",
        mine.bytes, " of its ", limits_.memory_bytes_per_principal, " bytes"));
  }
  const int64_t count = static_cast<int64_t>(live_.size()) + reserved_count_;
  if (count >= limits_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("sessions: ", count, " live of at most ",
                     limits_.max_sessions,
                     "; release sessions (Backward or ReleaseSession) first"));
  }
  const int64_t used = live_bytes_ + reserved_bytes_;
  if (used + bytes > limits_.memory_budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session memory: this session needs ", bytes, " bytes, ", used,
        " of the budget of ", limits_.memory_budget_bytes, " bytes are in use"));
  }
  ++reserved_count_;
  reserved_bytes_ += bytes;
  AddUsageLocked(principal, 1, bytes);
  return Reservation(this, bytes, principal);
}

void SessionStore::AddUsageLocked(const std::string& principal, int64_t sessions,
                                  int64_t bytes) {
  Usage& usage = usage_[principal];
  usage.sessions += sessions;
  usage.bytes += bytes;
  if (usage.sessions == 0) usage_.erase(principal);
}

void SessionStore::Unreserve(int64_t bytes, const std::string& principal) {
  absl::MutexLock lock(&mu_);
  --reserved_count_;
  reserved_bytes_ -= bytes;
  AddUsageLocked(principal, -1, -bytes);
}

std::string SessionStore::Commit(Reservation reservation,
                                 std::unique_ptr<SavedState> state,
                                 const SessionInfo& info) {
  Session session;
  session.state = std::move(state);
  session.info = info;
  session.principal = reservation.principal_;
  session.bytes = reservation.bytes();
  session.last_used = clock_();
  std::string id = RandomId();
  absl::MutexLock lock(&mu_);
  // The reservation's budget moves to the live session.
  --reserved_count_;
  reserved_bytes_ -= reservation.bytes_;
  reservation.store_ = nullptr;
  live_bytes_ += session.bytes;
  live_.emplace(id, std::move(session));
  return id;
}

absl::StatusOr<SessionLease> SessionStore::Acquire(const std::string& id,
                                                   const std::string& principal) {
  absl::MutexLock lock(&mu_);
  auto settled = [this, &id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto tomb = ended_.find(id);
    return tomb == ended_.end() || tomb->second.how != Ended::kDelivering;
  };
  mu_.AwaitWithTimeout(absl::Condition(&settled), kSettleWait);
  auto it = live_.find(id);
  if (it != live_.end() && it->second.principal == principal) {
    Session& s = it->second;
    if (s.in_use) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session_id ", Short(id), "…: in use by another Backward"));
    }
    if (clock_() - s.last_used > limits_.ttl) {
      EndLocked(id, Ended::kExpired);
    } else {
      s.in_use = true;
      return SessionLease{id, s.info, s.state, s.undelivered, s.principal, s.bytes};
    }
  }
  auto tomb = ended_.find(id);
  if (tomb != ended_.end() && tomb->second.principal == principal) {
    switch (tomb->second.how) {
      case Ended::kConsumed:
      case Ended::kDelivering:
        return absl::FailedPreconditionError(absl::StrCat(
            "session_id ", Short(id),
            "…: already consumed by a Backward; pass keep_session to run "
            "Backward more than once"));
      case Ended::kReleased:
        return absl::FailedPreconditionError(absl::StrCat(
            "session_id ", Short(id), "…: released by ReleaseSession"));
      case Ended::kExpired:
        return absl::NotFoundError(absl::StrCat(
            "session_id ", Short(id), "…: expired after ",
            absl::FormatDuration(limits_.ttl),
            " idle; run Forward again"));
    }
  }
  return absl::NotFoundError(absl::StrCat(
      "session_id ", Short(id.empty() ? std::string("(empty)") : id),
      "…: unknown session (never created here, or the server restarted)"));
}

void SessionStore::Finish(const SessionLease& lease, bool consume,
                          std::optional<UndeliveredAccumulation> undelivered, bool pending) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(lease.id);
  if (it == live_.end()) return;
  it->second.in_use = false;
  it->second.last_used = clock_();
  it->second.undelivered = std::move(undelivered);
  if (consume) {
    EndLocked(lease.id, pending ? Ended::kDelivering : Ended::kConsumed);
  } else if (it->second.release_when_done) {
    EndLocked(lease.id, Ended::kReleased);
  }
}

void SessionStore::Delivered(const SessionLease& lease) {
  absl::MutexLock lock(&mu_);
  auto tomb = ended_.find(lease.id);
  if (tomb != ended_.end() && tomb->second.how == Ended::kDelivering) {
    tomb->second.how = Ended::kConsumed;
  }
}

void SessionStore::Restore(const SessionLease& lease,
                           std::optional<UndeliveredAccumulation> undelivered) {
  absl::MutexLock lock(&mu_);
  auto tomb = ended_.find(lease.id);
  if (tomb == ended_.end() || tomb->second.how != Ended::kDelivering) return;
  ended_.erase(tomb);
  Session session;
  session.state = lease.state;
  session.info = lease.info;
  session.principal = lease.principal;
  session.bytes = lease.bytes;
  session.last_used = clock_();
  session.undelivered = std::move(undelivered);
  live_bytes_ += session.bytes;
  AddUsageLocked(session.principal, 1, session.bytes);
  live_.emplace(lease.id, std::move(session));
}

void SessionStore::MarkUndelivered(const SessionLease& lease,
                                   UndeliveredAccumulation undelivered) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(lease.id);
  if (it != live_.end()) it->second.undelivered = std::move(undelivered);
}

bool SessionStore::Release(const std::string& id, const std::string& principal) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(id);
  if (it == live_.end() || it->second.principal != principal) return false;
  if (it->second.in_use) {
    it->second.release_when_done = true;
    return true;
  }
  EndLocked(id, Ended::kReleased);
  return true;
}

void SessionStore::EndLocked(const std::string& id, Ended how) {
  auto it = live_.find(id);
  live_bytes_ -= it->second.bytes;
  AddUsageLocked(it->second.principal, -1, -it->second.bytes);
  if (how == Ended::kExpired) ++expired_total_;
  ended_[id] = Tombstone{how, it->second.principal, clock_()};
  live_.erase(it);
}

int SessionStore::ReapExpired() {
  // Declared before the lock so the freed states are destroyed after it.
  std::vector<std::shared_ptr<SavedState>> freed;
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_();
  std::vector<std::string> expired;
  for (const auto& [id, s] : live_) {
    if (!s.in_use && now - s.last_used > limits_.ttl) expired.push_back(id);
  }
  for (const std::string& id : expired) {
    freed.push_back(live_[id].state);
    EndLocked(id, Ended::kExpired);
  }
  const bool too_many = ended_.size() > kMaxTombstones;
  for (auto it = ended_.begin(); it != ended_.end();) {
    // A session whose answer is still on its way may yet be restored.
    if (it->second.how == Ended::kDelivering) {
      ++it;
      continue;
    }
    if (too_many || now - it->second.when > std::max(limits_.ttl, kMinTombstoneAge)) {
      ended_.erase(it++);
    } else {
      ++it;
    }
  }
  return static_cast<int>(freed.size());
}

int64_t SessionStore::live_sessions() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(live_.size());
}

int64_t SessionStore::expired_total() const {
  absl::MutexLock lock(&mu_);
  return expired_total_;
}

int64_t SessionStore::bytes_in_use() const {
  absl::MutexLock lock(&mu_);
  return live_bytes_ + reserved_bytes_;
}

}  // namespace flce
