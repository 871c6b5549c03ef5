#include "server/call_channel.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "proto/call_channel_layout.h"
#include "server/random_id.h"
#include "spdlog/spdlog.h"

namespace flce {

namespace cc = call_channel;

namespace {

void FutexWait(uint32_t* word, uint32_t expected, absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(timeout);
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWake(uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A channel's thread sleeps before its polling window only when the window
// opens at least this much later (see CallChannel::Loop).
constexpr absl::Duration kShortestSleep = absl::Milliseconds(1);

// The longest deadline a request may ask for (longer is none).
constexpr uint64_t kMaxTimeoutUs = uint64_t{365} * 24 * 3600 * 1000000;

}  // namespace

// One channel: its region, its thread and the call it serves.
class CallChannel {
 public:
  CallChannel(std::string id, std::string principal, std::shared_ptr<SharedRegion> region,
              int64_t request_bytes, int64_t response_bytes, const CallChannelLimits& limits,
              CallChannelService* service, RequestAdmission* admission, ServiceMetrics* metrics)
      : id_(std::move(id)),
        principal_(std::move(principal)),
        region_(std::move(region)),
        base_(region_->base()),
        request_bytes_(request_bytes),
        response_bytes_(response_bytes),
        limits_(limits),
        service_(service),
        admission_(admission),
        metrics_(metrics),
        seen_(Load(cc::kRequestSeqOffset)) {
    // A number stored before the channel was opened is not a call.
  }

  ~CallChannel() { Join(); }

  void Start() {
    thread_ = std::thread([this] { Loop(); });
  }

  // Closes the channel once the call in flight (if any) is answered; calls
  // still running after `cancel_after` are cancelled.
  void Stop(absl::Time cancel_after = absl::InfiniteFuture()) {
    const int64_t ns = cancel_after == absl::InfiniteFuture() ? INT64_MAX
                                                              : absl::ToUnixNanos(cancel_after);
    int64_t now = cancel_after_ns_.load();
    while (ns < now && !cancel_after_ns_.compare_exchange_weak(now, ns)) {
    }
    stop_.store(true);
    FutexWake(Word(cc::kRequestSeqOffset));
  }

  void Join() {
    if (thread_.joinable()) thread_.join();
  }

  bool ended() const { return ended_.load(std::memory_order_acquire); }
  const std::string& principal() const { return principal_; }

  // What a call of the channel asks of it.
  bool Cancelled(uint32_t seq) const {
    return Load(cc::kCancelSeqOffset) == seq ||
           absl::ToUnixNanos(absl::Now()) > cancel_after_ns_.load();
  }

  // Writes the answer of call `seq` and tells the client. `response` (on
  // OK) must fit the response area, else the answer is RESOURCE_EXHAUSTED.
  // Returns what was answered (FAILED_PRECONDITION when the region broke
  // under it: nobody got the answer).
  absl::Status Answer(uint32_t seq, absl::Status status, const google::protobuf::Message* response,
                      int64_t* sent) {
    char* area = base_ + cc::kHeaderBytes + request_bytes_;
    uint32_t length = 0;
    if (status.ok() && response != nullptr) {
      const size_t size = response->ByteSizeLong();
      if (static_cast<int64_t>(size) > response_bytes_) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "response: ", size, " bytes, over the call channel's response area of ",
            response_bytes_, " (OpenCallChannel.response_bytes); use a larger one or gRPC"));
      } else {
        response->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(area));
        length = static_cast<uint32_t>(size);
      }
    }
    if (!status.ok()) {
      const absl::string_view message = status.message();
      length = static_cast<uint32_t>(std::min<size_t>(message.size(), response_bytes_));
      std::memcpy(area, message.data(), length);
    }
    Store(cc::kResponseCodeOffset, static_cast<uint32_t>(status.code()));
    Store(cc::kResponseLengthOffset, length);
    Store(cc::kResponseSeqOffset, seq);
    Store(cc::kFenceSeqOffset, seq);  // the client's GPU may go on
    WakeClient();
    *sent = length;
    if (region_->broken()) {
      return absl::FailedPreconditionError(
          "call channel: its region was shrunk by its owner; the answer was lost");
    }
    return status;
  }

  // The server lives (kHeartbeat).
  void Beat() { __atomic_add_fetch(Word(cc::kHeartbeatOffset), 1, __ATOMIC_RELEASE); }

  // Call `seq` was accepted: only the engine can fail it now.
  void Accepted(uint32_t seq) {
    Store(cc::kAcceptedSeqOffset, seq);
    WakeClient();
  }

  // The call taken last has been answered.
  void CallDone() {
    absl::MutexLock lock(&mu_);
    last_active_ns_.store(absl::ToUnixNanos(absl::Now()));
    in_flight_.store(false);
  }

 private:
  class ChannelCall;
  template <typename Request, typename Response>
  class TypedCall;

  uint32_t* Word(int64_t offset) const { return reinterpret_cast<uint32_t*>(base_ + offset); }
  // A client asleep waits on the answer's word or the acceptance's.
  void WakeClient() {
    if (Load(cc::kClientWaitingOffset) == 0) return;
    FutexWake(Word(cc::kResponseSeqOffset));
    FutexWake(Word(cc::kAcceptedSeqOffset));
  }
  uint32_t Load(int64_t offset) const { return __atomic_load_n(Word(offset), __ATOMIC_ACQUIRE); }
  void Store(int64_t offset, uint32_t value) {
    __atomic_store_n(Word(offset), value, __ATOMIC_SEQ_CST);
  }

  void Loop();
  // Serves the call `seq` the client stored (`method`, its kRequestMethod
  // read once); it is answered (now, or by the worker it was queued to)
  // exactly once.
  void Take(uint32_t seq, uint32_t method);

  const std::string id_;
  const std::string principal_;
  const std::shared_ptr<SharedRegion> region_;
  char* const base_;
  const int64_t request_bytes_, response_bytes_;
  const CallChannelLimits limits_;
  CallChannelService* const service_;
  RequestAdmission* const admission_;
  ServiceMetrics* const metrics_;
  uint32_t seen_;  // the last number taken (the loop's thread only)
  std::thread thread_;
  std::atomic<bool> ended_{false};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> cancel_after_ns_{INT64_MAX};
  std::atomic<int64_t> last_active_ns_{absl::ToUnixNanos(absl::Now())};
  // A call taken and not answered yet; set false under mu_ (the loop waits
  // on it there while a worker serves the call).
  std::atomic<bool> in_flight_{false};
  absl::Mutex mu_;
};

