#include "server/loss_service.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/status_macros.h"
#include "proto/codec.h"
#include "proto/crc32c.h"
#include "common/version.h"
#include "spdlog/spdlog.h"

namespace flce {
namespace {

bool DeadlinePassed(const grpc::CallbackServerContext* context) {
  return std::chrono::system_clock::now() > context->deadline();
}

CancelFn CancelFor(const grpc::CallbackServerContext* context) {
  return [context] { return context->IsCancelled() || DeadlinePassed(context); };
}

// CANCELLED / DEADLINE_EXCEEDED if the caller is gone, else OK.
absl::Status CheckAlive(const grpc::CallbackServerContext* context, const char* where) {
  if (DeadlinePassed(context)) {
    return absl::DeadlineExceededError(absl::StrCat("deadline exceeded ", where));
  }
  if (context->IsCancelled()) {
    return absl::CancelledError(absl::StrCat("cancelled by the client ", where));
  }
  return absl::OkStatus();
}

// A gradient into the response: its bytes, or (written to the caller's
// shared memory already) its dtype and shape with the slice.
void EncodeGradient(HostTensor&& t, bool in_shm, const v1::SharedMemorySlice& slice,
                    v1::Tensor* out) {
  if (!in_shm) {
    MoveToProto(std::move(t), out);
    return;
  }
  out->set_dtype(ToProto(t.dtype));
  out->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  *out->mutable_shm() = slice;
}

double MillisSince(absl::Time start) {
  return absl::ToDoubleMilliseconds(absl::Now() - start);
}

std::string ProblemDetail(const LossProblem& p) {
  return absl::StrCat("n=", p.rows(), " h=", p.hidden_size(), " v=", p.vocab(),
                      " dtype=", DTypeName(p.hidden.dtype), " ");
}

std::string SessionDetail(const std::string& id) {
  return id.empty() ? "" : absl::StrCat("session=", LogSafe(id, 8), " ");
}

// Bytes a Forward response takes beyond its framing: the per-row tensors.
int64_t ForwardResponseBytes(const ForwardCall& call) {
  const int64_t rows = call.problem.rows();
  int64_t tensors = static_cast<int64_t>(call.want_lse) + call.want_per_row_loss;
  if (call.problem.options.reduction == Reduction::kNone) tensors += 2;  // loss, z_loss
  return tensors * rows * 4;
}

}  // namespace

int64_t ServiceLimits::stream_chunk_bytes() const {
  // Room for a chunk's header (a WeightInfo, a BackwardResponse's shapes).
  return std::max<int64_t>(4096, std::min<int64_t>(int64_t{4} << 20,
                                                   max_message_bytes - (int64_t{16} << 10)));
}

LossServiceImpl::LossServiceImpl(LossCore* core, WorkQueue* queue, ServiceLimits limits,
                                 RequestAdmission* admission, SharedMemoryRegistry* shared_memory,
                                 const Authenticator* auth, ServiceMetrics* metrics,
                                 std::function<Gauges()> gauges,
                                 std::function<void()> on_engine_unhealthy)
    : core_(core),
      queue_(queue),
      limits_(limits),
      admission_(admission),
      shared_memory_(shared_memory),
      auth_(auth),
      metrics_(metrics),
      gauges_(std::move(gauges)),
      on_engine_unhealthy_(std::move(on_engine_unhealthy)) {}

template <typename Request, typename Response>
UnaryCall<Request, Response>* LossServiceImpl::NewUnary(Context* context, const Bytes* in,
                                                        Bytes* out, const char* rpc) {
  return new UnaryCall<Request, Response>(context, in, out, metrics_, rpc,
                                          limits_.max_message_bytes);
}

template <typename Request, typename Response>
std::optional<std::string> LossServiceImpl::Accept(UnaryCall<Request, Response>* call,
                                                   bool new_work) {
  absl::StatusOr<std::string> principal =
      new_work ? Admit(call->context()) : Authenticate(call->context());
  if (!principal.ok()) {
    call->Reply(principal.status());
    return std::nullopt;
  }
  if (!call->Parse(*admission_, *principal)) return std::nullopt;
  return *std::move(principal);
}

absl::StatusOr<std::string> LossServiceImpl::Authenticate(const Context* context) const {
  if (auth_ == nullptr) return std::string();
  return auth_->Authenticate(*context);
}

absl::StatusOr<std::string> LossServiceImpl::Admit(const Context* context) const {
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (principal.ok() && draining_) {
    return absl::UnavailableError(
        "server is draining for shutdown: send new work to another replica (sessions already "
        "here are still served)");
  }
  return principal;
}

std::shared_ptr<SliceResolver> LossServiceImpl::ResolverFor(const std::string& principal) const {
  return shared_memory_ ? shared_memory_->ResolverFor(principal) : nullptr;
}

absl::Status LossServiceImpl::Explain(absl::Status status, const Context* context) {
  // The engine stops with CANCELLED when the cancel hook fires; say which.
  if (status.code() == absl::StatusCode::kCancelled && DeadlinePassed(context)) {
    return absl::DeadlineExceededError("deadline exceeded while computing");
  }
  if (status.code() == absl::StatusCode::kInternal) {
    SPDLOG_ERROR("internal error: {}", std::string(status.message()));
  }
  if (!core_->engine().health().ok() && on_engine_unhealthy_) {
    std::call_once(unhealthy_once_, on_engine_unhealthy_);
  }
  return status;
}

void LossServiceImpl::Run(Call* call, std::function<absl::Status(absl::Time)> work,
                          std::function<void(const absl::Status&)> done) {
  const absl::Time queued = absl::Now();
  Context* context = call->context();
  const char* rpc = call->record().rpc();
  absl::Status submitted = queue_->Submit([=]() {
    absl::Status status = CheckAlive(context, "while queued");
    if (status.ok()) status = GuardMemory([&] { return work(queued); }, rpc);
    done(status);
  });
  if (!submitted.ok()) done(submitted);
}

// --- Forward ---------------------------------------------------------------

absl::Status LossServiceImpl::ComputeForward(Call* call, const std::string& principal,
                                             const ForwardCall& forward,
                                             v1::ForwardResponse* response, absl::Time queued) {
  Context* context = call->context();
  const absl::Time engine_start = absl::Now();
  absl::StatusOr<ForwardOutcome> outcome = core_->Forward(forward, principal, CancelFor(context));
  metrics_->RecordQueueWait(absl::ToDoubleSeconds(engine_start - queued));
  metrics_->RecordEngine(call->record().rpc(), absl::ToDoubleSeconds(absl::Now() - engine_start),
                         outcome.ok() ? forward.problem.rows() : 0);
  if (!outcome.ok()) return Explain(outcome.status(), context);
  // The session lives only if the client learns its id.
  if (!outcome->session_id.empty()) {
    call->WhenOver([this, id = outcome->session_id, principal](bool delivered) {
      if (!delivered) core_->Release(id, principal);
    });
  }
  FLCE_RETURN_IF_ERROR(CheckAlive(context, "while computing"));
  ForwardResult& r = outcome->result;
  MoveToProto(std::move(r.loss), response->mutable_loss());
  MoveToProto(std::move(r.z_loss), response->mutable_z_loss());
  if (r.lse) MoveToProto(std::move(*r.lse), response->mutable_lse());
  if (r.per_row_loss) MoveToProto(std::move(*r.per_row_loss), response->mutable_per_row_loss());
  response->set_num_valid(r.num_valid);
  response->set_num_correct(r.num_correct);
  response->set_session_id(outcome->session_id);
  response->set_backward_mode(ToProto(outcome->mode));
  response->mutable_stats()->set_queue_ms(absl::ToDoubleMilliseconds(engine_start - queued));
  response->mutable_stats()->set_engine_ms(MillisSince(engine_start));
  call->record().PrependDetail(SessionDetail(outcome->session_id));
  return absl::OkStatus();
}

void LossServiceImpl::StartForward(Call* call, const std::string& principal,
                                   const v1::ForwardRequest* request,
                                   v1::ForwardResponse* response) {
  absl::StatusOr<ForwardCall> decoded = GuardMemory(
      [&]() -> absl::StatusOr<ForwardCall> {
        return DecodeForward(*request, core_->weights(), principal, ResolverFor(principal));
      },
      call->record().rpc());
  if (!decoded.ok()) {
    call->Reply(decoded.status());
    return;
  }
  call->record().SetDetail(ProblemDetail(decoded->problem));
  // Refused before any compute rather than computed and then undeliverable.
  const int64_t response_bytes = ForwardResponseBytes(*decoded);
  if (response_bytes > limits_.max_message_bytes - 4096) {
    call->Reply(absl::ResourceExhaustedError(absl::StrCat(
        "Forward: the response's per-row outputs take ", response_bytes,
        " bytes, over the server's message limit of ", limits_.max_message_bytes,
        " (--max_message_bytes); ask for fewer outputs or split the batch")));
    return;
  }
  auto forward = std::make_shared<ForwardCall>(*std::move(decoded));
  Run(
      call,
      [=](absl::Time queued) {
        return ComputeForward(call, principal, *forward, response, queued);
      },
      [call](const absl::Status& status) { call->Reply(status); });
}

LossServiceImpl::Unary* LossServiceImpl::Forward(Context* context, const Bytes* in, Bytes* out) {
  auto* call = NewUnary<v1::ForwardRequest, v1::ForwardResponse>(context, in, out, "Forward");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/true)) {
    StartForward(call, *principal, &call->request(), call->response());
  }
  return call;
}

