#ifndef FLCE_SERVER_STREAM_CALL_H_
#define FLCE_SERVER_STREAM_CALL_H_

// The two streaming call shapes of LossServiceImpl on raw bytes: a client
// stream (ForwardStream, PutWeight) with its slot among the open streams and
// its idle timeout, and a server stream (BackwardStream, TakeWeightGrad).
// Each writes its access line and metrics once, through its CallRecord,
// when gRPC is done with it.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "server/metrics.h"
#include "server/request_admission.h"
#include "server/rpc_call.h"

namespace flce {

// DEADLINE_EXCEEDED for a client stream that sent nothing for `timeout`.
inline absl::Status IdleError(const char* rpc, absl::Duration timeout) {
  return absl::DeadlineExceededError(absl::StrCat(rpc, ": no message for ",
                                                  absl::FormatDuration(timeout),
                                                  " (--stream_idle_timeout); nothing was kept"));
}

// A client stream on raw bytes, with its slot among the open streams (and
// the idle timeout) and its record: the common part of ForwardStream and
// PutWeight. Subclasses implement Take (one message) and End (the client
// half-closed); both run under mu_. Deletes itself.
class ReadStream : public grpc::ServerReadReactor<grpc::ByteBuffer>, public Call {
 public:
  ReadStream(grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
             ServiceMetrics* metrics, const char* rpc, int64_t max_message_bytes)
      : context_(context),
        response_bytes_(response),
        max_message_bytes_(max_message_bytes),
        record_(metrics, rpc) {}

  // Takes a slot and reads the first message, or refuses.
  void Begin(const absl::StatusOr<std::string>& principal, RequestAdmission* streams) {
    absl::MutexLock lock(&mu_);
    if (!principal.ok()) return FinishLocked(principal.status());
    principal_ = *principal;
    absl::StatusOr<StreamTicket> ticket = streams->Open(principal_, record_.rpc(), [this, streams] {
      absl::MutexLock idle_lock(&mu_);
      // Once the request went on to compute, only its answer finishes.
      if (!proceeding_) FinishLocked(IdleError(record_.rpc(), streams->limits().idle_timeout));
    });
    if (!ticket.ok()) return FinishLocked(ticket.status());
    ticket_ = *std::move(ticket);
    StartRead(&in_);
  }

  CallRecord& record() override { return record_; }
  grpc::CallbackServerContext* context() { return context_; }
  bool IsCancelled() const override { return context_->IsCancelled(); }
  absl::Time deadline() const override { return DeadlineOf(context_); }
  void WhenOver(std::function<void(bool)> f) override { record_.WhenOver(std::move(f)); }

  void OnReadDone(bool ok) override {
    if (!ok) return OnEnd();
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    ticket_.Touch();
    record_.AddBytes(static_cast<int64_t>(in_.Length()), 0);
    absl::Status status = GuardMemory([&] { return Consume(in_); }, record_.rpc());
    if (!status.ok()) return FinishLocked(status);
    StartRead(&in_);
  }

  void OnDone() override {
    record_.Over(context_);
    ticket_ = StreamTicket();  // before the call is gone: the idle watch lets go
    delete this;
  }

  // Serializes the response (on OK) and finishes.
  void Reply(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    FinishLocked(status);
  }

 protected:
  // One message arrived (its bytes, which it may take): by default parsed
  // into message() and given to Take().
  virtual absl::Status Consume(grpc::ByteBuffer& in) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    FLCE_RETURN_IF_ERROR(ParseMessage(in, message()));
    in.Clear();
    return Take();
  }
  // The message a read is parsed into, and the response sent on OK.
  virtual google::protobuf::Message* message() { return nullptr; }
  virtual const google::protobuf::Message& response() = 0;
  // One message arrived (parsed into message()).
  virtual absl::Status Take() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::InternalError("a stream without Take");
  }
  // The client half-closed: checks what arrived. OK finishes the call with
  // the response, unless Proceed() replies later.
  virtual absl::Status End() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  virtual bool RepliesLater() const { return false; }
  // Runs after an OK End() of a stream that RepliesLater(), without the
  // lock; it (or what it starts) calls Reply.
  virtual void Proceed() {}

  const std::string& principal() const { return principal_; }
  StreamTicket& ticket() { return ticket_; }

  absl::Mutex mu_;

 private:
  void OnEnd() {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      if (context_->IsCancelled()) {
        return FinishLocked(absl::CancelledError("cancelled by the client"));
      }
      ticket_.StopWatching();
      absl::Status status = GuardMemory([&] { return End(); }, record_.rpc());
      if (!status.ok() || !RepliesLater()) return FinishLocked(status);
      proceeding_ = true;
    }
    Proceed();
  }

  void FinishLocked(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    if (status.ok()) {
      status = GuardMemory(
          [&] {
            return SerializeMessage(response(), max_message_bytes_,
                                    absl::StrCat(record_.rpc(), " response"), response_bytes_);
          },
          record_.rpc());
      if (status.ok()) record_.AddBytes(0, static_cast<int64_t>(response_bytes_->Length()));
    }
    record_.SetAnswer(status);
    Finish(ToGrpcStatus(status));
  }

  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_bytes_;
  const int64_t max_message_bytes_;
  CallRecord record_;
  grpc::ByteBuffer in_;
  std::string principal_;
  StreamTicket ticket_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool proceeding_ ABSL_GUARDED_BY(mu_) = false;  // Proceed() runs: it replies
};