// A call made on a channel: answered through it, logged and counted like an
// RPC of the same name (marked via=channel). Deletes itself when answered.
class CallChannel::ChannelCall : public Call {
 public:
  ChannelCall(CallChannel* channel, uint32_t seq, absl::Time deadline, const char* rpc)
      : channel_(channel), seq_(seq), deadline_(deadline), record_(channel->metrics_, rpc) {
    record_.SetVia("channel");
  }

  CallRecord& record() override { return record_; }
  bool IsCancelled() const override { return channel_->Cancelled(seq_); }
  absl::Time deadline() const override { return deadline_; }
  bool HasOwnThread() const override { return true; }
  void Started() override { channel_->Accepted(seq_); }
  void WhenOver(std::function<void(bool)> f) override { record_.WhenOver(std::move(f)); }

  void Reply(const absl::Status& status) override {
    int64_t sent = 0;
    const absl::Status answered = GuardMemory(
        [&] { return channel_->Answer(seq_, status, status.ok() ? response() : nullptr, &sent); },
        record_.rpc());
    record_.Stamp("answered");
    record_.AddBytes(0, sent);
    record_.SetAnswer(answered);
    record_.Over(nullptr);  // delivered: answered OK into the region
    CallChannel* channel = channel_;
    delete this;
    channel->CallDone();
  }