// --- Backward --------------------------------------------------------------

void LossServiceImpl::StartBackward(Call* call, const std::string& principal,
                                    const v1::BackwardRequest* request,
                                    int64_t max_response_bytes,
                                    std::shared_ptr<BackwardOutcome> outcome,
                                    std::shared_ptr<CallStats> stats,
                                    std::function<void(const absl::Status&)> done) {
  absl::StatusOr<BackwardCall> decoded = GuardMemory(
      [&]() -> absl::StatusOr<BackwardCall> {
        return DecodeBackward(*request, ResolverFor(principal));
      },
      call->record().rpc());
  if (!decoded.ok()) {
    done(decoded.status());
    return;
  }
  decoded->max_response_bytes = max_response_bytes;
  call->record().SetDetail(SessionDetail(decoded->session_id));
  // The session is consumed only once the gradients reached the client.
  call->WhenOver([this, outcome](bool delivered) { core_->Settle(*outcome, delivered); });
  auto backward = std::make_shared<BackwardCall>(*std::move(decoded));
  Run(
      call,
      [=](absl::Time queued) -> absl::Status {
        Context* context = call->context();
        const absl::Time engine_start = absl::Now();
        absl::StatusOr<BackwardOutcome> grads =
            core_->Backward(*backward, principal, CancelFor(context));
        metrics_->RecordQueueWait(absl::ToDoubleSeconds(engine_start - queued));
        metrics_->RecordEngine(
            call->record().rpc(), absl::ToDoubleSeconds(absl::Now() - engine_start),
            grads.ok() && !grads->grad_hidden.shape.empty() ? grads->grad_hidden.shape[0] : 0);
        if (!grads.ok()) return Explain(grads.status(), context);
        *outcome = *std::move(grads);
        stats->queue_ms = absl::ToDoubleMilliseconds(engine_start - queued);
        stats->engine_ms = MillisSince(engine_start);
        return absl::OkStatus();
      },
      std::move(done));
}

