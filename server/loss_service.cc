// LossServiceImpl: its plumbing (authentication, admission, the work queue,
// errors) and the handlers of sessions, information and shared memory. The
// compute handlers are in compute_handlers.cc, the weights' in
// weight_handlers.cc.

#include "server/loss_service.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/version.h"
#include "kernels/status_macros.h"
#include "proto/codec.h"
#include "server/handler_support.h"
#include "spdlog/spdlog.h"

namespace flce {

int64_t ServiceLimits::stream_chunk_bytes() const {
  // Room for a chunk's header (a WeightInfo, a BackwardResponse's shapes).
  return std::max<int64_t>(
      4096, std::min<int64_t>(int64_t{4} << 20, max_message_bytes - (int64_t{16} << 10)));
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

absl::StatusOr<std::string> LossServiceImpl::Authenticate(const Context* context) const {
  if (auth_ == nullptr) return std::string();
  return auth_->Authenticate(*context);
}

absl::Status LossServiceImpl::DrainingError() {
  return absl::UnavailableError(
      "server is draining for shutdown: send new work to another replica (sessions already "
      "here are still served)");
}

absl::StatusOr<std::string> LossServiceImpl::Admit(const Context* context) const {
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (principal.ok() && draining_) return DrainingError();
  return principal;
}

std::shared_ptr<SliceResolver> LossServiceImpl::ResolverFor(const std::string& principal) const {
  return shared_memory_->ResolverFor(principal);
}

absl::Status LossServiceImpl::Explain(absl::Status status, const Call& call) {
  // The engine stops with CANCELLED when the cancel hook fires; say which.
  if (status.code() == absl::StatusCode::kCancelled && DeadlinePassed(call)) {
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
  const char* rpc = call->record().rpc();
  auto task = [=]() {
    call->record().Stamp("running");
    absl::Status status = CheckAlive(*call, "while queued");
    if (status.ok()) status = GuardMemory([&] { return work(queued); }, rpc);
    done(status);
  };
  // A call with a thread of its own runs there when a worker's place is
  // free: one thread wake-up less.
  absl::Status submitted =
      call->HasOwnThread() ? queue_->RunHereOrSubmit(std::move(task)) : queue_->Submit(std::move(task));
  if (!submitted.ok()) done(submitted);
}

// --- Sessions, information, shared memory -----------------------------------

LossServiceImpl::Unary* LossServiceImpl::ReleaseSession(Context* context, const Bytes* in,
                                                        Bytes* out) {
  auto* call = NewUnary<v1::ReleaseSessionRequest, v1::ReleaseSessionResponse>(context, in, out,
                                                                               "ReleaseSession");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/false)) {
    ChannelReleaseSession(call, *principal, &call->request(), call->response());
  }
  return call;
}

void LossServiceImpl::ChannelReleaseSession(Call* call, const std::string& principal,
                                            const v1::ReleaseSessionRequest* request,
                                            v1::ReleaseSessionResponse* response) {
  const std::string& id = request->session_id();
  call->record().SetDetail(SessionDetail(id));
  response->set_released(core_->Release(id, principal));
  call->Reply(absl::OkStatus());
}

LossServiceImpl::Unary* LossServiceImpl::GetServerInfo(Context* context, const Bytes* in,
                                                       Bytes* out) {
  auto* call = NewUnary<v1::GetServerInfoRequest, v1::GetServerInfoResponse>(context, in, out,
                                                                             "GetServerInfo");
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
  limits->set_max_shared_memory_regions(shared_memory_->limits().max_regions);
  limits->set_shared_memory_budget_bytes(shared_memory_->limits().max_bytes);
  limits->set_region_memory_budget_bytes(shared_memory_->limits().max_server_bytes);
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

LossServiceImpl::Unary* LossServiceImpl::GetStats(Context* context, const Bytes* in, Bytes* out) {
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
  response->set_forwards_staged(g.forwards_staged);
  response->set_queued_requests(g.queued_requests);
  response->set_running_requests(g.running_requests);
  response->set_live_sessions(g.live_sessions);
  response->set_session_memory_bytes(g.session_memory_bytes);
  response->set_registered_weights(g.registered_weights);
  response->set_weight_memory_bytes(g.weight_memory_bytes);
  response->set_shared_memory_regions(g.shared_memory_regions);
  response->set_call_channels(g.call_channels);
  response->set_region_memory_bytes(g.region_memory_bytes);
  response->set_bulk_connections(g.bulk_connections);
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
  const v1::RegisterSharedMemoryRequest& request = call->request();
  if (!limits_.shared_memory_enabled && !request.has_server_memory()) {
    call->Reply(absl::FailedPreconditionError(
        "shared memory is disabled on this server; start it with --enable_shared_memory "
        "(regions of server memory need no flag: server_memory)"));
    return call;
  }
  absl::StatusOr<RegisteredRegion> region;
  if (request.has_server_memory()) {
    call->record().SetDetail(absl::StrCat("server_memory bytes=", request.bytes(), " "));
    region = shared_memory_->RegisterServerMemory(request.bytes(), *principal,
                                                  core_->engine().host_locker());
  } else if (request.has_cuda_ipc_handle()) {
    call->record().SetDetail("cuda_ipc ");
    region = shared_memory_->RegisterCudaIpc(request.cuda_ipc_handle(), request.bytes(),
                                             core_->engine().device_memory(), *principal);
  } else if (request.has_cuda_ipc_event_handle()) {
    call->record().SetDetail("cuda_ipc_event ");
    region = shared_memory_->RegisterCudaIpcEvent(request.cuda_ipc_event_handle(), request.bytes(),
                                                  core_->engine().device_memory(), *principal);
  } else {
    call->record().SetDetail(absl::StrCat("shm=", LogSafe(request.shm_name()), " "));
    region = shared_memory_->Register(request.shm_name(), request.bytes(), *principal);
  }
  if (region.ok()) {
    call->response()->set_region_id(region->region_id);
    call->response()->set_bytes(region->bytes);
    if (!region->ticket.empty() && bulk_port_ != 0) {
      call->response()->set_bulk_port(bulk_port_);
      call->response()->set_bulk_ticket(region->ticket);
      call->response()->set_bulk_marks(true);
    }
    // A region whose id never reached its client would stay mapped for good.
    call->WhenOver([this, id = region->region_id, principal = *principal](bool delivered) {
      if (!delivered) shared_memory_->Unregister(id, principal);
    });
  }
  call->Reply(region.status());
  return call;
}

LossServiceImpl::Unary* LossServiceImpl::UnregisterSharedMemory(Context* context, const Bytes* in,
                                                                Bytes* out) {
  auto* call = NewUnary<v1::UnregisterSharedMemoryRequest, v1::UnregisterSharedMemoryResponse>(
      context, in, out, "UnregisterSharedMemory");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/false)) {
    call->response()->set_unregistered(
        shared_memory_->Unregister(call->request().region_id(), *principal));
    call->Reply(absl::OkStatus());
  }
  return call;
}