  // Holds the request's bytes in request memory and parses them; false
  // (answered) when either fails.
  bool Parse(absl::string_view bytes) {
    record_.AddBytes(static_cast<int64_t>(bytes.size()), 0);
    absl::Status status = GuardMemory(
        [&]() -> absl::Status {
          absl::StatusOr<MemoryHold> hold = channel_->admission_->HoldMessage(
              channel_->principal_, static_cast<int64_t>(bytes.size()), record_.rpc());
          if (!hold.ok()) return hold.status();
          hold_ = *std::move(hold);
          return request() == nullptr ? absl::OkStatus() : ParseMessage(bytes, request());
        },
        record_.rpc());
    if (!status.ok()) Reply(status);
    return status.ok();
  }

  virtual void Serve() {}

 protected:
  virtual google::protobuf::Message* request() { return nullptr; }
  virtual const google::protobuf::Message* response() { return nullptr; }

  CallChannel* const channel_;
  const uint32_t seq_;

 private:
  const absl::Time deadline_;
  CallRecord record_;
  MemoryHold hold_;
};

template <typename Request, typename Response>
class CallChannel::TypedCall final : public CallChannel::ChannelCall {
 public:
  using Serve_ = void (CallChannelService::*)(Call*, const std::string&, const Request*,
                                              Response*);
  TypedCall(CallChannel* channel, uint32_t seq, absl::Time deadline, const char* rpc,
            Serve_ serve)
      : ChannelCall(channel, seq, deadline, rpc), serve_(serve) {}

  void Serve() override {
    (channel_->service_->*serve_)(this, channel_->principal_, &request_, &response_);
  }

 private:
  google::protobuf::Message* request() override { return &request_; }
  const google::protobuf::Message* response() override { return &response_; }

  const Serve_ serve_;
  Request request_;
  Response response_;
};

void CallChannel::Take(uint32_t seq, uint32_t method) {
  const uint32_t length = Load(cc::kRequestLengthOffset);
  const uint64_t timeout_us =
      __atomic_load_n(reinterpret_cast<uint64_t*>(base_ + cc::kRequestTimeoutUsOffset),
                      __ATOMIC_ACQUIRE);
  const absl::Time deadline = timeout_us == 0 || timeout_us > kMaxTimeoutUs
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + absl::Microseconds(timeout_us);
  in_flight_.store(true);
  ChannelCall* call = nullptr;
  switch (method) {
    case cc::kForward:
      call = new TypedCall<v1::ForwardRequest, v1::ForwardResponse>(
          this, seq, deadline, "Forward", &CallChannelService::ChannelForward);
      break;
    case cc::kBackward:
      call = new TypedCall<v1::BackwardRequest, v1::BackwardResponse>(
          this, seq, deadline, "Backward", &CallChannelService::ChannelBackward);
      break;
    case cc::kReleaseSession:
      call = new TypedCall<v1::ReleaseSessionRequest, v1::ReleaseSessionResponse>(
          this, seq, deadline, "ReleaseSession", &CallChannelService::ChannelReleaseSession);
      break;
    default:
      call = new ChannelCall(this, seq, deadline, "CallChannel");
      call->Reply(absl::InvalidArgumentError(
          absl::StrCat("call channel: request method ", method,
                       "; 1 (Forward), 2 (Backward) or 3 (ReleaseSession)")));
      return;
  }
  if (length > request_bytes_) {
    call->Reply(absl::InvalidArgumentError(
        absl::StrCat("call channel: request length ", length, " bytes, over the request area of ",
                     request_bytes_, " (OpenCallChannel.request_bytes)")));
    return;
  }
  // Copied out before it is read: the client may write the region at any
  // time.
  std::string bytes;
  const absl::Status copied = GuardMemory(
      [&] {
        bytes.assign(base_ + cc::kHeaderBytes, length);
        return absl::OkStatus();
      },
      "call channel");
  if (!copied.ok()) {
    call->Reply(copied);
    return;
  }
  if (region_->broken()) {
    call->Reply(absl::FailedPreconditionError(
        "call channel: its region was shrunk by its owner; the channel is closed"));
    return;
  }
  if (call->Parse(bytes)) {
    call->record().Stamp("parsed");
    call->Serve();
  }
}

