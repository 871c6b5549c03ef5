#include "server/loss_service.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <memory>
#include <string>
#include <utility>

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

// The principal a request acts for. Authentication is not configured in this
// version, so every caller is the anonymous principal "".
std::string PrincipalOf(const grpc::CallbackServerContext*) { return ""; }

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

double MillisSince(absl::Time start) {
  return absl::ToDoubleMilliseconds(absl::Now() - start);
}

// One access-log line per finished RPC.
void LogRpc(const char* rpc, const std::string& detail, const absl::Status& status,
            absl::Time start) {
  SPDLOG_INFO("rpc={} {}code={} ms={:.1f}", rpc, detail,
              absl::StatusCodeToString(status.code()), MillisSince(start));
}

std::string ProblemDetail(const LossProblem& p) {
  return absl::StrCat("n=", p.rows(), " h=", p.hidden_size(), " v=", p.vocab(),
                      " dtype=", DTypeName(p.hidden.dtype), " ");
}

std::string SessionDetail(const std::string& id) {
  return id.empty() ? "" : absl::StrCat("session=", id.substr(0, 8), " ");
}

// Queues `work` (returning the RPC's status) and finishes the reactor with
// it; finishes at once if the queue refuses.
template <typename Work>
grpc::ServerUnaryReactor* Run(grpc::CallbackServerContext* context,
                              WorkQueue* queue, const char* rpc,
                              std::shared_ptr<std::string> detail, Work work) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time start = absl::Now();
  absl::Status submitted = queue->Submit([=]() mutable {
    absl::Status status = CheckAlive(context, "while queued");
    if (status.ok()) status = work(start);
    LogRpc(rpc, *detail, status, start);
    reactor->Finish(ToGrpcStatus(status));
  });
  if (!submitted.ok()) {
    LogRpc(rpc, *detail, submitted, start);
    reactor->Finish(ToGrpcStatus(submitted));
  }
  return reactor;
}