// A server stream on raw bytes: the messages, then the status; the record
// is closed when the call is over. Subclasses give the messages in turn.
// Deletes itself.
class WriteStream : public grpc::ServerWriteReactor<grpc::ByteBuffer>, public Call {
 public:
  WriteStream(grpc::CallbackServerContext* context, ServiceMetrics* metrics, const char* rpc,
              int64_t max_message_bytes)
      : context_(context), max_message_bytes_(max_message_bytes), record_(metrics, rpc) {}

  CallRecord& record() override { return record_; }
  grpc::CallbackServerContext* context() { return context_; }
  bool IsCancelled() const override { return context_->IsCancelled(); }
  absl::Time deadline() const override { return DeadlineOf(context_); }
  void WhenOver(std::function<void(bool)> f) override { record_.WhenOver(std::move(f)); }

  // Holds the request message's bytes in request memory and parses it.
  absl::Status ParseRequest(const grpc::ByteBuffer& in, RequestAdmission& admission,
                            const std::string& principal, google::protobuf::Message* request) {
    const int64_t bytes = static_cast<int64_t>(in.Length());
    record_.AddBytes(bytes, 0);
    return GuardMemory(
        [&]() -> absl::Status {
          FLCE_ASSIGN_OR_RETURN(hold_, admission.HoldMessage(principal, bytes, record_.rpc()));
          return ParseMessage(in, request);
        },
        record_.rpc());
  }

  // The start of a server stream: with the caller authenticated
  // (`principal`), its request parsed into `request` and `prepare(principal)`
  // done, writes the messages; otherwise finishes with the first error.
  void BeginWriting(const absl::StatusOr<std::string>& principal, const grpc::ByteBuffer& in,
                    RequestAdmission& admission, google::protobuf::Message* request,
                    const std::function<absl::Status(const std::string&)>& prepare) {
    absl::Status status = principal.status();
    if (status.ok()) status = ParseRequest(in, admission, *principal, request);
    if (status.ok()) status = GuardMemory([&] { return prepare(*principal); }, record_.rpc());
    if (status.ok()) {
      StartWriting();
    } else {
      Reply(status);
    }
  }

  // Finishes without (further) messages.
  void Reply(const absl::Status& status) override {
    record_.SetAnswer(status);
    Finish(ToGrpcStatus(status));
  }

  // Writes the messages Next() gives, then finishes OK.
  void StartWriting() { WriteNext(); }

  void OnWriteDone(bool ok) override {
    if (!ok) return Reply(absl::CancelledError("the stream broke"));
    WriteNext();
  }

  void OnDone() override {
    record_.Over(context_);
    delete this;
  }

 protected:
  // The next message, or null after the last.
  virtual const google::protobuf::Message* Next() { return nullptr; }
  // The next message's bytes into `out` (true), or none left (false): by
  // default Next() serialized.
  virtual absl::StatusOr<bool> NextBytes(grpc::ByteBuffer* out) {
    const google::protobuf::Message* message = Next();
    if (message == nullptr) return false;
    FLCE_RETURN_IF_ERROR(SerializeMessage(*message, max_message_bytes_,
                                          absl::StrCat(record_.rpc(), " message"), out));
    return true;
  }

 private:
  void WriteNext() {
    absl::Status status = GuardMemory(
        [&]() -> absl::Status {
          out_.Clear();
          FLCE_ASSIGN_OR_RETURN(const bool more, NextBytes(&out_));
          if (!more) return absl::OkStatus();
          record_.AddBytes(0, static_cast<int64_t>(out_.Length()));
          writing_ = true;
          return absl::OkStatus();
        },
        record_.rpc());
    if (writing_ && status.ok()) {
      writing_ = false;
      StartWrite(&out_);
      return;
    }
    Reply(status);
  }

  grpc::CallbackServerContext* const context_;
  const int64_t max_message_bytes_;
  CallRecord record_;
  MemoryHold hold_;
  grpc::ByteBuffer out_;
  bool writing_ = false;
};

}  // namespace flce

#endif  // FLCE_SERVER_STREAM_CALL_H_