void CallGaps::Observe(uint32_t method, absl::Duration gap) {
  const int slot = Slot(method);
  if (seen_[slot]) {
    deviations_[slot] = (deviations_[slot] + absl::AbsDuration(gap - gaps_[slot])) / 2;
    gaps_[slot] = (gaps_[slot] + gap) / 2;
  } else {
    gaps_[slot] = gap;
  }
  seen_[slot] = true;
}

absl::Duration CallGaps::Expected(uint32_t method) const {
  const int slot = Slot(method);
  return std::max(absl::ZeroDuration(), gaps_[slot] - 2 * deviations_[slot]);
}

void CallChannel::Loop() {
  // The next call is expected one gap after the last answer (CallGaps, by
  // the method answered): the thread sleeps until shortly before then,
  // polls from then for `spin`, and sleeps again until the client wakes it.
  // A call that comes on time meets a polling thread; one that comes early
  // or late costs a wake-up.
  int64_t polls = 0;
  CallGaps gaps;
  uint32_t method = 0;  // of the call answered last (0 before the first: its own slot)
  absl::Time answered = absl::Now();
  absl::Time poll_from = answered, poll_until = answered + limits_.spin;
  for (;;) {
    if (stop_.load()) break;
    const uint32_t seq = Load(cc::kRequestSeqOffset);
    if (seq != seen_) {
      gaps.Observe(method, absl::Now() - answered);
      seen_ = seq;
      method = Load(cc::kRequestMethodOffset);
      Take(seq, method);
      if (in_flight_.load()) {
        // Queued to a worker: its answer comes before the next call.
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](CallChannel* c) { return !c->in_flight_.load(); }, this));
      }
      answered = absl::Now();
      const absl::Duration gap = gaps.Expected(method);
      poll_from = answered + gap - (absl::Microseconds(500) + gap / 16);
      poll_until = std::max(poll_from, answered) + limits_.spin;
      continue;
    }
    if (region_->broken()) break;
    // The clock is read once every 64 polls.
    if ((++polls & 63) != 0) {
      CpuRelax();
      continue;
    }
    const absl::Time now = absl::Now();
    if (now - absl::FromUnixNanos(last_active_ns_.load()) > limits_.idle_timeout) {
      SPDLOG_INFO("call channel {} closed: no call for {}", id_.substr(0, 8),
                  absl::FormatDuration(limits_.idle_timeout));
      break;
    }
    // A window that opens within a millisecond is polled for from now: a
    // sleep that short saves next to nothing, and a timed sleep on a busy
    // (virtual) CPU can end well after the call came.
    if (now < poll_until && poll_from - now < kShortestSleep) {
      if ((polls & 4095) == 0) sched_yield();  // room for others on a busy host
      continue;
    }
    // Before the polling window: until it opens; after it: until woken
    // (in slices, to see the idle timeout and a stop).
    const absl::Duration sleep =
        std::min(now < poll_from ? poll_from - now : absl::InfiniteDuration(),
                 absl::Milliseconds(100));
    Store(cc::kServerWaitingOffset, 1);
    if (Load(cc::kRequestSeqOffset) == seen_ && !stop_.load()) {
      FutexWait(Word(cc::kRequestSeqOffset), seen_, sleep);
    }
    Store(cc::kServerWaitingOffset, 0);
  }
  // Nothing is taken from here on; a client waiting learns it.
  Store(cc::kClosedOffset, 1);
  FutexWake(Word(cc::kResponseSeqOffset));
  ended_.store(true, std::memory_order_release);
}

// --- CallChannels ------------------------------------------------------------

CallChannels::CallChannels(CallChannelLimits limits, int64_t max_message_bytes,
                           CallChannelService* service, RequestAdmission* admission,
                           ServiceMetrics* metrics)
    : limits_(limits),
      max_message_bytes_(max_message_bytes),
      service_(service),
      admission_(admission),
      metrics_(metrics),
      heart_([this] { Heartbeat(); }) {}

CallChannels::~CallChannels() {
  Shutdown(absl::Now());
  stop_heart_.Notify();
  heart_.join();
}

void CallChannels::Heartbeat() {
  while (!stop_heart_.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, channel] : channels_) channel->Beat();
    for (const auto& channel : closing_) channel->Beat();
  }
}

