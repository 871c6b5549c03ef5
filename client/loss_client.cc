#include "client/loss_client.h"

#include <chrono>
#include <utility>

#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "proto/codec.h"

namespace flce {

std::unique_ptr<LossClient> LossClient::Create(const std::string& target,
                                               ClientOptions options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  auto channel = grpc::CreateCustomChannel(
      target, grpc::InsecureChannelCredentials(), args);
  return std::unique_ptr<LossClient>(new LossClient(std::move(channel), options));
}

LossClient::LossClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::LossService::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)) {}

void LossClient::Prepare(grpc::ClientContext& context) const {
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(options_.timeout));
}

v1::ForwardRequest BuildForwardRequest(const ForwardArgs& args) {
  const LossProblem& p = args.problem;
  v1::ForwardRequest request;
  CopyToProto(p.hidden, request.mutable_hidden());
  CopyToProto(p.weight, request.mutable_weight());
  if (p.bias) CopyToProto(*p.bias, request.mutable_bias());
  CopyToProto(p.target, request.mutable_target());
  v1::LossOptions* o = request.mutable_options();
  o->set_ignore_index(p.options.ignore_index);
  o->set_reduction(ToProto(p.options.reduction));
  o->set_label_smoothing(p.options.label_smoothing);
  if (p.class_weight) CopyToProto(*p.class_weight, o->mutable_class_weight());
  if (p.options.logit_softcap) o->set_logit_softcap(*p.options.logit_softcap);
  o->set_z_loss_scale(p.options.z_loss_scale);
  request.set_need_backward(args.need_backward);
  request.set_backward_mode(ToProto(args.mode));
  request.mutable_outputs()->set_lse(args.want_lse);
  request.mutable_outputs()->set_per_row_loss(args.want_per_row_loss);
  return request;
}

absl::StatusOr<RemoteForward> LossClient::Forward(const ForwardArgs& args) {
  const v1::ForwardRequest request = BuildForwardRequest(args);
  grpc::ClientContext context;
  Prepare(context);
  v1::ForwardResponse response;
  const absl::Time start = absl::Now();
  FLCE_RETURN_IF_ERROR(FromGrpcStatus(stub_->Forward(&context, request, &response)));
  RemoteForward out;
  out.times.rpc_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  out.times.queue_ms = response.stats().queue_ms();
  out.times.engine_ms = response.stats().engine_ms();
  FLCE_ASSIGN_OR_RETURN(out.loss, MoveFromProto(response.mutable_loss(), "loss"));
  FLCE_ASSIGN_OR_RETURN(out.z_loss, MoveFromProto(response.mutable_z_loss(), "z_loss"));
  if (response.has_lse()) {
    FLCE_ASSIGN_OR_RETURN(out.lse, MoveFromProto(response.mutable_lse(), "lse"));
  }
  if (response.has_per_row_loss()) {
    FLCE_ASSIGN_OR_RETURN(out.per_row_loss,
                          MoveFromProto(response.mutable_per_row_loss(), "per_row_loss"));
  }
  out.num_valid = response.num_valid();
  out.num_correct = response.num_correct();
  out.session_id = response.session_id();
  out.mode = FromProto(response.backward_mode());
  return out;
}

absl::StatusOr<RemoteGradients> LossClient::Backward(const BackwardArgs& args) {
  v1::BackwardRequest request;
  request.set_session_id(args.session_id);
  if (args.grad_output) CopyToProto(*args.grad_output, request.mutable_grad_output());
  request.set_keep_session(args.keep_session);
  if (args.grad_dtype) request.set_grad_dtype(ToProto(*args.grad_dtype));
  grpc::ClientContext context;
  Prepare(context);
  v1::BackwardResponse response;
  const absl::Time start = absl::Now();
  FLCE_RETURN_IF_ERROR(FromGrpcStatus(stub_->Backward(&context, request, &response)));
  RemoteGradients out;
  out.times.rpc_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  out.times.queue_ms = response.stats().queue_ms();
  out.times.engine_ms = response.stats().engine_ms();
  FLCE_ASSIGN_OR_RETURN(out.grad_hidden,
                        MoveFromProto(response.mutable_grad_hidden(), "grad_hidden"));
  FLCE_ASSIGN_OR_RETURN(out.grad_weight,
                        MoveFromProto(response.mutable_grad_weight(), "grad_weight"));
  if (response.has_grad_bias()) {
    FLCE_ASSIGN_OR_RETURN(out.grad_bias,
                          MoveFromProto(response.mutable_grad_bias(), "grad_bias"));
  }
  return out;
}

absl::StatusOr<bool> LossClient::ReleaseSession(const std::string& session_id) {
  v1::ReleaseSessionRequest request;
  request.set_session_id(session_id);
  grpc::ClientContext context;
  Prepare(context);
  v1::ReleaseSessionResponse response;
  FLCE_RETURN_IF_ERROR(
      FromGrpcStatus(stub_->ReleaseSession(&context, request, &response)));
  return response.released();
}

absl::StatusOr<v1::GetServerInfoResponse> LossClient::GetServerInfo() {
  grpc::ClientContext context;
  Prepare(context);
  v1::GetServerInfoResponse response;
  FLCE_RETURN_IF_ERROR(FromGrpcStatus(
      stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &response)));
  return response;
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
LossClient::CheckHealth(const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::ClientContext context;
  Prepare(context);
  grpc::health::v1::HealthCheckResponse response;
  FLCE_RETURN_IF_ERROR(FromGrpcStatus(health_->Check(&context, request, &response)));
  return response.status();
}

}  // namespace flce