// --- Call channels -----------------------------------------------------------

LossServiceImpl::Unary* LossServiceImpl::OpenCallChannel(Context* context, const Bytes* in,
                                                         Bytes* out) {
  auto* call = NewUnary<v1::OpenCallChannelRequest, v1::OpenCallChannelResponse>(
      context, in, out, "OpenCallChannel");
  std::optional<std::string> principal = Accept(call, /*new_work=*/true);
  if (!principal) return call;
  if (channels_ == nullptr) {
    call->Reply(absl::FailedPreconditionError(
        "call channels need shared memory, which is disabled on this server; start it with "
        "--enable_shared_memory"));
    return call;
  }
  const v1::OpenCallChannelRequest& request = call->request();
  absl::StatusOr<std::shared_ptr<SharedRegion>> region =
      shared_memory_->Find(request.region_id(), *principal);
  if (!region.ok()) {
    call->Reply(absl::NotFoundError(absl::StrCat("region_id: ", region.status().message())));
    return call;
  }
  absl::StatusOr<std::string> id = channels_->Open(*std::move(region), request.request_bytes(),
                                                   request.response_bytes(), *principal);
  if (id.ok()) {
    call->record().SetDetail(absl::StrCat("channel=", LogSafe(*id, 8), " "));
    v1::OpenCallChannelResponse* response = call->response();
    response->set_channel_id(*id);
    response->set_spin_us(absl::ToInt64Microseconds(channels_->limits().spin));
    response->set_idle_timeout_us(absl::ToInt64Microseconds(channels_->limits().idle_timeout));
    // A channel whose id never reached its client would hold its thread
    // until the idle timeout.
    call->WhenOver([this, id = *id, principal = *principal](bool delivered) {
      if (!delivered) channels_->Close(id, principal);
    });
  }
  call->Reply(id.status());
  return call;
}

LossServiceImpl::Unary* LossServiceImpl::CloseCallChannel(Context* context, const Bytes* in,
                                                          Bytes* out) {
  auto* call = NewUnary<v1::CloseCallChannelRequest, v1::CloseCallChannelResponse>(
      context, in, out, "CloseCallChannel");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/false)) {
    call->record().SetDetail(
        absl::StrCat("channel=", LogSafe(call->request().channel_id(), 8), " "));
    call->response()->set_closed(channels_ != nullptr &&
                                 channels_->Close(call->request().channel_id(), *principal));
    call->Reply(absl::OkStatus());
  }
  return call;
}

}  // namespace flce