absl::StatusOr<std::string> CallChannels::Open(std::shared_ptr<SharedRegion> region,
                                               int64_t request_bytes, int64_t response_bytes,
                                               const std::string& principal) {
  if (region->space() != MemorySpace::kHost || region->event() != nullptr) {
    return absl::InvalidArgumentError(
        "region_id: a call channel needs a POSIX shared-memory region (shm_name), not CUDA "
        "memory or an event");
  }
  for (const auto& [field, bytes] :
       {std::pair<const char*, int64_t>{"request_bytes", request_bytes},
        std::pair<const char*, int64_t>{"response_bytes", response_bytes}}) {
    if (bytes < cc::kMinAreaBytes || bytes > max_message_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", bytes, "; between ", cc::kMinAreaBytes, " and the message limit of ",
          max_message_bytes_, " (--max_message_bytes)"));
    }
  }
  if (cc::kHeaderBytes + request_bytes + response_bytes > region->bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request_bytes, response_bytes: ", cc::kHeaderBytes, " + ", request_bytes, " + ",
        response_bytes, " bytes do not fit the region's ", region->bytes()));
  }
  FLCE_RETURN_IF_ERROR(region->CheckUsable("region_id"));
  uint64_t magic = 0;
  std::memcpy(&magic, region->base() + cc::kMagicOffset, sizeof(magic));
  if (magic != cc::kMagic || region->broken()) {
    return absl::InvalidArgumentError(
        "region_id: the region does not start with the call channel's magic (\"FLCECH01\"; "
        "proto/call_channel_layout.h)");
  }
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("server is shutting down");
  Reap();
  const int64_t open = static_cast<int64_t>(channels_.size() + closing_.size());
  if (open >= limits_.max_channels) {
    return absl::ResourceExhaustedError(absl::StrCat("call channels: ", open, " open of at most ",
                                                     limits_.max_channels,
                                                     " (--max_call_channels)"));
  }
  if (limits_.max_channels_per_principal > 0) {
    int64_t mine = 0;
    for (const auto& [id, channel] : channels_) mine += channel->principal() == principal;
    for (const auto& channel : closing_) mine += channel->principal() == principal;
    if (mine >= limits_.max_channels_per_principal) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "call channels: ", mine, " of this principal's open, of at most ",
          limits_.max_channels_per_principal, " (--max_call_channels_per_principal)"));
    }
  }
  std::string id = RandomId();
  auto channel = std::make_shared<CallChannel>(id, principal, std::move(region), request_bytes,
                                               response_bytes, limits_, service_, admission_,
                                               metrics_);
  channel->Start();
  channels_[id] = std::move(channel);
  return id;
}

bool CallChannels::Close(const std::string& id, const std::string& principal) {
  absl::MutexLock lock(&mu_);
  Reap();
  auto it = channels_.find(id);
  if (it == channels_.end() || it->second->principal() != principal) return false;
  it->second->Stop();
  closing_.push_back(std::move(it->second));
  channels_.erase(it);
  return true;
}

void CallChannels::Reap() const {
  for (auto it = channels_.begin(); it != channels_.end();) {
    auto next = std::next(it);
    if (it->second->ended()) channels_.erase(it);  // joined by its destructor: at once
    it = next;
  }
  closing_.erase(std::remove_if(closing_.begin(), closing_.end(),
                                [](const std::shared_ptr<CallChannel>& c) { return c->ended(); }),
                 closing_.end());
}

void CallChannels::StopAll(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
  for (auto& [id, channel] : channels_) {
    channel->Stop(deadline);
    closing_.push_back(std::move(channel));
  }
  channels_.clear();
  for (auto& channel : closing_) channel->Stop(deadline);
}

void CallChannels::Shutdown(absl::Time deadline) {
  StopAll(deadline);
  std::vector<std::shared_ptr<CallChannel>> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(closing_);
  }
  for (const auto& channel : all) channel->Join();
}

int64_t CallChannels::size() const {
  absl::MutexLock lock(&mu_);
  Reap();
  return static_cast<int64_t>(channels_.size() + closing_.size());
}

}  // namespace flce
