#include "server/loss_service.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/codec.h"
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
  absl::StatusOr<ForwardCall> call = DecodeForward(*request);
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
               absl::StatusOr<Gradients> grads =
                   core->Backward(call, PrincipalOf(context), CancelFor(context));
               if (!grads.ok()) return this->Explain(grads.status(), context);
               MoveToProto(std::move(grads->grad_hidden),
                           response->mutable_grad_hidden());
               MoveToProto(std::move(grads->grad_weight),
                           response->mutable_grad_weight());
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
  response->set_running_requests(queue_->running());
  response->set_queued_requests(queue_->queued());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace flce
