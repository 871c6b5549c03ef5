#ifndef FLCE_SERVER_REQUEST_ADMISSION_H_
#define FLCE_SERVER_REQUEST_ADMISSION_H_

// Bounds on what requests in flight can make the server hold:
//
// - request memory (--request_memory_bytes, in total and per principal):
//   every unary request's message while its call lasts, and the bytes a
//   ForwardStream's announced tensors will take, reserved when its header
//   arrives (also against the host's available memory) before anything is
//   allocated;
// - a slot per open client stream (ForwardStream, PutWeight), in total and
//   per principal;
// - an idle timeout: a stream that delivers no message for that long is
//   finished with DEADLINE_EXCEEDED, whatever its client does.
//
// Past a bound the request is refused at once with RESOURCE_EXHAUSTED
// naming the bound and its flag. PutWeight's bytes are bounded by the
// weight budget (WeightRegistry), not here.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace flce {

struct RequestLimits {
  // Bytes unary requests in flight and the announced tensors of open
  // ForwardStreams may take (--request_memory_bytes), and one principal's
  // (0: no per-principal bound).
  int64_t memory_bytes = int64_t{16} << 30;
  int64_t memory_bytes_per_principal = 0;
  // Open ForwardStream and PutWeight streams (--max_streams), and one
  // principal's (0: no per-principal bound).
  int64_t max_streams = 64;
  int64_t max_streams_per_principal = 0;
  // A stream with no message for this long is finished (--stream_idle_timeout).
  absl::Duration idle_timeout = absl::Seconds(30);
};

class RequestAdmission;

// Request memory held by one unary call, given back when destroyed.
// Move-only.
class MemoryHold {
 public:
  MemoryHold() = default;
  MemoryHold(MemoryHold&& other) noexcept;
  MemoryHold& operator=(MemoryHold&& other) noexcept;
  ~MemoryHold();

 private:
  friend class RequestAdmission;
  RequestAdmission* owner_ = nullptr;
  std::string principal_;
  int64_t bytes_ = 0;
};

// One open stream's slot and reserved bytes, given back when destroyed.
// Move-only.
class StreamTicket {
 public:
  StreamTicket() = default;
  StreamTicket(StreamTicket&& other) noexcept;
  StreamTicket& operator=(StreamTicket&& other) noexcept;
  ~StreamTicket();

  // Reserves `bytes` more for this stream. RESOURCE_EXHAUSTED naming the
  // bound (and `what`) past the total or the principal's budget or the
  // host's available memory; nothing is reserved then.
  absl::Status Reserve(int64_t bytes, const std::string& what);

  // A message arrived: the idle clock restarts.
  void Touch();
  // The stream's data is complete; the idle timeout no longer applies.
  void StopWatching();

 private:
  friend class RequestAdmission;
  struct Watched;
  void Reset();

  RequestAdmission* owner_ = nullptr;
  std::string principal_;
  int64_t bytes_ = 0;
  std::shared_ptr<Watched> watched_;
};

class RequestAdmission {
 public:
  // `host_available` tells the bytes the host can still give (-1: unknown).
  explicit RequestAdmission(RequestLimits limits,
                           std::function<int64_t()> host_available = nullptr);
  ~RequestAdmission();  // stops the idle watch
  RequestAdmission(const RequestAdmission&) = delete;
  RequestAdmission& operator=(const RequestAdmission&) = delete;

  // Opens a stream of `principal` (`rpc` names it in messages). `on_idle`
  // runs on the watch thread, at most once, if the stream stays idle past
  // the timeout while watched; it must finish the call and must not destroy
  // the ticket itself. RESOURCE_EXHAUSTED when too many streams are open.
  absl::StatusOr<StreamTicket> Open(const std::string& principal, const char* rpc,
                                    std::function<void()> on_idle);

  // Request memory for a unary message of `bytes` that has arrived (it
  // exists already: past the budget it is refused, and freed, at once).
  absl::StatusOr<MemoryHold> HoldMessage(const std::string& principal, int64_t bytes,
                                         const char* rpc);

  const RequestLimits& limits() const { return limits_; }
  int64_t open_streams() const;
  int64_t bytes_in_use() const;
  int64_t idle_timeouts() const { return idle_timeouts_.load(); }

 private:
  friend class StreamTicket;
  friend class MemoryHold;
  void ReleaseBytes(const std::string& principal, int64_t bytes);
  struct Usage {
    int64_t streams = 0, bytes = 0;
  };
  // `check_host`: also against the host's available memory (for bytes not
  // allocated yet).
  absl::Status ReserveBytes(const std::string& principal, int64_t bytes, const std::string& what,
                            bool check_host = true);
  void Close(const std::string& principal, int64_t bytes,
             const std::shared_ptr<StreamTicket::Watched>& watched);
  void WatchLoop();

  const RequestLimits limits_;
  const std::function<int64_t()> host_available_;
  mutable absl::Mutex mu_;
  int64_t streams_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::shared_ptr<StreamTicket::Watched>> watched_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> idle_timeouts_{0};
  absl::Notification stop_;
  std::thread watcher_;
};

}  // namespace flce

#endif  // FLCE_SERVER_REQUEST_ADMISSION_H_