LossServiceImpl::Unary* LossServiceImpl::Backward(Context* context, const Bytes* in, Bytes* out) {
  auto* call = NewUnary<v1::BackwardRequest, v1::BackwardResponse>(context, in, out, "Backward");
  std::optional<std::string> principal = Accept(call, /*new_work=*/false);
  if (!principal) return call;
  auto outcome = std::make_shared<BackwardOutcome>();
  auto stats = std::make_shared<CallStats>();
  StartBackward(call, *principal, &call->request(), limits_.max_message_bytes, outcome, stats,
                [this, call, outcome, stats](const absl::Status& status) {
                  if (status.ok()) {
                    core_->Answered(*outcome);
                    const v1::BackwardRequest& request = call->request();
                    v1::BackwardResponse* response = call->response();
                    BackwardOutcome& o = *outcome;
                    EncodeGradient(std::move(o.grad_hidden), o.grad_hidden_in_shm,
                                   request.grad_hidden_out(), response->mutable_grad_hidden());
                    if (o.grad_weight) {
                      EncodeGradient(std::move(*o.grad_weight), o.grad_weight_in_shm,
                                     request.grad_weight_out(), response->mutable_grad_weight());
                    }
                    if (o.grad_bias) {
                      EncodeGradient(std::move(*o.grad_bias), o.grad_bias_in_shm,
                                     request.grad_bias_out(), response->mutable_grad_bias());
                    }
                    response->mutable_stats()->set_queue_ms(stats->queue_ms);
                    response->mutable_stats()->set_engine_ms(stats->engine_ms);
                  }
                  call->Reply(status);
                });
  return call;
}

// --- Streams ---------------------------------------------------------------

