#ifndef FLCE_SERVER_RPC_CALL_H_
#define FLCE_SERVER_RPC_CALL_H_

// What every RPC of the loss service shares, written once:
//
// - Requests arrive as raw bytes and are parsed here, so a request that does
//   not parse is INVALID_ARGUMENT (logged and counted) instead of gRPC's
//   bare UNIMPLEMENTED.
// - One access-log line and one count/latency sample per RPC, written when
//   the call is over (OnDone), with the code the client saw: an answer the
//   transport could not deliver (the client cancelled, the deadline passed,
//   the connection broke) is logged as CANCELLED / DEADLINE_EXCEEDED, not as
//   what the handler answered.
// - A hook that learns whether the answer reached the client, so results
//   (a consumed session, a taken gradient) are committed only once
//   delivered and put back otherwise.
// - Client-chosen text goes into the log only through LogSafe.

#include <cstdint>
#include <functional>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/codec.h"
#include "server/metrics.h"
#include "server/request_admission.h"

namespace flce {

// `text` made safe for one log line: printable ASCII is kept, every other
// byte (control characters, escapes, newlines, non-ASCII) becomes \xNN, and
// past `max` input bytes the rest is replaced by "…(+N bytes)".
std::string LogSafe(absl::string_view text, size_t max = 64);

// Runs `f` (returning absl::Status or absl::StatusOr); an allocation
// failure inside it becomes RESOURCE_EXHAUSTED instead of an exception
// escaping into gRPC.
template <typename F>
auto GuardMemory(F&& f, absl::string_view what) -> decltype(f()) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of host memory"));
  }
}

// Parses a protobuf message from a request's bytes. INVALID_ARGUMENT naming
// the message type when they do not parse.
absl::Status ParseMessage(const grpc::ByteBuffer& bytes, google::protobuf::Message* message);
absl::Status ParseMessage(absl::string_view bytes, google::protobuf::Message* message);

// Serializes a message for the wire.
// RESOURCE_EXHAUSTED (naming `what` and the sizes) when it is larger than
// `max_bytes`, which is then never sent.
absl::Status SerializeMessage(const google::protobuf::Message& message, int64_t max_bytes,
                              absl::string_view what, grpc::ByteBuffer* out);

// The access line and metrics of one RPC.
class CallRecord {
 public:
  CallRecord(ServiceMetrics* metrics, const char* rpc)
      : metrics_(metrics), rpc_(rpc), start_(absl::Now()), start_mono_ns_(MonotonicNanos()) {}

  const char* rpc() const { return rpc_; }
  absl::Time start() const { return start_; }
  // Text for the access line, as "key=value " pieces; client-chosen values
  // must have gone through LogSafe.
  void SetDetail(std::string detail) { detail_ = std::move(detail); }
  void PrependDetail(absl::string_view text) { detail_ = absl::StrCat(text, detail_); }
  const std::string& detail() const { return detail_; }
  // How the call came other than by gRPC ("channel": a call channel), for
  // the access line.
  void SetVia(const char* via) { via_ = via; }
  void AddBytes(int64_t received, int64_t sent) {
    received_ += received;
    sent_ += sent;
  }

  // What the handler finished the call with.
  void SetAnswer(const absl::Status& answered) { answered_ = answered; }

  // Marks that the call reached `stage` (a string literal) now. The marks
  // go out, with the call's start on the host's monotonic clock (which a
  // same-host client's clock shares: Python's time.monotonic), as one more
  // line at DEBUG level when the call is over ("rpc=Forward timeline
  // start_mono_us=… parsed=+12 …"): where a call's time went, without a
  // profiler. The first kMaxStamps marks are kept.
  void Stamp(const char* stage) {
    if (stamps_ < kMaxStamps) marks_[stamps_++] = {stage, MonotonicNanos()};
  }
  // `f(delivered)` runs when the call is over, before it is logged;
  // `delivered` is true iff the call answered OK and the client got it.
  void WhenOver(std::function<void(bool delivered)> f) { hooks_.push_back(std::move(f)); }

  // The call is over (the reactor's OnDone): runs the WhenOver hooks, then
  // writes the line and records the count, latency and bytes. When the call
  // did not complete for the client (`context->IsCancelled()`), the code is
  // DEADLINE_EXCEEDED if the deadline had passed, else CANCELLED, whatever
  // the handler answered. Returns the code recorded. Called once.
  absl::StatusCode Over(const grpc::CallbackServerContext* context);

