#ifndef FLCE_SERVER_SESSION_STORE_H_
#define FLCE_SERVER_SESSION_STORE_H_

// Sessions: what a Forward keeps for its Backward, with limits.
//
// - Ids are 128 random bits from the kernel's CSPRNG (getrandom), as 32 hex
//   characters.
// - A session is reserved (count and bytes checked against SessionLimits)
//   before the engine runs and committed after, so nothing is computed that
//   cannot be kept; nothing live is ever evicted to make room.
// - Backward acquires a session exclusively; when it finishes the session is
//   kept (keep_session) or consumed. A consumed id answers
//   FAILED_PRECONDITION, an expired or unknown one NOT_FOUND, each saying which.
// - Idle sessions expire after the TTL (ReapExpired, called periodically).
// - A session belongs to the principal that made it; other principals get
//   NOT_FOUND, as if it did not exist.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/loss_engine.h"
#include "kernels/tensor.h"

namespace flce {

class RegisteredWeight;

struct SessionLimits {
  int64_t max_sessions = 1024;
  int64_t memory_budget_bytes = int64_t{16} << 30;
  absl::Duration ttl = absl::Minutes(10);
  // The count and memory limits for each principal's own sessions; 0: only
  // the totals apply.
  int64_t max_sessions_per_principal = 0;
  int64_t memory_bytes_per_principal = 0;
};

// What Backward needs to know about a session besides the engine's state.
struct SessionInfo {
  Reduction reduction = Reduction::kMean;
  int64_t rows = 0;
  DType dtype = DType::kFloat32;  // of the inputs
  int64_t hidden = 0, vocab = 0;
  bool has_bias = false;
  bool shard = false;  // a vocabulary shard's (its Backward needs global_lse)
  // The registered weight version the Forward used (kept alive), if any.
  std::shared_ptr<RegisteredWeight> weight;
};

class SessionStore;

// Budget held for a session being computed. Returned to the store when
// destroyed unless committed.
class Reservation {
 public:
  Reservation() = default;
  Reservation(Reservation&& other) noexcept;
  Reservation& operator=(Reservation&& other) noexcept;
  ~Reservation();

  int64_t bytes() const { return bytes_; }

 private:
  friend class SessionStore;
  Reservation(SessionStore* store, int64_t bytes, std::string principal)
      : store_(store), bytes_(bytes), principal_(std::move(principal)) {}
  SessionStore* store_ = nullptr;
  int64_t bytes_ = 0;
  std::string principal_;
};

// An accumulating Backward whose dX did not reach its client: its dW is in
// the weight's accumulator already, so the session remembers the call and
// only its retry (the same grad_output) may run next, returning dX without
// adding dW again.
struct UndeliveredAccumulation {
  std::optional<HostTensor> grad_output;  // fp32; absent: 1
};

// A session held by one Backward.
struct SessionLease {
  std::string id;
  SessionInfo info;
  std::shared_ptr<SavedState> state;
  std::optional<UndeliveredAccumulation> undelivered;
  std::string principal;
  int64_t bytes = 0;
};

class SessionStore {
 public:
  using Clock = std::function<absl::Time()>;

  explicit SessionStore(SessionLimits limits, Clock clock = absl::Now);
  SessionStore(const SessionStore&) = delete;
  SessionStore& operator=(const SessionStore&) = delete;

  const SessionLimits& limits() const { return limits_; }

  // True if a session of `bytes` would fit now.
  bool Fits(int64_t bytes) const;

  // Holds room for one session of `bytes` for `principal`.
  // RESOURCE_EXHAUSTED, with the numbers, when the count or the memory
  // budget would be exceeded, in total or for the principal.
  absl::StatusOr<Reservation> Reserve(int64_t bytes, const std::string& principal);

  // Turns a reservation into a live session of its principal; returns its id.
  std::string Commit(Reservation reservation, std::unique_ptr<SavedState> state,
                     const SessionInfo& info);

  // Takes a session for a Backward. A session consumed by a Backward whose
  // answer is still on its way (Finish with `pending`) is waited for,
  // briefly: if that answer is not delivered, Restore brings it back.
  // NOT_FOUND: unknown, expired or another principal's.
  // FAILED_PRECONDITION: already consumed, or in use by another Backward.
  absl::StatusOr<SessionLease> Acquire(const std::string& id,
                                       const std::string& principal);

  // Ends a Backward's hold. `consume` ends the session (later Acquires fail
  // with FAILED_PRECONDITION) and gives its budget back; otherwise it stays,
  // its TTL restarted, remembering `undelivered` (the next lease carries
  // it). With `pending` (and `consume`) the answer is still on its way:
  // Restore or Delivered must follow.
  void Finish(const SessionLease& lease, bool consume,
              std::optional<UndeliveredAccumulation> undelivered = std::nullopt,
              bool pending = false);

  // A pending consumption's answer reached its client.
  void Delivered(const SessionLease& lease);

  // A pending consumption's answer did not reach its client: the session is
  // live again as it was (its budget retaken even past the limits, since
  // its memory never left), remembering `undelivered`.
  void Restore(const SessionLease& lease,
               std::optional<UndeliveredAccumulation> undelivered = std::nullopt);

  // Remembers `undelivered` on a live session (a kept session whose
  // accumulating Backward was not delivered).
  void MarkUndelivered(const SessionLease& lease, UndeliveredAccumulation undelivered);

  // Frees a session. Idempotent: false if there was no live session with
  // that id for `principal`. A session in use is freed when its Backward
  // finishes.
  bool Release(const std::string& id, const std::string& principal);

  // Frees sessions idle for longer than the TTL; returns how many.
  int ReapExpired();

  int64_t live_sessions() const;
  int64_t bytes_in_use() const;  // live sessions and reservations
  int64_t expired_total() const;  // sessions ended by their TTL, ever

 private:
  friend class Reservation;

  struct Session {
    std::shared_ptr<SavedState> state;
    SessionInfo info;
    std::string principal;
    int64_t bytes = 0;
    absl::Time last_used;
    bool in_use = false;
    bool release_when_done = false;
    std::optional<UndeliveredAccumulation> undelivered;
  };
  // kDelivering: consumed by a Backward whose answer is on its way.
  enum class Ended { kConsumed, kDelivering, kReleased, kExpired };
  struct Tombstone {
    Ended how;
    std::string principal;
    absl::Time when;
  };

  struct Usage {
    int64_t sessions = 0, bytes = 0;  // live and reserved
  };
  void Unreserve(int64_t bytes, const std::string& principal);
  void AddUsageLocked(const std::string& principal, int64_t sessions, int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a live session, leaving a tombstone. REQUIRES: mu_ held.
  void EndLocked(const std::string& id, Ended how)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionLimits limits_;
  const Clock clock_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Session> live_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Tombstone> ended_ ABSL_GUARDED_BY(mu_);
  int64_t reserved_count_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t expired_total_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flce

#endif  // FLCE_SERVER_SESSION_STORE_H_