namespace {

// The tensor of `request` a streamed chunk fills, or null if the request
// does not carry that field.
v1::Tensor* ForwardField(v1::ForwardRequest& r, v1::TensorField field) {
  switch (field) {
    case v1::TENSOR_FIELD_HIDDEN:
      return r.has_hidden() ? r.mutable_hidden() : nullptr;
    case v1::TENSOR_FIELD_WEIGHT:
      return r.has_weight() ? r.mutable_weight() : nullptr;
    case v1::TENSOR_FIELD_BIAS:
      return r.has_bias() ? r.mutable_bias() : nullptr;
    case v1::TENSOR_FIELD_TARGET:
      return r.has_target() ? r.mutable_target() : nullptr;
    case v1::TENSOR_FIELD_CLASS_WEIGHT:
      return r.options().has_class_weight() ? r.mutable_options()->mutable_class_weight()
                                            : nullptr;
    default:
      return nullptr;
  }
}

const char* FieldName(v1::TensorField field) {
  switch (field) {
    case v1::TENSOR_FIELD_HIDDEN: return "hidden";
    case v1::TENSOR_FIELD_WEIGHT: return "weight";
    case v1::TENSOR_FIELD_BIAS: return "bias";
    case v1::TENSOR_FIELD_TARGET: return "target";
    case v1::TENSOR_FIELD_CLASS_WEIGHT: return "options.class_weight";
    default: return "chunk.field";
  }
}

absl::Status IdleError(const char* rpc, absl::Duration timeout) {
  return absl::DeadlineExceededError(absl::StrCat(
      rpc, ": no message for ", absl::FormatDuration(timeout),
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
    absl::StatusOr<StreamTicket> ticket =
        streams->Open(principal_, record_.rpc(), [this, streams] {
          absl::MutexLock idle_lock(&mu_);
          // Once the request went on to compute, only its answer finishes.
          if (!proceeding_) FinishLocked(IdleError(record_.rpc(), streams->limits().idle_timeout));
        });
    if (!ticket.ok()) return FinishLocked(ticket.status());
    ticket_ = *std::move(ticket);
    StartRead(&in_);
  }

  CallRecord& record() override { return record_; }
  grpc::CallbackServerContext* context() override { return context_; }
  void WhenOver(std::function<void(bool)> f) override { record_.WhenOver(std::move(f)); }

  void OnReadDone(bool ok) override {
    if (!ok) return OnEnd();
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    ticket_.Touch();
    record_.AddBytes(static_cast<int64_t>(in_.Length()), 0);
    absl::Status status = GuardMemory(
        [&]() -> absl::Status {
          FLCE_RETURN_IF_ERROR(ParseMessage(in_, message()));
          in_.Clear();
          return Take();
        },
        record_.rpc());
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
  // The message a read is parsed into, and the response sent on OK.
  virtual google::protobuf::Message* message() = 0;
  virtual const google::protobuf::Message& response() = 0;
  // One message arrived (parsed into message()).
  virtual absl::Status Take() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
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

// ForwardStream: the header request, then its tensors' bytes field by field;
// at the end of the stream, the assembled request goes through Forward.
// The announced tensors' bytes are reserved (RequestAdmission) when the
// header arrives; each tensor's memory is allocated when its first bytes
// do, and is filled only as far as they come.
class ForwardStreamReactor final : public ReadStream {
 public:
  ForwardStreamReactor(grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
                       ServiceMetrics* metrics, int64_t max_message_bytes, int64_t max_bytes,
                       std::function<void(ForwardStreamReactor*)> start_forward)
      : ReadStream(context, response, metrics, "ForwardStream", max_message_bytes),
        max_bytes_(max_bytes),
        start_forward_(std::move(start_forward)) {}

  const v1::ForwardRequest* request() const { return &request_; }
  v1::ForwardResponse* forward_response() { return &response_; }
  using ReadStream::principal;

 private:
  google::protobuf::Message* message() override { return &chunk_; }
  const google::protobuf::Message& response() override { return response_; }

  absl::Status Take() override {
    if (!started_) {
      if (!chunk_.has_request()) {
        return absl::InvalidArgumentError("request: required on the first message");
      }
      request_ = std::move(*chunk_.mutable_request());
      started_ = true;
      // Size every announced tensor up front (bounded by the limits).
      int64_t total = 0;
      for (int f = v1::TENSOR_FIELD_HIDDEN; f <= v1::TENSOR_FIELD_CLASS_WEIGHT; ++f) {
        v1::Tensor* t = ForwardField(request_, static_cast<v1::TensorField>(f));
        if (t == nullptr || !t->data().empty() || t->has_shm()) continue;
        FLCE_ASSIGN_OR_RETURN(const int64_t bytes,
                              TensorBytes(*t, FieldName(static_cast<v1::TensorField>(f))));
        total += bytes;
        if (total > max_bytes_) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "ForwardStream: the request's tensors need ", total,
              " bytes, over the limit of ", max_bytes_));
        }
        expected_[f] = bytes;
      }
      return ticket().Reserve(total, "ForwardStream");
    }
    if (chunk_.has_request()) {
      return absl::InvalidArgumentError("request: only the first message carries one");
    }
    const v1::TensorField field = chunk_.chunk().field();
    v1::Tensor* t = ForwardField(request_, field);
    auto expected = expected_.find(field);
    if (t == nullptr || expected == expected_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk.field: ", v1::TensorField_Name(field).empty() ? std::to_string(field)
                                                               : v1::TensorField_Name(field),
          " is not a tensor the request announced without data"));
    }
    const std::string& data = chunk_.chunk().data();
    std::string* into = t->mutable_data();
    if (static_cast<int64_t>(into->size() + data.size()) > expected->second) {
      return absl::InvalidArgumentError(absl::StrCat(
          FieldName(field), ": more bytes than its ", expected->second));
    }
    // The whole tensor is reserved with its first bytes (untouched memory
    // costs nothing until written), so appending never reallocates.
    if (into->capacity() < static_cast<size_t>(expected->second)) {
      into->reserve(static_cast<size_t>(expected->second));
    }
    into->append(data);
    return absl::OkStatus();
  }

  absl::Status End() override {
    if (!started_) return absl::InvalidArgumentError("request: the stream carried no message");
    for (const auto& [field, bytes] : expected_) {
      const v1::Tensor* t = ForwardField(request_, static_cast<v1::TensorField>(field));
      if (static_cast<int64_t>(t->data().size()) != bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat(FieldName(static_cast<v1::TensorField>(field)), ": received ",
                         t->data().size(), " of ", bytes, " bytes"));
      }
    }
    return absl::OkStatus();
  }

  bool RepliesLater() const override { return true; }
  void Proceed() override { start_forward_(this); }  // replies through Reply()

  const int64_t max_bytes_;
  const std::function<void(ForwardStreamReactor*)> start_forward_;
  v1::ForwardRequestChunk chunk_;
  v1::ForwardRequest request_;
  v1::ForwardResponse response_;
  bool started_ = false;
  absl::flat_hash_map<int, int64_t> expected_;
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
  grpc::CallbackServerContext* context() override { return context_; }
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
  virtual const google::protobuf::Message* Next() = 0;

 private:
  void WriteNext() {
    absl::Status status = GuardMemory(
        [&]() -> absl::Status {
          const google::protobuf::Message* message = Next();
          if (message == nullptr) return absl::OkStatus();
          out_.Clear();
          FLCE_RETURN_IF_ERROR(SerializeMessage(*message, max_message_bytes_,
                                                absl::StrCat(record_.rpc(), " message"), &out_));
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

// BackwardStream: the response with the gradients' dtypes and shapes, then
// their bytes in chunks.
class BackwardStreamReactor final : public WriteStream {
 public:
  BackwardStreamReactor(grpc::CallbackServerContext* context, ServiceMetrics* metrics,
                        int64_t max_message_bytes, int64_t chunk_bytes)
      : WriteStream(context, metrics, "BackwardStream", max_message_bytes),
        chunk_bytes_(chunk_bytes) {}

  v1::BackwardRequest* request() { return &request_; }

  // Called once the gradients are computed (or failed).
  void Start(const absl::Status& status, BackwardOutcome& outcome, double queue_ms,
             double engine_ms) {
    if (!status.ok()) return Reply(status);
    v1::BackwardResponse* header = message_.mutable_response();
    auto add = [&](HostTensor&& t, bool in_shm, const v1::SharedMemorySlice& slice,
                   v1::Tensor* meta, v1::TensorField field) {
      std::string data = std::move(t.data);
      t.data.clear();
      EncodeGradient(std::move(t), in_shm, slice, meta);  // dtype, shape (and slice)
      meta->clear_data();
      if (!in_shm) parts_.push_back({field, std::move(data)});
    };
    add(std::move(outcome.grad_hidden), outcome.grad_hidden_in_shm, request_.grad_hidden_out(),
        header->mutable_grad_hidden(), v1::TENSOR_FIELD_GRAD_HIDDEN);
    if (outcome.grad_weight) {
      add(std::move(*outcome.grad_weight), outcome.grad_weight_in_shm,
          request_.grad_weight_out(), header->mutable_grad_weight(),
          v1::TENSOR_FIELD_GRAD_WEIGHT);
    }
    if (outcome.grad_bias) {
      add(std::move(*outcome.grad_bias), outcome.grad_bias_in_shm, request_.grad_bias_out(),
          header->mutable_grad_bias(), v1::TENSOR_FIELD_GRAD_BIAS);
    }
    header->mutable_stats()->set_queue_ms(queue_ms);
    header->mutable_stats()->set_engine_ms(engine_ms);
    StartWriting();
  }

 private:
  const google::protobuf::Message* Next() override {
    if (!sent_header_) {
      sent_header_ = true;
      return &message_;
    }
    message_.Clear();
    while (part_ < parts_.size() && offset_ >= parts_[part_].data.size()) {
      parts_[part_].data = std::string();  // sent: free it
      ++part_;
      offset_ = 0;
    }
    if (part_ == parts_.size()) return nullptr;
    const Part& p = parts_[part_];
    const size_t n = std::min(p.data.size() - offset_, static_cast<size_t>(chunk_bytes_));
    message_.mutable_chunk()->set_field(p.field);
    message_.mutable_chunk()->set_data(p.data.data() + offset_, n);
    offset_ += n;
    return &message_;
  }

  struct Part {
    v1::TensorField field;
    std::string data;
  };
  const int64_t chunk_bytes_;
  v1::BackwardRequest request_;
  v1::BackwardResponseChunk message_;
  std::vector<Part> parts_;
  size_t part_ = 0, offset_ = 0;
  bool sent_header_ = false;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* LossServiceImpl::ForwardStream(Context* context,
                                                                         Bytes* response) {
  auto* reactor = new ForwardStreamReactor(
      context, response, metrics_, limits_.max_message_bytes, limits_.max_stream_request_bytes,
      [this](ForwardStreamReactor* r) {
        StartForward(r, r->principal(), r->request(), r->forward_response());
      });
  reactor->Begin(Admit(context), admission_);
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossServiceImpl::BackwardStream(Context* context,
                                                                           const Bytes* in) {
  auto* reactor = new BackwardStreamReactor(context, metrics_, limits_.max_message_bytes,
                                            limits_.stream_chunk_bytes());
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (!principal.ok()) {
    reactor->Reply(principal.status());
    return reactor;
  }
  absl::Status parsed = reactor->ParseRequest(*in, *admission_, *principal, reactor->request());
  if (!parsed.ok()) {
    reactor->Reply(parsed);
    return reactor;
  }
  auto outcome = std::make_shared<BackwardOutcome>();
  auto stats = std::make_shared<CallStats>();
  StartBackward(reactor, *principal, reactor->request(), /*max_response_bytes=*/0, outcome,
                stats, [this, reactor, outcome, stats](const absl::Status& status) {
                  if (status.ok()) core_->Answered(*outcome);
                  reactor->Start(status, *outcome, stats->queue_ms, stats->engine_ms);
                });
  return reactor;
}

// --- Sessions, information, shared memory -----------------------------------

LossServiceImpl::Unary* LossServiceImpl::ReleaseSession(Context* context, const Bytes* in,
                                                        Bytes* out) {
  auto* call = NewUnary<v1::ReleaseSessionRequest, v1::ReleaseSessionResponse>(
      context, in, out, "ReleaseSession");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/false)) {
    const std::string& id = call->request().session_id();
    call->record().SetDetail(SessionDetail(id));
    call->response()->set_released(core_->Release(id, *principal));
    call->Reply(absl::OkStatus());
  }
  return call;
}

LossServiceImpl::Unary* LossServiceImpl::GetServerInfo(Context* context, const Bytes* in,
                                                       Bytes* out) {
  auto* call = NewUnary<v1::GetServerInfoRequest, v1::GetServerInfoResponse>(
      context, in, out, "GetServerInfo");
  if (!Accept(call, /*new_work=*/false)) return call;
  v1::GetServerInfoResponse* response = call->response();
  const LossEngine& engine = core_->engine();
  const SessionStore& sessions = core_->sessions();
  response->set_version(kVersion);
  response->set_backend(engine.backend());
  for (const DeviceInfo& d : engine.devices()) {
    v1::Device* device = response->add_devices();
    device->set_name(d.name);
    device->set_total_memory_bytes(d.total_memory_bytes);
  }
  v1::Limits* limits = response->mutable_limits();
  limits->set_max_sessions(sessions.limits().max_sessions);
  limits->set_session_memory_budget_bytes(sessions.limits().memory_budget_bytes);
  limits->set_max_message_bytes(limits_.max_message_bytes);
  limits->set_session_ttl_seconds(absl::ToDoubleSeconds(sessions.limits().ttl));
  limits->set_max_queued_requests(queue_->max_queued());
  limits->set_weight_memory_budget_bytes(core_->weights().memory_budget_bytes());
  limits->set_max_streams(admission_->limits().max_streams);
  limits->set_request_memory_budget_bytes(admission_->limits().memory_bytes);
  limits->set_stream_idle_timeout_seconds(absl::ToDoubleSeconds(admission_->limits().idle_timeout));
  if (shared_memory_ != nullptr) {
    limits->set_max_shared_memory_regions(shared_memory_->limits().max_regions);
    limits->set_shared_memory_budget_bytes(shared_memory_->limits().max_bytes);
  }
  const Gauges load = gauges_();
  response->set_live_sessions(load.live_sessions);
  response->set_session_memory_bytes(load.session_memory_bytes);
  response->set_weight_memory_bytes(load.weight_memory_bytes);
  response->set_running_requests(load.running_requests);
  response->set_queued_requests(load.queued_requests);
  call->Reply(absl::OkStatus());
  return call;
}

namespace {

void ToProto(const HistogramSnapshot& h, v1::Histogram* out) {
  out->mutable_upper_bounds()->Assign(kLatencyBuckets.begin(), kLatencyBuckets.end());
  out->mutable_counts()->Assign(h.counts.begin(), h.counts.end());
  out->set_sum(h.sum);
  out->set_count(h.count);
}

}  // namespace

LossServiceImpl::Unary* LossServiceImpl::GetStats(Context* context, const Bytes* in,
                                                  Bytes* out) {
  auto* call = NewUnary<v1::GetStatsRequest, v1::GetStatsResponse>(context, in, out, "GetStats");
  if (!Accept(call, /*new_work=*/false)) return call;
  v1::GetStatsResponse* response = call->response();
  const MetricsSnapshot s = metrics_->Snapshot(gauges_());
  for (const auto& [key, count] : s.requests) {
    v1::GetStatsResponse::RequestCount* c = response->add_requests();
    c->set_rpc(key.first);
    c->set_code(key.second);
    c->set_count(count);
  }
  for (const auto& [rpc, h] : s.latency) ToProto(h, &(*response->mutable_request_duration())[rpc]);
  for (const auto& [rpc, h] : s.engine) ToProto(h, &(*response->mutable_engine_duration())[rpc]);
  ToProto(s.queue_wait, response->mutable_queue_wait());
  for (const auto& [rpc, b] : s.received_bytes) (*response->mutable_received_bytes())[rpc] = b;
  for (const auto& [rpc, b] : s.sent_bytes) (*response->mutable_sent_bytes())[rpc] = b;
  for (const auto& [rpc, t] : s.tokens) (*response->mutable_tokens())[rpc] = t;
  response->set_uptime_seconds(s.uptime_seconds);
  const Gauges& g = s.gauges;
  response->set_sessions_expired(g.sessions_expired);
  response->set_engine_forward_reruns(g.engine_forward_reruns);
  response->set_queued_requests(g.queued_requests);
  response->set_running_requests(g.running_requests);
  response->set_live_sessions(g.live_sessions);
  response->set_session_memory_bytes(g.session_memory_bytes);
  response->set_registered_weights(g.registered_weights);
  response->set_weight_memory_bytes(g.weight_memory_bytes);
  response->set_shared_memory_regions(g.shared_memory_regions);
  response->set_shared_memory_bytes(g.shared_memory_bytes);
  response->set_device_memory_bytes(g.device_memory_bytes);
  response->set_weight_device_memory_bytes(g.weight_device_memory_bytes);
  response->set_open_streams(g.open_streams);
  response->set_request_memory_bytes(g.request_memory_bytes);
  response->set_stream_idle_timeouts(g.stream_idle_timeouts);
  response->set_serving(g.serving);
  call->Reply(absl::OkStatus());
  return call;
}

LossServiceImpl::Unary* LossServiceImpl::RegisterSharedMemory(Context* context, const Bytes* in,
                                                              Bytes* out) {
  auto* call = NewUnary<v1::RegisterSharedMemoryRequest, v1::RegisterSharedMemoryResponse>(
      context, in, out, "RegisterSharedMemory");
  std::optional<std::string> principal = Accept(call, /*new_work=*/true);
  if (!principal) return call;
  if (shared_memory_ == nullptr) {
    call->Reply(absl::FailedPreconditionError(
        "shared memory is disabled on this server; start it with --enable_shared_memory"));
    return call;
  }
  const v1::RegisterSharedMemoryRequest& request = call->request();
  absl::StatusOr<RegisteredRegion> region;
  if (request.has_cuda_ipc_handle()) {
    call->record().SetDetail("cuda_ipc ");
    region = shared_memory_->RegisterCudaIpc(request.cuda_ipc_handle(), request.bytes(),
                                             core_->engine(), *principal);
  } else {
    call->record().SetDetail(absl::StrCat("shm=", LogSafe(request.shm_name()), " "));
    region = shared_memory_->Register(request.shm_name(), request.bytes(), *principal);
  }
  if (region.ok()) {
    call->response()->set_region_id(region->region_id);
    call->response()->set_bytes(region->bytes);
    // A region whose id never reached its client would stay mapped for good.
    call->WhenOver([this, id = region->region_id, principal = *principal](bool delivered) {
      if (!delivered) shared_memory_->Unregister(id, principal);
    });
  }
  call->Reply(region.status());
  return call;
}

LossServiceImpl::Unary* LossServiceImpl::UnregisterSharedMemory(Context* context,
                                                                const Bytes* in, Bytes* out) {
  auto* call = NewUnary<v1::UnregisterSharedMemoryRequest, v1::UnregisterSharedMemoryResponse>(
      context, in, out, "UnregisterSharedMemory");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/false)) {
    call->response()->set_unregistered(
        shared_memory_ != nullptr &&
        shared_memory_->Unregister(call->request().region_id(), *principal));
    call->Reply(absl::OkStatus());
  }
  return call;
}

// --- Registered weights ----------------------------------------------------

namespace {

void FillWeightInfo(const RegisteredWeight& w, v1::WeightInfo* info) {
  info->set_name(w.name());
  info->set_version(w.version());
  info->set_dtype(ToProto(w.weight().dtype));
  info->mutable_shape()->Assign(w.weight().shape.begin(), w.weight().shape.end());
  info->set_has_bias(w.bias().has_value());
  info->set_bytes(w.bytes());
  info->set_accumulated_backwards(w.accumulated_backwards());
}

// PutWeight: the header chunk names and sizes the weight and takes its bytes
// from the weight budget; the data is stored as it arrives, and the end of
// the stream checks the length and CRC-32C before the weight is registered.
// Nothing is registered from a broken stream.
class PutWeightReactor final : public ReadStream {
 public:
  PutWeightReactor(grpc::CallbackServerContext* context, WeightRegistry* weights,
                   grpc::ByteBuffer* response, ServiceMetrics* metrics,
                   int64_t max_message_bytes)
      : ReadStream(context, response, metrics, "PutWeight", max_message_bytes),
        weights_(weights) {}

 private:
  google::protobuf::Message* message() override { return &chunk_; }
  const google::protobuf::Message& response() override { return response_; }

  absl::Status Take() override {
    if (!started_) {
      if (!chunk_.has_header()) {
        return absl::InvalidArgumentError("header: required on the first chunk");
      }
      FLCE_RETURN_IF_ERROR(Start(chunk_.header()));
    } else if (chunk_.has_header()) {
      return absl::InvalidArgumentError("header: only the first chunk carries one");
    }
    const std::string& data = chunk_.data();
    if (static_cast<int64_t>(payload_.size() + data.size()) > total_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data: more bytes than the header's ", total_, " (", payload_.size() + data.size(),
          " so far)"));
    }
    // Reserved (not touched) with the first bytes, so it never reallocates.
    if (!data.empty() && payload_.capacity() < static_cast<size_t>(total_)) {
      payload_.reserve(static_cast<size_t>(total_));
    }
    payload_.append(data);
    crc_ = Crc32c(crc_, data.data(), data.size());
    return absl::OkStatus();
  }

  absl::Status Start(const v1::WeightHeader& h) {
    started_ = true;
    name_ = h.name();
    if (!WeightRegistry::ValidName(name_)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.name: '", LogSafe(name_, 128), "' must be 1-128 characters of [A-Za-z0-9_.-]"));
    }
    record().SetDetail(absl::StrCat("weight=", name_, " "));
    expected_crc_ = h.crc32c();
    FLCE_ASSIGN_OR_RETURN(dtype_, FromProto(h.dtype(), "header.dtype"));
    if (!IsFloating(dtype_)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.dtype: ", DTypeName(dtype_), " not supported; expected bf16, fp16 or fp32"));
    }
    shape_.assign(h.shape().begin(), h.shape().end());
    if (shape_.size() != 2 || shape_[0] < 1 || shape_[1] < 1 ||
        shape_[0] > (int64_t{1} << 40) / shape_[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.shape: expected [V, H] with V, H >= 1, got ", ShapeString(shape_)));
    }
    has_bias_ = h.has_bias();
    const int64_t elem = DTypeSize(dtype_);
    total_ = (shape_[0] * shape_[1] + (has_bias_ ? shape_[0] : 0)) * elem;
    FLCE_ASSIGN_OR_RETURN(hold_, weights_->Reserve(name_, total_));
    return absl::OkStatus();
  }

  absl::Status End() override {
    if (!started_) return absl::InvalidArgumentError("header: the stream carried no chunk");
    if (static_cast<int64_t>(payload_.size()) != total_) {
      return absl::InvalidArgumentError(absl::StrCat("data: received ", payload_.size(),
                                                     " of the header's ", total_, " bytes"));
    }
    if (crc_ != expected_crc_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "header.crc32c: the bytes received have CRC-32C %08x, the header says %08x", crc_,
          expected_crc_));
    }
    // W's bytes first, then b's.
    const size_t w_bytes = static_cast<size_t>(shape_[0] * shape_[1] * DTypeSize(dtype_));
    std::optional<HostTensor> bias;
    if (has_bias_) {
      bias.emplace();
      bias->dtype = dtype_;
      bias->shape = {shape_[0]};
      bias->data = payload_.substr(w_bytes);
    }
    HostTensor weight;
    weight.dtype = dtype_;
    weight.shape = shape_;
    payload_.resize(w_bytes);
    weight.data = std::move(payload_);
    FLCE_ASSIGN_OR_RETURN(
        std::shared_ptr<RegisteredWeight> registered,
        weights_->Put(name_, principal(), std::move(weight), std::move(bias), std::move(hold_)));
    FillWeightInfo(*registered, response_.mutable_weight());
    record().SetDetail(absl::StrCat("weight=", name_, " version=", registered->version(),
                                    " bytes=", total_, " "));
    return absl::OkStatus();
  }

  WeightRegistry* const weights_;
  v1::PutWeightChunk chunk_;
  v1::PutWeightResponse response_;
  bool started_ = false;
  std::string name_;
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_;
  bool has_bias_ = false;
  BudgetHold hold_;
  std::string payload_;
  int64_t total_ = 0;
  uint32_t crc_ = 0, expected_crc_ = 0;
};