grpc::ServerUnaryReactor* Reject(grpc::CallbackServerContext* context,
                                 const char* rpc, const absl::Status& status) {
  LogRpc(rpc, "", status, absl::Now());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

LossServiceImpl::LossServiceImpl(LossCore* core, WorkQueue* queue, ServiceLimits limits,
                                 std::function<void()> on_engine_unhealthy)
    : core_(core),
      queue_(queue),
      limits_(limits),
      on_engine_unhealthy_(std::move(on_engine_unhealthy)) {}

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

grpc::ServerUnaryReactor* LossServiceImpl::Forward(
    grpc::CallbackServerContext* context, const v1::ForwardRequest* request,
    v1::ForwardResponse* response) {
  absl::StatusOr<ForwardCall> call =
      DecodeForward(*request, core_->weights(), PrincipalOf(context));
  if (!call.ok()) return Reject(context, "Forward", call.status());
  auto detail = std::make_shared<std::string>(ProblemDetail(call->problem));
  LossCore* core = core_;
  return Run(context, queue_, "Forward", detail,
             [=, call = *std::move(call)](absl::Time start) -> absl::Status {
               const absl::Time engine_start = absl::Now();
               absl::StatusOr<ForwardOutcome> outcome =
                   core->Forward(call, PrincipalOf(context), CancelFor(context));
               if (!outcome.ok()) return this->Explain(outcome.status(), context);
               if (!outcome->session_id.empty()) {
                 // Nobody will learn this id if the caller is gone: free it.
                 absl::Status alive = CheckAlive(context, "while computing");
                 if (!alive.ok()) {
                   core->Release(outcome->session_id, PrincipalOf(context));
                   return alive;
                 }
               }
               ForwardResult& r = outcome->result;
               MoveToProto(std::move(r.loss), response->mutable_loss());
               MoveToProto(std::move(r.z_loss), response->mutable_z_loss());
               if (r.lse) MoveToProto(std::move(*r.lse), response->mutable_lse());
               if (r.per_row_loss) {
                 MoveToProto(std::move(*r.per_row_loss),
                             response->mutable_per_row_loss());
               }
               response->set_num_valid(r.num_valid);
               response->set_num_correct(r.num_correct);
               response->set_session_id(outcome->session_id);
               response->set_backward_mode(ToProto(outcome->mode));
               response->mutable_stats()->set_queue_ms(
                   absl::ToDoubleMilliseconds(engine_start - start));
               response->mutable_stats()->set_engine_ms(MillisSince(engine_start));
               *detail = SessionDetail(outcome->session_id) + *detail;
               return absl::OkStatus();
             });
}

grpc::ServerUnaryReactor* LossServiceImpl::Backward(
    grpc::CallbackServerContext* context, const v1::BackwardRequest* request,
    v1::BackwardResponse* response) {
  absl::StatusOr<BackwardCall> call = DecodeBackward(*request);
  if (!call.ok()) return Reject(context, "Backward", call.status());
  auto detail = std::make_shared<std::string>(SessionDetail(call->session_id));
  LossCore* core = core_;
  return Run(context, queue_, "Backward", detail,
             [=, call = *std::move(call)](absl::Time start) -> absl::Status {
               const absl::Time engine_start = absl::Now();
               absl::StatusOr<BackwardOutcome> grads =
                   core->Backward(call, PrincipalOf(context), CancelFor(context));
               if (!grads.ok()) return this->Explain(grads.status(), context);
               MoveToProto(std::move(grads->grad_hidden),
                           response->mutable_grad_hidden());
               if (grads->grad_weight) {
                 MoveToProto(std::move(*grads->grad_weight),
                             response->mutable_grad_weight());
               }
               if (grads->grad_bias) {
                 MoveToProto(std::move(*grads->grad_bias),
                             response->mutable_grad_bias());
               }
               response->mutable_stats()->set_queue_ms(
                   absl::ToDoubleMilliseconds(engine_start - start));
               response->mutable_stats()->set_engine_ms(MillisSince(engine_start));
               return absl::OkStatus();
             });
}

grpc::ServerUnaryReactor* LossServiceImpl::ReleaseSession(
    grpc::CallbackServerContext* context,
    const v1::ReleaseSessionRequest* request,
    v1::ReleaseSessionResponse* response) {
  const absl::Time start = absl::Now();
  response->set_released(core_->Release(request->session_id(), PrincipalOf(context)));
  LogRpc("ReleaseSession", SessionDetail(request->session_id()), absl::OkStatus(),
         start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* LossServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context, const v1::GetServerInfoRequest*,
    v1::GetServerInfoResponse* response) {
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
  response->set_live_sessions(sessions.live_sessions());
  response->set_session_memory_bytes(sessions.bytes_in_use());
  response->set_weight_memory_bytes(core_->weights().bytes_in_use());
  limits->set_weight_memory_budget_bytes(core_->weights().memory_budget_bytes());
  response->set_running_requests(queue_->running());
  response->set_queued_requests(queue_->queued());
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
                   v1::PutWeightResponse* response)
      : context_(context), weights_(weights), response_(response), start_(absl::Now()) {
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
    LogRpc("PutWeight", detail_, status, start_);
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
        weights_->Put(name_, PrincipalOf(context_), std::move(weight_), std::move(bias_)));
    FillWeightInfo(*registered, response_->mutable_weight());
    detail_ = absl::StrCat("weight=", name_, " version=", registered->version(), " bytes=",
                           total_, " ");
    return absl::OkStatus();
  }

  grpc::CallbackServerContext* const context_;
  WeightRegistry* const weights_;
  v1::PutWeightResponse* const response_;
  const absl::Time start_;
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
  TakeGradReactor(grpc::CallbackServerContext* context, WeightRegistry* weights,
                  const v1::TakeWeightGradRequest* request, int64_t chunk_bytes)
      : chunk_bytes_(chunk_bytes), start_(absl::Now()) {
    detail_ = absl::StrCat("weight=", request->weight().name(), " ");
    absl::Status status = Prepare(*weights, *request, PrincipalOf(context));
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
    LogRpc("TakeWeightGrad", detail_, status, start_);
    Finish(ToGrpcStatus(status));
  }

  const int64_t chunk_bytes_;
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
  return new PutWeightReactor(context, &core_->weights(), response);
}

grpc::ServerUnaryReactor* LossServiceImpl::DeleteWeight(grpc::CallbackServerContext* context,
                                                        const v1::DeleteWeightRequest* request,
                                                        v1::DeleteWeightResponse* response) {
  const absl::Time start = absl::Now();
  response->set_deleted(core_->weights().Delete(request->name(), PrincipalOf(context)));
  LogRpc("DeleteWeight", absl::StrCat("weight=", request->name(), " "), absl::OkStatus(), start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* LossServiceImpl::ListWeights(grpc::CallbackServerContext* context,
                                                       const v1::ListWeightsRequest*,
                                                       v1::ListWeightsResponse* response) {
  for (const auto& weight : core_->weights().List(PrincipalOf(context))) {
    FillWeightInfo(*weight, response->add_weights());
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<v1::WeightGradChunk>* LossServiceImpl::TakeWeightGrad(
    grpc::CallbackServerContext* context, const v1::TakeWeightGradRequest* request) {
  return new TakeGradReactor(context, &core_->weights(), request, limits_.stream_chunk_bytes);
}

}  // namespace flce