 private:
  ServiceMetrics* const metrics_;
  const char* const rpc_;
  const absl::Time start_;
  std::string detail_;
  const char* via_ = nullptr;
  int64_t received_ = 0, sent_ = 0;
  absl::Status answered_ = absl::UnknownError("never answered");
  std::vector<std::function<void(bool)>> hooks_;
  static constexpr int kMaxStamps = 12;
  static int64_t MonotonicNanos();
  struct Mark {
    const char* stage;
    int64_t ns;
  };
  const int64_t start_mono_ns_;
  Mark marks_[kMaxStamps];
  int stamps_ = 0;
};

// When a gRPC call's deadline is (absl::InfiniteFuture() without one).
absl::Time DeadlineOf(const grpc::CallbackServerContext* context);

// What the code shared by a unary call, a stream and a call-channel call
// (server/call_channel.h) needs of its call.
class Call {
 public:
  virtual ~Call() = default;
  virtual CallRecord& record() = 0;
  // True once the client cancelled the call (or is gone).
  virtual bool IsCancelled() const = 0;
  // The client's deadline (absl::InfiniteFuture() without one).
  virtual absl::Time deadline() const = 0;
  // True for a call served on a thread of its own (a call channel's), where
  // its engine work may run instead of being handed to a worker.
  virtual bool HasOwnThread() const { return false; }
  // The call was accepted: what is left is the engine's work (a call
  // channel tells its client, which may go on before the answer).
  virtual void Started() {}
  // Finishes the call with `status` (the response, on OK, is sent).
  virtual void Reply(const absl::Status& status) = 0;
  // `f(delivered)` runs once the call is over, before it is logged;
  // `delivered` is true iff the call answered OK and the client got it.
  virtual void WhenOver(std::function<void(bool delivered)> f) = 0;
};

// A unary RPC on raw bytes: the request parsed here, the response
// serialized here (bounded by `max_message_bytes`), and the record closed
// when gRPC is done with the call. Deletes itself.
template <typename Request, typename Response>
class UnaryCall final : public grpc::ServerUnaryReactor, public Call {
 public:
  UnaryCall(grpc::CallbackServerContext* context, const grpc::ByteBuffer* in,
            grpc::ByteBuffer* out, ServiceMetrics* metrics, const char* rpc,
            int64_t max_message_bytes)
      : context_(context),
        in_(in),
        out_(out),
        max_message_bytes_(max_message_bytes),
        record_(metrics, rpc) {}

  // Takes the message's bytes from `admission`'s request memory for
  // `principal` (until the call is over) and parses the request; false
  // when either fails (the call is then finished with RESOURCE_EXHAUSTED or
  // INVALID_ARGUMENT).
  bool Parse(RequestAdmission& admission, const std::string& principal) {
    const int64_t bytes = static_cast<int64_t>(in_->Length());
    record_.AddBytes(bytes, 0);
    absl::Status status = GuardMemory(
        [&]() -> absl::Status {
          absl::StatusOr<MemoryHold> hold = admission.HoldMessage(principal, bytes, record_.rpc());
          if (!hold.ok()) return hold.status();
          hold_ = *std::move(hold);
          return ParseMessage(*in_, &request_);
        },
        record_.rpc());
    // gRPC keeps the bytes until the call is over; parsed, they are not needed.
    const_cast<grpc::ByteBuffer*>(in_)->Clear();
    if (!status.ok()) Reply(status);
    return status.ok();
  }

  const Request& request() const { return request_; }
  Response* response() { return &response_; }

  CallRecord& record() override { return record_; }
  grpc::CallbackServerContext* context() { return context_; }
  bool IsCancelled() const override { return context_->IsCancelled(); }
  absl::Time deadline() const override { return DeadlineOf(context_); }
  void WhenOver(std::function<void(bool)> f) override { record_.WhenOver(std::move(f)); }

  void Reply(const absl::Status& status) override {
    absl::Status answered = status;
    if (answered.ok()) {
      answered = GuardMemory(
          [&] {
            return SerializeMessage(response_, max_message_bytes_,
                                    absl::StrCat(record_.rpc(), " response"), out_);
          },
          record_.rpc());
      if (answered.ok()) record_.AddBytes(0, static_cast<int64_t>(out_->Length()));
      response_.Clear();  // the bytes are in out_ now
    }
    record_.SetAnswer(answered);
    Finish(ToGrpcStatus(answered));
  }

  void OnDone() override {
    record_.Over(context_);
    delete this;
  }

 private:
  grpc::CallbackServerContext* const context_;
  const grpc::ByteBuffer* const in_;
  grpc::ByteBuffer* const out_;
  const int64_t max_message_bytes_;
  CallRecord record_;
  MemoryHold hold_;
  Request request_;
  Response response_;
};

}  // namespace flce

#endif  // FLCE_SERVER_RPC_CALL_H_