// TakeWeightGrad: takes the accumulated gradient, narrows it to the asked
// dtype, and streams it in chunks; unless the whole stream reached the
// client, the gradient goes back into the accumulator.
class TakeGradReactor final : public WriteStream {
 public:
  TakeGradReactor(grpc::CallbackServerContext* context, ServiceMetrics* metrics,
                  int64_t max_message_bytes, int64_t chunk_bytes)
      : WriteStream(context, metrics, "TakeWeightGrad", max_message_bytes),
        chunk_bytes_(chunk_bytes) {}

  absl::Status Prepare(const WeightRegistry& weights, const v1::TakeWeightGradRequest& r,
                       const std::string& principal) {
    record().SetDetail(absl::StrCat("weight=", LogSafe(r.weight().name()), " "));
    FLCE_ASSIGN_OR_RETURN(weight_, weights.Get(r.weight().name(), r.weight().version(), principal));
    DType dtype = DType::kFloat32;
    if (r.dtype() != v1::DTYPE_UNSPECIFIED) {
      FLCE_ASSIGN_OR_RETURN(dtype, FromProto(r.dtype(), "dtype"));
    }
    // Refused before anything is taken.
    FLCE_RETURN_IF_ERROR(weight_->CheckGradDType(dtype, "dtype"));
    FLCE_ASSIGN_OR_RETURN(RegisteredWeight::Grad grad,
                          weight_->TakeGrad(/*pending=*/true, r.resume_take()));
    grad_ = std::move(grad);
    // Put back unless delivered; kept for a resume if asked.
    WhenOver([this, hold = r.hold_until_acknowledged()](bool delivered) {
      if (!delivered) {
        weight_->RestoreGrad(*std::move(grad_));
      } else if (hold) {
        weight_->ConfirmTake(std::move(grad_));
      } else {
        weight_->ConfirmTake();
      }
    });
    FLCE_ASSIGN_OR_RETURN(payload_, weight_->GradBytes(*grad_, dtype, "dtype"));
    v1::WeightGradHeader* header = chunk_.mutable_header();
    FillWeightInfo(*weight_, header->mutable_weight());
    header->set_dtype(ToProto(dtype));
    header->set_accumulated_backwards(grad_->backwards);
    if (r.hold_until_acknowledged()) header->set_take_id(grad_->take_id);
    record().SetDetail(absl::StrCat("weight=", weight_->name(), " version=", weight_->version(),
                                    " backwards=", grad_->backwards, " "));
    return absl::OkStatus();
  }

