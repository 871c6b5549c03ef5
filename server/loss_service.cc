#include "server/loss_service.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/codec.h"
#include "proto/crc32c.h"
#include "kernels/status_macros.h"
#include "server/version.h"
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
absl::Status CheckAlive(const grpc::CallbackServerContext* context,
                        const char* where) {
  if (DeadlinePassed(context)) {
    return absl::DeadlineExceededError(
        absl::StrCat("deadline exceeded ", where));
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

// One access-log line per finished RPC, and its count and latency.
void LogRpc(ServiceMetrics* metrics, const char* rpc, const std::string& detail,
            const absl::Status& status, absl::Time start) {
  const double ms = MillisSince(start);
  SPDLOG_INFO("rpc={} {}code={} ms={:.1f}", rpc, detail,
              absl::StatusCodeToString(status.code()), ms);
  if (metrics != nullptr) metrics->RecordRpc(rpc, status.code(), ms / 1e3);
}

// Finishes a unary call that failed authentication.
grpc::ServerUnaryReactor* Refuse(ServiceMetrics* metrics, grpc::CallbackServerContext* context,
                                 const char* rpc, const absl::Status& status) {
  LogRpc(metrics, rpc, "", status, absl::Now());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

std::string ProblemDetail(const LossProblem& p) {
  return absl::StrCat("n=", p.rows(), " h=", p.hidden_size(), " v=", p.vocab(),
                      " dtype=", DTypeName(p.hidden.dtype), " ");
}

std::string SessionDetail(const std::string& id) {
  return id.empty() ? "" : absl::StrCat("session=", id.substr(0, 8), " ");
}

// Queues `work` (returning the RPC's status), then calls finish(status) on
// the worker; at once if the queue refuses.
template <typename Work>
void Run(ServiceMetrics* metrics, grpc::CallbackServerContext* context, WorkQueue* queue,
         const char* rpc,
         std::shared_ptr<std::string> detail, Work work,
         std::function<void(const absl::Status&)> finish) {
  const absl::Time start = absl::Now();
  absl::Status submitted = queue->Submit([=]() mutable {
    absl::Status status = CheckAlive(context, "while queued");
    if (status.ok()) status = work(start);
    LogRpc(metrics, rpc, *detail, status, start);
    finish(status);
  });
  if (!submitted.ok()) {
    LogRpc(metrics, rpc, *detail, submitted, start);
    finish(submitted);
  }
}

}  // namespace

LossServiceImpl::LossServiceImpl(LossCore* core, WorkQueue* queue, ServiceLimits limits,
                                 SharedMemoryRegistry* shared_memory, const Authenticator* auth,
                                 ServiceMetrics* metrics, std::function<Gauges()> gauges,
                                 std::function<void()> on_engine_unhealthy)
    : core_(core),
      queue_(queue),
      limits_(limits),
      shared_memory_(shared_memory),
      auth_(auth),
      metrics_(metrics),
      gauges_(std::move(gauges)),
      on_engine_unhealthy_(std::move(on_engine_unhealthy)) {}

absl::StatusOr<std::string> LossServiceImpl::Authenticate(
    const grpc::CallbackServerContext* context) const {
  if (auth_ == nullptr) return std::string();
  return auth_->Authenticate(*context);
}

absl::StatusOr<std::string> LossServiceImpl::Admit(
    const grpc::CallbackServerContext* context) const {
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

absl::Status LossServiceImpl::Explain(absl::Status status,
                                      const grpc::CallbackServerContext* context) {
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

absl::Status LossServiceImpl::ComputeForward(grpc::CallbackServerContext* context,
                                             const std::string& principal,
                                             const ForwardCall& call,
                                             v1::ForwardResponse* response, absl::Time start,
                                             std::string* detail) {
  const absl::Time engine_start = absl::Now();
  absl::StatusOr<ForwardOutcome> outcome =
      core_->Forward(call, principal, CancelFor(context));
  metrics_->RecordQueueWait(absl::ToDoubleSeconds(engine_start - start));
  metrics_->RecordEngine("Forward", absl::ToDoubleSeconds(absl::Now() - engine_start));
  if (!outcome.ok()) return Explain(outcome.status(), context);
  if (!outcome->session_id.empty()) {
    // Nobody will learn this id if the caller is gone: free it.
    absl::Status alive = CheckAlive(context, "while computing");
    if (!alive.ok()) {
      core_->Release(outcome->session_id, principal);
      return alive;
    }
  }
  ForwardResult& r = outcome->result;
  MoveToProto(std::move(r.loss), response->mutable_loss());
  MoveToProto(std::move(r.z_loss), response->mutable_z_loss());
  if (r.lse) MoveToProto(std::move(*r.lse), response->mutable_lse());
  if (r.per_row_loss) MoveToProto(std::move(*r.per_row_loss), response->mutable_per_row_loss());
  response->set_num_valid(r.num_valid);
  response->set_num_correct(r.num_correct);
  response->set_session_id(outcome->session_id);
  response->set_backward_mode(ToProto(outcome->mode));
  response->mutable_stats()->set_queue_ms(absl::ToDoubleMilliseconds(engine_start - start));
  response->mutable_stats()->set_engine_ms(MillisSince(engine_start));
  *detail = SessionDetail(outcome->session_id) + *detail;
  return absl::OkStatus();
}

void LossServiceImpl::StartForward(grpc::CallbackServerContext* context,
                                   const std::string& principal,
                                   const v1::ForwardRequest* request,
                                   v1::ForwardResponse* response, const char* rpc,
                                   std::function<void(const absl::Status&)> finish) {
  absl::StatusOr<ForwardCall> call =
      DecodeForward(*request, core_->weights(), principal, ResolverFor(principal));
  if (!call.ok()) {
    LogRpc(metrics_, rpc, "", call.status(), absl::Now());
    finish(call.status());
    return;
  }
  auto detail = std::make_shared<std::string>(ProblemDetail(call->problem));
  const int64_t received = static_cast<int64_t>(request->ByteSizeLong());
  Run(metrics_, context, queue_, rpc, detail,
      [=, call = *std::move(call)](absl::Time start) {
        return ComputeForward(context, principal, call, response, start, detail.get());
      },
      [=, finish = std::move(finish)](const absl::Status& status) {
        metrics_->AddBytes(rpc, received,
                           status.ok() ? static_cast<int64_t>(response->ByteSizeLong()) : 0);
        finish(status);
      });
}

grpc::ServerUnaryReactor* LossServiceImpl::Forward(grpc::CallbackServerContext* context,
                                                   const v1::ForwardRequest* request,
                                                   v1::ForwardResponse* response) {
  absl::StatusOr<std::string> principal = Admit(context);
  if (!principal.ok()) return Refuse(metrics_, context, "Forward", principal.status());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  StartForward(context, *principal, request, response, "Forward",
               [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); });
  return reactor;
}

void LossServiceImpl::StartBackward(grpc::CallbackServerContext* context,
                                    const std::string& principal,
                                    const v1::BackwardRequest* request, const char* rpc,
                                    std::shared_ptr<BackwardOutcome> outcome,
                                    std::shared_ptr<CallStats> stats,
                                    std::function<void(const absl::Status&)> finish) {
  absl::StatusOr<BackwardCall> call = DecodeBackward(*request, ResolverFor(principal));
  if (!call.ok()) {
    LogRpc(metrics_, rpc, "", call.status(), absl::Now());
    finish(call.status());
    return;
  }
  auto detail = std::make_shared<std::string>(SessionDetail(call->session_id));
  Run(metrics_, context, queue_, rpc, detail,
      [=, call = *std::move(call)](absl::Time start) -> absl::Status {
        const absl::Time engine_start = absl::Now();
        absl::StatusOr<BackwardOutcome> grads =
            core_->Backward(call, principal, CancelFor(context));
        metrics_->RecordQueueWait(absl::ToDoubleSeconds(engine_start - start));
        metrics_->RecordEngine("Backward", absl::ToDoubleSeconds(absl::Now() - engine_start));
        if (!grads.ok()) return Explain(grads.status(), context);
        *outcome = *std::move(grads);
        stats->queue_ms = absl::ToDoubleMilliseconds(engine_start - start);
        stats->engine_ms = MillisSince(engine_start);
        return absl::OkStatus();
      },
      std::move(finish));
}

grpc::ServerUnaryReactor* LossServiceImpl::Backward(grpc::CallbackServerContext* context,
                                                    const v1::BackwardRequest* request,
                                                    v1::BackwardResponse* response) {
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (!principal.ok()) return Refuse(metrics_, context, "Backward", principal.status());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto outcome = std::make_shared<BackwardOutcome>();
  auto stats = std::make_shared<CallStats>();
  StartBackward(context, *principal, request, "Backward", outcome, stats,
                [=](const absl::Status& status) {
                  if (status.ok()) {
                    EncodeGradient(std::move(outcome->grad_hidden), outcome->grad_hidden_in_shm,
                                   request->grad_hidden_out(), response->mutable_grad_hidden());
                    if (outcome->grad_weight) {
                      EncodeGradient(std::move(*outcome->grad_weight),
                                     outcome->grad_weight_in_shm, request->grad_weight_out(),
                                     response->mutable_grad_weight());
                    }
                    if (outcome->grad_bias) {
                      EncodeGradient(std::move(*outcome->grad_bias), outcome->grad_bias_in_shm,
                                     request->grad_bias_out(), response->mutable_grad_bias());
                    }
                    response->mutable_stats()->set_queue_ms(stats->queue_ms);
                    response->mutable_stats()->set_engine_ms(stats->engine_ms);
                  }
                  metrics_->AddBytes("Backward", static_cast<int64_t>(request->ByteSizeLong()),
                                     static_cast<int64_t>(response->ByteSizeLong()));
                  reactor->Finish(ToGrpcStatus(status));
                });
  return reactor;
}

grpc::ServerUnaryReactor* LossServiceImpl::ReleaseSession(
    grpc::CallbackServerContext* context,
    const v1::ReleaseSessionRequest* request,
    v1::ReleaseSessionResponse* response) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (!principal.ok()) return Refuse(metrics_, context, "ReleaseSession", principal.status());
  response->set_released(core_->Release(request->session_id(), *principal));
  LogRpc(metrics_, "ReleaseSession", SessionDetail(request->session_id()), absl::OkStatus(),
         start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* LossServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context, const v1::GetServerInfoRequest*,
    v1::GetServerInfoResponse* response) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (!principal.ok()) return Refuse(metrics_, context, "GetServerInfo", principal.status());
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
  const Gauges load = gauges_();
  response->set_live_sessions(load.live_sessions);
  response->set_session_memory_bytes(load.session_memory_bytes);
  response->set_weight_memory_bytes(load.weight_memory_bytes);
  response->set_running_requests(load.running_requests);
  response->set_queued_requests(load.queued_requests);
  LogRpc(metrics_, "GetServerInfo", "", absl::OkStatus(), start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

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

// PutWeight: the header chunk sizes the tensors, later chunks fill them in
// order, and the end of the stream checks the length and CRC-32C before the
// weight is registered. Nothing is registered from a broken stream.
class PutWeightReactor : public grpc::ServerReadReactor<v1::PutWeightChunk> {
 public:
  PutWeightReactor(grpc::CallbackServerContext* context, WeightRegistry* weights,
                   v1::PutWeightResponse* response, absl::StatusOr<std::string> principal,
                   ServiceMetrics* metrics)
      : context_(context),
        weights_(weights),
        response_(response),
        metrics_(metrics),
        start_(absl::Now()) {
    if (!principal.ok()) {  // refused before reading a byte
      LogRpc(metrics_, "PutWeight", "", principal.status(), start_);
      Finish(ToGrpcStatus(principal.status()));
      return;
    }
    principal_ = *std::move(principal);
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    absl::Status status;
    if (!ok) {
      status = context_->IsCancelled() ? absl::CancelledError("cancelled by the client")
                                       : Register();
    } else {
      status = Take();
      if (status.ok()) {
        StartRead(&chunk_);
        return;
      }
    }
    LogRpc(metrics_, "PutWeight", detail_, status, start_);
    metrics_->AddBytes("PutWeight", received_, 0);
    Finish(ToGrpcStatus(status));
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Take() {
    if (!started_) {
      if (!chunk_.has_header()) return absl::InvalidArgumentError("header: required on the first chunk");
      FLCE_RETURN_IF_ERROR(Start(chunk_.header()));
    } else if (chunk_.has_header()) {
      return absl::InvalidArgumentError("header: only the first chunk carries one");
    }
    const std::string& data = chunk_.data();
    if (received_ + static_cast<int64_t>(data.size()) > total_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data: more bytes than the header's ", total_, " (", received_ + data.size(),
          " so far)"));
    }
    // W's bytes first, then b's.
    size_t from = 0;
    const int64_t w_bytes = static_cast<int64_t>(weight_.data.size());
    if (received_ < w_bytes) {
      const size_t n = std::min<size_t>(data.size(), static_cast<size_t>(w_bytes - received_));
      std::memcpy(&weight_.data[received_], data.data(), n);
      from = n;
    }
    if (from < data.size()) {
      std::memcpy(&bias_->data[received_ + from - w_bytes], data.data() + from,
                  data.size() - from);
    }
    crc_ = Crc32c(crc_, data.data(), data.size());
    received_ += static_cast<int64_t>(data.size());
    return absl::OkStatus();
  }

  absl::Status Start(const v1::WeightHeader& h) {
    started_ = true;
    name_ = h.name();
    expected_crc_ = h.crc32c();
    detail_ = absl::StrCat("weight=", name_, " ");
    FLCE_ASSIGN_OR_RETURN(const DType dtype, FromProto(h.dtype(), "header.dtype"));
    if (!IsFloating(dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.dtype: ", DTypeName(dtype), " not supported; expected bf16, fp16 or fp32"));
    }
    const std::vector<int64_t> shape(h.shape().begin(), h.shape().end());
    if (shape.size() != 2 || shape[0] < 1 || shape[1] < 1 ||
        shape[0] > (int64_t{1} << 40) / shape[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.shape: expected [V, H] with V, H >= 1, got ", ShapeString(shape)));
    }
    const int64_t elem = DTypeSize(dtype);
    total_ = (shape[0] * shape[1] + (h.has_bias() ? shape[0] : 0)) * elem;
    if (weights_->bytes_in_use() + total_ > weights_->memory_budget_bytes()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "weight memory: ", name_, " needs ", total_, " bytes, ", weights_->bytes_in_use(),
          " of the budget of ", weights_->memory_budget_bytes(), " bytes are in use"));
    }
    try {
      weight_ = HostTensor(dtype, shape);
      if (h.has_bias()) bias_ = HostTensor(dtype, {shape[0]});
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(
          absl::StrCat("weight memory: cannot allocate ", total_, " bytes for ", name_));
    }
    return absl::OkStatus();
  }

  absl::Status Register() {
    if (!started_) return absl::InvalidArgumentError("header: the stream carried no chunk");
    if (received_ != total_) {
      return absl::InvalidArgumentError(
          absl::StrCat("data: received ", received_, " of the header's ", total_, " bytes"));
    }
    if (crc_ != expected_crc_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "header.crc32c: the bytes received have CRC-32C %08x, the header says %08x", crc_,
          expected_crc_));
    }
    FLCE_ASSIGN_OR_RETURN(
        std::shared_ptr<RegisteredWeight> registered,
        weights_->Put(name_, principal_, std::move(weight_), std::move(bias_)));
    FillWeightInfo(*registered, response_->mutable_weight());
    detail_ = absl::StrCat("weight=", name_, " version=", registered->version(), " bytes=",
                           total_, " ");
    return absl::OkStatus();
  }

  grpc::CallbackServerContext* const context_;
  WeightRegistry* const weights_;
  v1::PutWeightResponse* const response_;
  ServiceMetrics* const metrics_;
  const absl::Time start_;
  std::string principal_;
  v1::PutWeightChunk chunk_;
  bool started_ = false;
  std::string name_, detail_;
  HostTensor weight_;
  std::optional<HostTensor> bias_;
  int64_t total_ = 0, received_ = 0;
  uint32_t crc_ = 0, expected_crc_ = 0;
};

// TakeWeightGrad: takes the accumulated gradient, narrows it to the asked
// dtype, and streams it in chunks; if the stream breaks, the gradient goes
// back into the accumulator.
class TakeGradReactor : public grpc::ServerWriteReactor<v1::WeightGradChunk> {
 public:
  TakeGradReactor(const absl::StatusOr<std::string>& principal, WeightRegistry* weights,
                  const v1::TakeWeightGradRequest* request, int64_t chunk_bytes,
                  ServiceMetrics* metrics)
      : chunk_bytes_(chunk_bytes), metrics_(metrics), start_(absl::Now()) {
    detail_ = absl::StrCat("weight=", request->weight().name(), " ");
    absl::Status status =
        principal.ok() ? Prepare(*weights, *request, *principal) : principal.status();
    if (!status.ok()) {
      Done(status);
      return;
    }
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      // The client is gone: keep the gradient for the next TakeWeightGrad.
      weight_->RestoreGrad(std::move(grad_));
      Done(absl::CancelledError("the stream broke; the gradient stays accumulated"));
      return;
    }
    Next();
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Prepare(const WeightRegistry& weights, const v1::TakeWeightGradRequest& r,
                       const std::string& principal) {
    FLCE_ASSIGN_OR_RETURN(weight_, weights.Get(r.weight().name(), r.weight().version(), principal));
    DType dtype = DType::kFloat32;
    if (r.dtype() != v1::DTYPE_UNSPECIFIED) {
      FLCE_ASSIGN_OR_RETURN(dtype, FromProto(r.dtype(), "dtype"));
      if (dtype != DType::kFloat32 && dtype != weight_->weight().dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "dtype: ", DTypeName(dtype), " not supported; expected fp32 or the weight's ",
            DTypeName(weight_->weight().dtype)));
      }
    }
    FLCE_ASSIGN_OR_RETURN(grad_, weight_->TakeGrad());
    const int64_t elem = DTypeSize(dtype);
    const int64_t dw = grad_.dw.num_elements();
    const int64_t db = grad_.db ? grad_.db->num_elements() : 0;
    payload_.resize(static_cast<size_t>((dw + db) * elem));
    FromFloat(dtype, grad_.dw.data_as<float>(), dw, &payload_[0]);
    if (grad_.db) FromFloat(dtype, grad_.db->data_as<float>(), db, &payload_[dw * elem]);
    v1::WeightGradHeader* header = chunk_.mutable_header();
    FillWeightInfo(*weight_, header->mutable_weight());
    header->set_dtype(ToProto(dtype));
    header->set_accumulated_backwards(grad_.backwards);
    detail_ = absl::StrCat("weight=", weight_->name(), " version=", weight_->version(),
                           " backwards=", grad_.backwards, " ");
    return absl::OkStatus();
  }

  void Next() {
    if (sent_header_ && offset_ >= payload_.size()) {
      Done(absl::OkStatus());
      return;
    }
    if (sent_header_) chunk_.clear_header();
    const size_t n = std::min(payload_.size() - offset_, static_cast<size_t>(chunk_bytes_));
    chunk_.set_data(payload_.data() + offset_, n);
    offset_ += n;
    sent_header_ = true;
    StartWrite(&chunk_);
  }

  void Done(const absl::Status& status) {
    LogRpc(metrics_, "TakeWeightGrad", detail_, status, start_);
    metrics_->AddBytes("TakeWeightGrad", 0, static_cast<int64_t>(offset_));
    Finish(ToGrpcStatus(status));
  }

  const int64_t chunk_bytes_;
  ServiceMetrics* const metrics_;
  const absl::Time start_;
  std::string detail_;
  std::shared_ptr<RegisteredWeight> weight_;
  RegisteredWeight::Grad grad_;
  std::string payload_;
  size_t offset_ = 0;
  bool sent_header_ = false;
  v1::WeightGradChunk chunk_;
};

}  // namespace

