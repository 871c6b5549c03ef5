#ifndef FLCE_SERVER_CALL_CHANNEL_H_
#define FLCE_SERVER_CALL_CHANNEL_H_

// Call channels (LossService.OpenCallChannel; the protocol is
// proto/call_channel_layout.h): a same-host client's Forward, Backward and
// ReleaseSession calls through a POSIX shared-memory region instead of
// gRPC. Each open channel has a thread of its own that sleeps in futex(2)
// until shortly before the client's next call is due (as the gaps after
// its last calls of the same method tell: CallGaps), polls the region from
// then for `spin`, and sleeps again until the client wakes it; the calls
// run on that thread when a worker's place is free
// (WorkQueue::RunHereOrSubmit). A same-host gRPC call costs several thread
// wake-ups, each 0.2 ms on an idle virtual CPU (bench/RESULTS.md); a
// channel's call costs none when it comes on time.
//
// What a client controls is treated as hostile: the request is copied out
// of the region before it is parsed, its length is checked against the
// request area, every answer is bounded by the response area, and a region
// its owner shrinks (SigbusGuard) closes the channel. Channels are bounded
// (CallChannelLimits) and one idle for `idle_timeout` is closed.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "proto/flce/v1/loss_service.pb.h"
#include "server/metrics.h"
#include "server/request_admission.h"
#include "server/rpc_call.h"
#include "server/shared_memory.h"

namespace flce {

struct CallChannelLimits {
  // Open channels (--max_call_channels, at most 1024: a thread each) and
  // one principal's (0: no per-principal bound).
  int64_t max_channels = 64;
  int64_t max_channels_per_principal = 0;
  // How long a channel's thread polls from the moment the next call is
  // due before it sleeps (--call_channel_spin; zero: it never polls).
  absl::Duration spin = absl::Milliseconds(50);
  // A channel without a call for this long is closed (--call_channel_idle_timeout).
  absl::Duration idle_timeout = absl::Minutes(10);
};

// When a channel's next call is due: the gap between the answer to a call
// and the call after it, kept per method of the call answered (the average
// of its last gaps and of their deviation from it, the newest weighing half
// each; a call is expected from two deviations before the average on). A
// training step through a channel alternates Forward and Backward: a short
// gap after Forward (the worker's Python between them), the rest of the
// step after Backward; one average of both mispredicts each, and a call
// that comes before the thread polls costs a wake-up on both sides.
class CallGaps {
 public:
  // `gap` passed between the answer to a call of `method` and the next call.
  void Observe(uint32_t method, absl::Duration gap);
  // The shortest gap likely after a call of `method` (the average less two
  // deviations, at least zero); zero while none was seen (the thread then
  // polls at once).
  absl::Duration Expected(uint32_t method) const;

 private:
  // Forward, Backward and ReleaseSession each; any other number (a
  // client's garbage) in slot 0.
  static int Slot(uint32_t method) { return method < kSlots ? static_cast<int>(method) : 0; }
  static constexpr uint32_t kSlots = 4;
  absl::Duration gaps_[kSlots] = {};
  absl::Duration deviations_[kSlots] = {};
  bool seen_[kSlots] = {};
};

// What serves a channel's calls: the loss service's handlers, as for the
// RPCs of the same names (the principal is the channel's).
class CallChannelService {
 public:
  virtual ~CallChannelService() = default;
  virtual void ChannelForward(Call* call, const std::string& principal,
                              const v1::ForwardRequest* request,
                              v1::ForwardResponse* response) = 0;
  virtual void ChannelBackward(Call* call, const std::string& principal,
                               const v1::BackwardRequest* request,
                               v1::BackwardResponse* response) = 0;
  virtual void ChannelReleaseSession(Call* call, const std::string& principal,
                                     const v1::ReleaseSessionRequest* request,
                                     v1::ReleaseSessionResponse* response) = 0;
};

class CallChannel;

class CallChannels {
 public:
  // `service`, `admission` (which holds each request's bytes like a unary
  // message's) and `metrics` must outlive this. Areas may hold at most
  // `max_message_bytes`.
  CallChannels(CallChannelLimits limits, int64_t max_message_bytes, CallChannelService* service,
               RequestAdmission* admission, ServiceMetrics* metrics);
  ~CallChannels();  // Shutdown(now)
  CallChannels(const CallChannels&) = delete;
  CallChannels& operator=(const CallChannels&) = delete;

  // Opens a channel in `region` (a POSIX region of `principal`'s, its
  // magic written) for `principal`: its id. INVALID_ARGUMENT (naming the
  // field) for areas out of bounds or a region that is not a POSIX one or
  // has no magic; RESOURCE_EXHAUSTED past a bound; UNAVAILABLE after
  // Shutdown began.
  absl::StatusOr<std::string> Open(std::shared_ptr<SharedRegion> region, int64_t request_bytes,
                                   int64_t response_bytes, const std::string& principal);

  // Closes `principal`'s channel `id` once the call it serves (if any) has
  // been answered; false when there is none.
  bool Close(const std::string& id, const std::string& principal);

  // Closes every channel and refuses new ones; calls in flight have until
  // `deadline` to finish, then they are cancelled. Returns at once.
  void StopAll(absl::Time deadline);
  // StopAll, then waits until every channel's thread is gone (the work
  // queue must still run for their calls in flight).
  void Shutdown(absl::Time deadline);

  const CallChannelLimits& limits() const { return limits_; }
  int64_t size() const;  // channels open (and closing)

 private:
  // Forgets (and joins) channels whose thread has ended (closed, idle,
  // broken): they are no longer open.
  void Reap() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every 100 ms, each channel's kHeartbeat.
  void Heartbeat();

  const CallChannelLimits limits_;
  const int64_t max_message_bytes_;
  CallChannelService* const service_;
  RequestAdmission* const admission_;
  ServiceMetrics* const metrics_;
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<std::string, std::shared_ptr<CallChannel>> channels_
      ABSL_GUARDED_BY(mu_);
  // Closed by Close, their thread possibly still answering.
  mutable std::vector<std::shared_ptr<CallChannel>> closing_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification stop_heart_;
  std::thread heart_;  // last: started once the rest is there
};

}  // namespace flce

#endif  // FLCE_SERVER_CALL_CHANNEL_H_