 private:
  const google::protobuf::Message* Next() override {
    if (sent_header_ && offset_ >= payload_.size()) return nullptr;
    if (sent_header_) chunk_.clear_header();
    const size_t n = std::min(payload_.size() - offset_, static_cast<size_t>(chunk_bytes_));
    chunk_.set_data(payload_.data() + offset_, n);
    offset_ += n;
    sent_header_ = true;
    return &chunk_;
  }

  const int64_t chunk_bytes_;
  std::shared_ptr<RegisteredWeight> weight_;
  std::optional<RegisteredWeight::Grad> grad_;
  std::string payload_;
  size_t offset_ = 0;
  bool sent_header_ = false;
  v1::WeightGradChunk chunk_;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* LossServiceImpl::PutWeight(Context* context,
                                                                     Bytes* response) {
  auto* reactor = new PutWeightReactor(context, &core_->weights(), response, metrics_,
                                       limits_.max_message_bytes);
  reactor->Begin(Admit(context), admission_);
  return reactor;
}

LossServiceImpl::Unary* LossServiceImpl::DeleteWeight(Context* context, const Bytes* in,
                                                      Bytes* out) {
  auto* call = NewUnary<v1::DeleteWeightRequest, v1::DeleteWeightResponse>(context, in, out,
                                                                          "DeleteWeight");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/false)) {
    call->record().SetDetail(absl::StrCat("weight=", LogSafe(call->request().name()), " "));
    call->response()->set_deleted(core_->weights().Delete(call->request().name(), *principal));
    call->Reply(absl::OkStatus());
  }
  return call;
}