grpc::ServerReadReactor<v1::PutWeightChunk>* LossServiceImpl::PutWeight(
    grpc::CallbackServerContext* context, v1::PutWeightResponse* response) {
  return new PutWeightReactor(context, &core_->weights(), response, Admit(context),
                              metrics_);
}

grpc::ServerUnaryReactor* LossServiceImpl::DeleteWeight(grpc::CallbackServerContext* context,
                                                        const v1::DeleteWeightRequest* request,
                                                        v1::DeleteWeightResponse* response) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (!principal.ok()) return Refuse(metrics_, context, "DeleteWeight", principal.status());
  response->set_deleted(core_->weights().Delete(request->name(), *principal));
  LogRpc(metrics_, "DeleteWeight", absl::StrCat("weight=", request->name(), " "), absl::OkStatus(), start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* LossServiceImpl::ListWeights(grpc::CallbackServerContext* context,
                                                       const v1::ListWeightsRequest*,
                                                       v1::ListWeightsResponse* response) {
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (!principal.ok()) return Refuse(metrics_, context, "ListWeights", principal.status());
  const absl::Time start = absl::Now();
  for (const auto& weight : core_->weights().List(*principal)) {
    FillWeightInfo(*weight, response->add_weights());
  }
  LogRpc(metrics_, "ListWeights", "", absl::OkStatus(), start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<v1::WeightGradChunk>* LossServiceImpl::TakeWeightGrad(
    grpc::CallbackServerContext* context, const v1::TakeWeightGradRequest* request) {
  return new TakeGradReactor(Authenticate(context), &core_->weights(), request,
                             limits_.stream_chunk_bytes, metrics_);
}

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

// ForwardStream: the header request, then its tensors' bytes field by field;
// at the end of the stream, the assembled request goes through Forward.
class ForwardStreamReactor : public grpc::ServerReadReactor<v1::ForwardRequestChunk> {
 public:
  // A failed `admitted` (authentication) finishes the call before reading.
  ForwardStreamReactor(grpc::CallbackServerContext* context, v1::ForwardResponse* response,
                       int64_t max_bytes, const absl::Status& admitted, ServiceMetrics* metrics,
                       std::function<void(ForwardStreamReactor*)> start_forward)
      : context_(context),
        response_(response),
        metrics_(metrics),
        max_bytes_(max_bytes),
        start_forward_(std::move(start_forward)) {
    if (!admitted.ok()) {
      Fail(admitted);
      return;
    }
    StartRead(&chunk_);
  }

  const v1::ForwardRequest* request() const { return &request_; }
  v1::ForwardResponse* response() const { return response_; }
  void Complete(const absl::Status& status) { Finish(ToGrpcStatus(status)); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (context_->IsCancelled()) return Fail(absl::CancelledError("cancelled by the client"));
      absl::Status status = CheckComplete();
      if (!status.ok()) return Fail(status);
      start_forward_(this);  // finishes through Complete()
      return;
    }
    absl::Status status = Take();
    if (!status.ok()) return Fail(status);
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  void Fail(const absl::Status& status) {
    LogRpc(metrics_, "ForwardStream", "", status, absl::Now());
    Complete(status);
  }

  absl::Status Take() {
    if (!started_) {
      if (!chunk_.has_request()) {
        return absl::InvalidArgumentError("request: required on the first message");
      }
      request_ = std::move(*chunk_.mutable_request());
      started_ = true;
      // Size every announced tensor up front (bounded by the limit).
      int64_t total = 0;
      for (int f = v1::TENSOR_FIELD_HIDDEN; f <= v1::TENSOR_FIELD_CLASS_WEIGHT; ++f) {
        v1::Tensor* t = ForwardField(request_, static_cast<v1::TensorField>(f));
        if (t == nullptr || !t->data().empty()) continue;
        const absl::StatusOr<int64_t> bytes_or = TensorBytes(*t, FieldName(static_cast<v1::TensorField>(f)));
        if (!bytes_or.ok()) return bytes_or.status();
        const int64_t bytes = *bytes_or;
        total += bytes;
        if (total > max_bytes_) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "ForwardStream: the request's tensors need ", total, " bytes, over the limit of ",
              max_bytes_));
        }
        t->mutable_data()->reserve(static_cast<size_t>(bytes));
        expected_[f] = bytes;
      }
      return absl::OkStatus();
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
    if (static_cast<int64_t>(t->data().size() + data.size()) > expected->second) {
      return absl::InvalidArgumentError(absl::StrCat(
          FieldName(field), ": more bytes than its ", expected->second));
    }
    t->mutable_data()->append(data);
    return absl::OkStatus();
  }

  absl::Status CheckComplete() {
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

  grpc::CallbackServerContext* const context_;
  v1::ForwardResponse* const response_;
  ServiceMetrics* const metrics_;
  const int64_t max_bytes_;
  const std::function<void(ForwardStreamReactor*)> start_forward_;
  v1::ForwardRequestChunk chunk_;
  v1::ForwardRequest request_;
  bool started_ = false;
  absl::flat_hash_map<int, int64_t> expected_;
};

// BackwardStream: the response with the gradients' dtypes and shapes, then
// their bytes in chunks.
class BackwardStreamReactor : public grpc::ServerWriteReactor<v1::BackwardResponseChunk> {
 public:
  explicit BackwardStreamReactor(int64_t chunk_bytes) : chunk_bytes_(chunk_bytes) {}

  // Called once the gradients are computed (or failed).
  void Start(const absl::Status& status, BackwardOutcome outcome, double queue_ms,
             double engine_ms, const v1::BackwardRequest& request) {
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    v1::BackwardResponse* header = message_.mutable_response();
    auto add = [&](HostTensor&& t, bool in_shm, const v1::SharedMemorySlice& slice,
                   v1::Tensor* meta, v1::TensorField field) {
      std::string data = std::move(t.data);
      t.data.clear();
      EncodeGradient(std::move(t), in_shm, slice, meta);  // dtype, shape (and slice)
      meta->clear_data();
      if (!in_shm) parts_.push_back({field, std::move(data)});
    };
    add(std::move(outcome.grad_hidden), outcome.grad_hidden_in_shm, request.grad_hidden_out(),
        header->mutable_grad_hidden(), v1::TENSOR_FIELD_GRAD_HIDDEN);
    if (outcome.grad_weight) {
      add(std::move(*outcome.grad_weight), outcome.grad_weight_in_shm,
          request.grad_weight_out(), header->mutable_grad_weight(),
          v1::TENSOR_FIELD_GRAD_WEIGHT);
    }
    if (outcome.grad_bias) {
      add(std::move(*outcome.grad_bias), outcome.grad_bias_in_shm, request.grad_bias_out(),
          header->mutable_grad_bias(), v1::TENSOR_FIELD_GRAD_BIAS);
    }
    header->mutable_stats()->set_queue_ms(queue_ms);
    header->mutable_stats()->set_engine_ms(engine_ms);
    StartWrite(&message_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke"));
      return;
    }
    message_.Clear();
    while (part_ < parts_.size() && offset_ >= parts_[part_].data.size()) {
      ++part_;
      offset_ = 0;
    }
    if (part_ == parts_.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    const Part& p = parts_[part_];
    const size_t n = std::min(p.data.size() - offset_, static_cast<size_t>(chunk_bytes_));
    message_.mutable_chunk()->set_field(p.field);
    message_.mutable_chunk()->set_data(p.data.data() + offset_, n);
    offset_ += n;
    StartWrite(&message_);
  }

  void OnDone() override { delete this; }

 private:
  struct Part {
    v1::TensorField field;
    std::string data;
  };
  const int64_t chunk_bytes_;
  v1::BackwardResponseChunk message_;
  std::vector<Part> parts_;
  size_t part_ = 0, offset_ = 0;
};

}  // namespace

grpc::ServerReadReactor<v1::ForwardRequestChunk>* LossServiceImpl::ForwardStream(
    grpc::CallbackServerContext* context, v1::ForwardResponse* response) {
  absl::StatusOr<std::string> principal = Admit(context);
  return new ForwardStreamReactor(
      context, response, limits_.max_stream_request_bytes, principal.status(), metrics_,
      [this, context, principal = principal.value_or("")](ForwardStreamReactor* reactor) {
        StartForward(context, principal, reactor->request(), reactor->response(),
                     "ForwardStream",
                     [reactor](const absl::Status& status) { reactor->Complete(status); });
      });
}

grpc::ServerWriteReactor<v1::BackwardResponseChunk>* LossServiceImpl::BackwardStream(
    grpc::CallbackServerContext* context, const v1::BackwardRequest* request) {
  auto* reactor = new BackwardStreamReactor(limits_.stream_chunk_bytes);
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (!principal.ok()) {
    LogRpc(metrics_, "BackwardStream", "", principal.status(), absl::Now());
    reactor->Start(principal.status(), BackwardOutcome(), 0, 0, *request);
    return reactor;
  }
  auto outcome = std::make_shared<BackwardOutcome>();
  auto stats = std::make_shared<CallStats>();
  StartBackward(context, *principal, request, "BackwardStream", outcome, stats,
                [=](const absl::Status& status) {
                  int64_t sent = 0;
                  for (const HostTensor* t : {&outcome->grad_hidden,
                                              outcome->grad_weight ? &*outcome->grad_weight : nullptr,
                                              outcome->grad_bias ? &*outcome->grad_bias : nullptr}) {
                    if (t != nullptr) sent += static_cast<int64_t>(t->data.size());
                  }
                  metrics_->AddBytes("BackwardStream",
                                     static_cast<int64_t>(request->ByteSizeLong()), sent);
                  reactor->Start(status, std::move(*outcome), stats->queue_ms,
                                 stats->engine_ms, *request);
                });
  return reactor;
}

grpc::ServerUnaryReactor* LossServiceImpl::RegisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterSharedMemoryRequest* request,
    v1::RegisterSharedMemoryResponse* response) {
  const absl::Time start = absl::Now();
  absl::Status status = absl::FailedPreconditionError(
      "shared memory is disabled on this server; start it with --enable_shared_memory");
  std::string what;
  absl::StatusOr<std::string> principal = Admit(context);
  if (!principal.ok()) {
    status = principal.status();
  } else if (shared_memory_ != nullptr) {
    absl::StatusOr<RegisteredRegion> region;
    if (request->has_cuda_ipc_handle()) {
      what = "cuda_ipc ";
      region = shared_memory_->RegisterCudaIpc(request->cuda_ipc_handle(), request->bytes(),
                                               core_->engine(), *principal);
    } else {
      what = absl::StrCat("shm=", request->shm_name(), " ");
      region = shared_memory_->Register(request->shm_name(), request->bytes(), *principal);
    }
    status = region.status();
    if (region.ok()) {
      response->set_region_id(region->region_id);
      response->set_bytes(region->bytes);
    }
  }
  LogRpc(metrics_, "RegisterSharedMemory", what, status, start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* LossServiceImpl::UnregisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
    v1::UnregisterSharedMemoryResponse* response) {
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (!principal.ok()) return Refuse(metrics_, context, "UnregisterSharedMemory", principal.status());
  const absl::Time start = absl::Now();
  response->set_unregistered(shared_memory_ != nullptr &&
                             shared_memory_->Unregister(request->region_id(), *principal));
  LogRpc(metrics_, "UnregisterSharedMemory", "", absl::OkStatus(), start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

namespace {

void ToProto(const HistogramSnapshot& h, v1::Histogram* out) {
  out->mutable_upper_bounds()->Assign(kLatencyBuckets.begin(), kLatencyBuckets.end());
  out->mutable_counts()->Assign(h.counts.begin(), h.counts.end());
  out->set_sum(h.sum);
  out->set_count(h.count);
}

}  // namespace

grpc::ServerUnaryReactor* LossServiceImpl::GetStats(grpc::CallbackServerContext* context,
                                                    const v1::GetStatsRequest*,
                                                    v1::GetStatsResponse* response) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (!principal.ok()) return Refuse(metrics_, context, "GetStats", principal.status());
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
  response->set_sessions_expired(s.gauges.sessions_expired);
  response->set_engine_forward_reruns(s.gauges.engine_forward_reruns);
  const Gauges& g = s.gauges;
  response->set_queued_requests(g.queued_requests);
  response->set_running_requests(g.running_requests);
  response->set_live_sessions(g.live_sessions);
  response->set_session_memory_bytes(g.session_memory_bytes);
  response->set_registered_weights(g.registered_weights);
  response->set_weight_memory_bytes(g.weight_memory_bytes);
  response->set_shared_memory_regions(g.shared_memory_regions);
  response->set_device_memory_bytes(g.device_memory_bytes);
  response->set_weight_device_memory_bytes(g.weight_device_memory_bytes);
  response->set_serving(g.serving);
  LogRpc(metrics_, "GetStats", "", absl::OkStatus(), start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace flce
