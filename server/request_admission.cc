#include "server/request_admission.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "server/host_memory.h"

namespace flce {

// What the idle watch shares with a ticket. `mu` orders the watch's call of
// on_idle before the ticket's end (after which the call is gone).
struct StreamTicket::Watched {
  explicit Watched(std::function<void()> f) : on_idle(std::move(f)) {}
  absl::Mutex mu;
  bool alive ABSL_GUARDED_BY(mu) = true;
  std::function<void()> on_idle ABSL_GUARDED_BY(mu);
  std::atomic<int64_t> last_activity_ns{absl::GetCurrentTimeNanos()};
  std::atomic<bool> watching{true};
};

StreamTicket::StreamTicket(StreamTicket&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      principal_(std::move(other.principal_)),
      bytes_(std::exchange(other.bytes_, 0)),
      watched_(std::move(other.watched_)) {}

StreamTicket& StreamTicket::operator=(StreamTicket&& other) noexcept {
  if (this != &other) {
    Reset();
    owner_ = std::exchange(other.owner_, nullptr);
    principal_ = std::move(other.principal_);
    bytes_ = std::exchange(other.bytes_, 0);
    watched_ = std::move(other.watched_);
  }
  return *this;
}

StreamTicket::~StreamTicket() { Reset(); }

void StreamTicket::Reset() {
  if (owner_ == nullptr) return;
  {
    absl::MutexLock lock(&watched_->mu);
    watched_->alive = false;
    watched_->on_idle = nullptr;
  }
  owner_->Close(principal_, bytes_, watched_);
  owner_ = nullptr;
  bytes_ = 0;
  watched_.reset();
}

absl::Status StreamTicket::Reserve(int64_t bytes, const std::string& what) {
  if (owner_ == nullptr) return absl::FailedPreconditionError("stream ticket: not open");
  absl::Status status = owner_->ReserveBytes(principal_, bytes, what);
  if (status.ok()) bytes_ += bytes;
  return status;
}

void StreamTicket::Touch() {
  if (watched_ != nullptr) watched_->last_activity_ns = absl::GetCurrentTimeNanos();
}

void StreamTicket::StopWatching() {
  if (watched_ != nullptr) watched_->watching = false;
}

RequestAdmission::RequestAdmission(RequestLimits limits, std::function<int64_t()> host_available)
    : limits_(limits),
      host_available_(host_available ? std::move(host_available) : HostAvailableBytes) {
  watcher_ = std::thread([this] { WatchLoop(); });
}

RequestAdmission::~RequestAdmission() {
  stop_.Notify();
  watcher_.join();
}

absl::StatusOr<StreamTicket> RequestAdmission::Open(const std::string& principal,
                                                   const char* rpc,
                                                   std::function<void()> on_idle) {
  absl::MutexLock lock(&mu_);
  if (streams_ >= limits_.max_streams) {
    return absl::ResourceExhaustedError(absl::StrCat(
        rpc, ": ", streams_, " streams are open, the server's limit (--max_streams) is ",
        limits_.max_streams));
  }
  Usage& usage = usage_[principal];
  if (limits_.max_streams_per_principal > 0 &&
      usage.streams >= limits_.max_streams_per_principal) {
    if (usage.streams == 0 && usage.bytes == 0) usage_.erase(principal);
    return absl::ResourceExhaustedError(absl::StrCat(
        rpc, ": this principal has ", usage.streams,
        " streams open, the limit (--max_streams_per_principal) is ",
        limits_.max_streams_per_principal));
  }
  ++streams_;
  ++usage.streams;
  StreamTicket ticket;
  ticket.owner_ = this;
  ticket.principal_ = principal;
  ticket.watched_ = std::make_shared<StreamTicket::Watched>(std::move(on_idle));
  watched_.insert(ticket.watched_);
  return ticket;
}

MemoryHold::MemoryHold(MemoryHold&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      principal_(std::move(other.principal_)),
      bytes_(std::exchange(other.bytes_, 0)) {}

MemoryHold& MemoryHold::operator=(MemoryHold&& other) noexcept {
  if (this != &other) {
    if (owner_ != nullptr) owner_->ReleaseBytes(principal_, bytes_);
    owner_ = std::exchange(other.owner_, nullptr);
    principal_ = std::move(other.principal_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

MemoryHold::~MemoryHold() {
  if (owner_ != nullptr) owner_->ReleaseBytes(principal_, bytes_);
}

absl::StatusOr<MemoryHold> RequestAdmission::HoldMessage(const std::string& principal,
                                                         int64_t bytes, const char* rpc) {
  FLCE_RETURN_IF_ERROR(
      ReserveBytes(principal, bytes, absl::StrCat(rpc, " request"), /*check_host=*/false));
  MemoryHold hold;
  hold.owner_ = this;
  hold.principal_ = principal;
  hold.bytes_ = bytes;
  return hold;
}

void RequestAdmission::ReleaseBytes(const std::string& principal, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  bytes_ -= bytes;
  auto it = usage_.find(principal);
  if (it == usage_.end()) return;
  it->second.bytes -= bytes;
  if (it->second.streams == 0 && it->second.bytes == 0) usage_.erase(it);
}

absl::Status RequestAdmission::ReserveBytes(const std::string& principal, int64_t bytes,
                                            const std::string& what, bool check_host) {
  if (bytes <= 0) return absl::OkStatus();
  const int64_t available = check_host ? host_available_() : -1;
  absl::MutexLock lock(&mu_);
  if (bytes > limits_.memory_bytes - bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": needs ", bytes, " bytes; requests in flight hold ", bytes_,
        " of the server's request memory budget of ", limits_.memory_bytes,
        " (--request_memory_bytes)"));
  }
  Usage& usage = usage_[principal];
  if (limits_.memory_bytes_per_principal > 0 &&
      bytes > limits_.memory_bytes_per_principal - usage.bytes) {
    if (usage.streams == 0 && usage.bytes == 0) usage_.erase(principal);
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": needs ", bytes, " bytes; this principal's requests in flight hold ", usage.bytes,
        " of its budget of ", limits_.memory_bytes_per_principal,
        " (--request_memory_bytes_per_principal)"));
  }
  // Bytes reserved and not yet received are not in MemAvailable yet.
  absl::Status host = CheckHostMemory(bytes + bytes_, available, what);
  if (!host.ok()) {
    if (usage.streams == 0 && usage.bytes == 0) usage_.erase(principal);
    return host;
  }
  bytes_ += bytes;
  usage.bytes += bytes;
  return absl::OkStatus();
}

void RequestAdmission::Close(const std::string& principal, int64_t bytes,
                            const std::shared_ptr<StreamTicket::Watched>& watched) {
  absl::MutexLock lock(&mu_);
  --streams_;
  bytes_ -= bytes;
  auto it = usage_.find(principal);
  if (it != usage_.end()) {
    it->second.streams -= 1;
    it->second.bytes -= bytes;
    if (it->second.streams == 0 && it->second.bytes == 0) usage_.erase(it);
  }
  watched_.erase(watched);
}

int64_t RequestAdmission::open_streams() const {
  absl::MutexLock lock(&mu_);
  return streams_;
}

int64_t RequestAdmission::bytes_in_use() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

void RequestAdmission::WatchLoop() {
  const absl::Duration tick =
      std::max(absl::Milliseconds(10), std::min(absl::Seconds(1), limits_.idle_timeout / 4));
  while (!stop_.WaitForNotificationWithTimeout(tick)) {
    std::vector<std::shared_ptr<StreamTicket::Watched>> open;
    {
      absl::MutexLock lock(&mu_);
      open.assign(watched_.begin(), watched_.end());
    }
    const int64_t now = absl::GetCurrentTimeNanos();
    const int64_t timeout_ns = absl::ToInt64Nanoseconds(limits_.idle_timeout);
    for (const auto& w : open) {
      if (!w->watching || now - w->last_activity_ns.load() < timeout_ns) continue;
      absl::MutexLock lock(&w->mu);
      if (!w->alive || !w->watching.exchange(false) || !w->on_idle) continue;
      ++idle_timeouts_;
      w->on_idle();
    }
  }
}

}  // namespace flce