LossServiceImpl::Unary* LossServiceImpl::ListWeights(Context* context, const Bytes* in,
                                                     Bytes* out) {
  auto* call =
      NewUnary<v1::ListWeightsRequest, v1::ListWeightsResponse>(context, in, out, "ListWeights");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/false)) {
    for (const auto& weight : core_->weights().List(*principal)) {
      FillWeightInfo(*weight, call->response()->add_weights());
    }
    call->Reply(absl::OkStatus());
  }
  return call;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossServiceImpl::TakeWeightGrad(Context* context,
                                                                           const Bytes* in) {
  auto* reactor = new TakeGradReactor(context, metrics_, limits_.max_message_bytes,
                                      limits_.stream_chunk_bytes());
  absl::StatusOr<std::string> principal = Authenticate(context);
  absl::Status status = principal.status();
  v1::TakeWeightGradRequest request;
  if (status.ok()) status = reactor->ParseRequest(*in, *admission_, *principal, &request);
  if (status.ok()) {
    status = GuardMemory([&] { return reactor->Prepare(core_->weights(), request, *principal); },
                         "TakeWeightGrad");
  }
  if (status.ok()) {
    reactor->StartWriting();
  } else {
    reactor->Reply(status);
  }
  return reactor;
}

}  // namespace flce
