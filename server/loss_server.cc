#include "server/loss_server.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/async_generic_service.h"
#include "kernels/status_macros.h"
#include "server/engine_factory.h"
#include "server/health_service.h"
#include "server/http_listen.h"
#include "server/sigbus_guard.h"
#include "spdlog/spdlog.h"

namespace flce {
namespace {

constexpr char kServiceName[] = "flce.v1.LossService";

absl::Status CheckOptions(const ServerOptions& o) {
  if (o.workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--workers: ", o.workers, "; expected >= 1"));
  }
  if (o.max_queued_requests < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_queued_requests: ", o.max_queued_requests, "; expected >= 0"));
  }
  if (o.max_health_watches < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_health_watches: ", o.max_health_watches, "; expected >= 0"));
  }
  if (o.stage_ahead_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stage_ahead_bytes: ", o.stage_ahead_bytes, "; expected >= 0"));
  }
  if (o.sessions.max_sessions < 0 || o.sessions.memory_budget_bytes < 0 ||
      o.sessions.max_sessions_per_principal < 0 || o.sessions.memory_bytes_per_principal < 0) {
    return absl::InvalidArgumentError(
        "--max_sessions, --session_memory_bytes and their _per_principal forms must be >= 0");
  }
  if (o.weight_memory_bytes < 0 || o.weight_device_memory_bytes < 0) {
    return absl::InvalidArgumentError(
        "--weight_memory_bytes and --weight_device_memory_bytes must be >= 0");
  }
  if (o.sessions.ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--session_ttl: ", absl::FormatDuration(o.sessions.ttl), "; expected > 0"));
  }
  if (o.max_message_bytes < (int64_t{64} << 10) || o.max_message_bytes > (int64_t{2} << 30) - 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_message_bytes: ", o.max_message_bytes,
        "; expected between 65536 and 2147483647 (protobuf's ceiling)"));
  }
  const RequestLimits& st = o.requests;
  if (st.max_streams < 1 || st.memory_bytes < 0 || st.max_streams_per_principal < 0 ||
      st.memory_bytes_per_principal < 0 || st.idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--max_streams must be >= 1, --stream_idle_timeout > 0, and --request_memory_bytes "
        "and the _per_principal forms >= 0");
  }
  const SharedMemoryLimits& shm = o.shared_memory;
  if (shm.max_regions < 1 || shm.max_regions > SigbusGuard::kCapacity ||
      shm.max_regions_per_principal < 0 || shm.max_bytes < 0 ||
      shm.max_bytes_per_principal < 0 || shm.max_server_bytes < 0 ||
      shm.max_server_bytes_per_principal < 0 || shm.server_region_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_shared_memory_regions must be in [1, ", SigbusGuard::kCapacity,
        "], --shared_memory_bytes, --region_memory_bytes and the _per_principal forms >= 0, "
        "--region_idle_timeout > 0"));
  }
  const CallChannelLimits& ch = o.call_channels;
  if (ch.max_channels < 0 || ch.max_channels > 1024 || ch.max_channels_per_principal < 0 ||
      ch.spin < absl::ZeroDuration() || ch.idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--max_call_channels must be in [0, 1024], --max_call_channels_per_principal and "
        "--call_channel_spin >= 0, --call_channel_idle_timeout > 0");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is not PEM"));
  }
  return text.str();
}

// Removes the reflection plugin (InitProtoReflectionServerBuilderPlugin adds
// it to every builder) from one builder.
class WithoutReflection : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
                                    return dynamic_cast<grpc::reflection::ProtoServerReflectionPlugin*>(
                                               p.get()) != nullptr;
                                  }),
                   plugins->end());
  }
};

// Every method of the health-only port but grpc.health.v1's.
class HealthOnly : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Refuse : public grpc::ServerGenericBidiReactor {
     public:
      Refuse() {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            "this port serves only grpc.health.v1 (--health_address)"));
      }
      void OnDone() override { delete this; }
    };
    return new Refuse;
  }
};

// Where the bulk port listens: options.bulk_address, with "auto" made the
// host of the gRPC address on a free port; empty: no bulk port.
std::string BulkAddress(const ServerOptions& o) {
  if (o.bulk_address != "auto") return o.bulk_address;
  const size_t colon = o.listen_address.rfind(':');
  std::string host = colon == std::string::npos ? "" : o.listen_address.substr(0, colon);
  if (host.empty()) host = "0.0.0.0";
  if (!ParseHttpListenAddress(host + ":0", "", "").ok()) {
    SPDLOG_WARN("no bulk port: the host of --listen_address ({}) is not an address it can listen "
                "on; set --bulk_address (remote clients move large tensors over gRPC instead)",
                o.listen_address);
    return "";
  }
  return host + ":0";
}

// TLS (and mutual TLS) from the options, or plaintext when asked for.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const SecurityOptions& o) {
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert_file and --tls_key_file go together");
  }
  if (o.tls_cert_file.empty()) {
    if (!o.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca_file needs TLS: pass --tls_cert_file and --tls_key_file");
    }
    if (!o.insecure) {
      return absl::InvalidArgumentError(
          "no TLS certificate: pass --tls_cert_file and --tls_key_file, or --insecure to "
          "serve plaintext");
    }
    SPDLOG_WARN("serving plaintext (--insecure): tensors{} travel unencrypted",
                o.auth_tokens_file.empty() ? "" : " and bearer tokens");
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions ssl;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  FLCE_ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(o.tls_cert_file, "--tls_cert_file"));
  FLCE_ASSIGN_OR_RETURN(pair.private_key, ReadPem(o.tls_key_file, "--tls_key_file"));
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!o.tls_client_ca_file.empty()) {
    FLCE_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                          ReadPem(o.tls_client_ca_file, "--tls_client_ca_file"));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<LossServer>> LossServer::Start(
    const ServerOptions& options) {
  FLCE_RETURN_IF_ERROR(CheckOptions(options));
  FLCE_ASSIGN_OR_RETURN(std::unique_ptr<LossEngine> engine,
                        CreateEngine(options.backend, options.engine));
  return Start(options, std::move(engine));
}

absl::StatusOr<std::unique_ptr<LossServer>> LossServer::Start(
    const ServerOptions& options, std::unique_ptr<LossEngine> engine) {
  FLCE_RETURN_IF_ERROR(CheckOptions(options));
  FLCE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                        Credentials(options.security));
  std::unique_ptr<LossServer> s(new LossServer());
  s->options_ = options;
  if (options.security.auth_tokens_file.empty()) {
    s->auth_ = Authenticator::Anonymous();
  } else {
    FLCE_ASSIGN_OR_RETURN(s->auth_,
                          Authenticator::FromTokensFile(options.security.auth_tokens_file));
  }
  s->auth_->set_use_client_certificates(!options.security.tls_client_ca_file.empty());
  s->engine_ = std::move(engine);
  s->sessions_ = std::make_unique<SessionStore>(options.sessions);
  s->weights_ = std::make_unique<WeightRegistry>(options.weight_memory_bytes,
                                                 options.weight_device_memory_bytes);
  s->core_ = std::make_unique<LossCore>(s->engine_.get(), s->sessions_.get(), s->weights_.get(),
                                        options.stage_ahead_bytes);
  s->queue_ = std::make_unique<WorkQueue>(options.workers, options.max_queued_requests);
  // Always there: regions of server memory need no flag.
  s->shared_memory_ = std::make_unique<SharedMemoryRegistry>(options.shared_memory);
  s->admission_ = std::make_unique<RequestAdmission>(options.requests);
  LossServer* raw = s.get();
  ServiceLimits limits;
  limits.max_message_bytes = options.max_message_bytes;
  limits.shared_memory_enabled = options.enable_shared_memory;
  s->service_ = std::make_unique<LossServiceImpl>(
      s->core_.get(), s->queue_.get(), limits, s->admission_.get(), s->shared_memory_.get(),
      s->auth_.get(), &s->metrics_, [raw] { return raw->CurrentGauges(); },
      [raw] { raw->MarkUnhealthy(); });
  if (options.enable_shared_memory) {
    s->channels_ = std::make_unique<CallChannels>(options.call_channels, options.max_message_bytes,
                                                  s->service_.get(), s->admission_.get(),
                                                  &s->metrics_);
    s->service_->set_call_channels(s->channels_.get());
  }

  if (const std::string bulk = BulkAddress(options); !bulk.empty()) {
    BulkHttpOptions bulk_options;
    bulk_options.address = bulk;
    bulk_options.max_connections = options.max_bulk_connections;
    bulk_options.max_connections_per_address = options.max_bulk_connections_per_address;
    bulk_options.idle_timeout = options.requests.idle_timeout;
    if (!options.security.tls_cert_file.empty()) {
      FLCE_ASSIGN_OR_RETURN(bulk_options.tls_cert_pem,
                            ReadPem(options.security.tls_cert_file, "--tls_cert_file"));
      FLCE_ASSIGN_OR_RETURN(bulk_options.tls_key_pem,
                            ReadPem(options.security.tls_key_file, "--tls_key_file"));
    }
    FLCE_ASSIGN_OR_RETURN(s->bulk_http_,
                          BulkHttpServer::Start(bulk_options, s->shared_memory_.get(),
                                                &s->metrics_));
    s->service_->set_bulk_port(s->bulk_http_->port());
    SPDLOG_INFO("bulk transfers over HTTP{} on port {} ({})", s->bulk_http_->tls() ? "S" : "",
                s->bulk_http_->port(), bulk);
  }

  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // grpc.health.v1 of our own: its watches end when shutdown starts.
  s->health_ = std::make_unique<HealthService>(options.max_health_watches);
  builder.RegisterService(s->health_.get());
  // Reflection answers without a token (gRPC serves it outside the
  // handlers that authenticate): with tokens it is off.
  // grpc.reflection.v1alpha is gRPC's plugin; v1, which newer tools ask
  // first, is served here.
  if (s->auth_->uses_tokens()) {
    builder.SetOption(std::make_unique<WithoutReflection>());
  } else {
    s->reflection_v1_ = std::make_unique<ReflectionV1Service>(std::vector<std::string>{
        "flce.v1.LossService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection"});
    builder.RegisterService(s->reflection_v1_.get());
  }
  // A port another process holds is refused, not shared (gRPC's default
  // SO_REUSEPORT would let two servers split the connections).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options.listen_address, credentials, &s->port_);
  // Engine calls can run for minutes: let clients keep idle connections
  // alive with pings every 10 s or more, and ping them every minute.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60'000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20'000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10'000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "--listen_address: cannot listen on ", options.listen_address));
  }
  if (!options.health_address.empty()) {
    // Plaintext and only grpc.health.v1: for kubelet's gRPC probes, which
    // do not speak TLS.
    grpc::ServerBuilder health_builder;
    health_builder.SetOption(std::make_unique<WithoutReflection>());
    s->health_port_service_ = std::make_unique<HealthService>(options.max_health_watches);
    health_builder.RegisterService(s->health_port_service_.get());
    s->health_only_ = std::make_unique<HealthOnly>();
    health_builder.RegisterCallbackGenericService(s->health_only_.get());
    health_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    health_builder.AddListeningPort(options.health_address, grpc::InsecureServerCredentials(),
                                    &s->health_port_);
    s->health_server_ = health_builder.BuildAndStart();
    if (s->health_server_ == nullptr || s->health_port_ == 0) {
      return absl::UnavailableError(
          absl::StrCat("--health_address: cannot listen on ", options.health_address));
    }
    SPDLOG_INFO("health (grpc.health.v1 only, plaintext) on port {} ({})", s->health_port_,
                options.health_address);
  }
  s->SetServing(true);
  s->reaper_ = std::thread([raw] { raw->ReaperLoop(); });
  if (!options.metrics_address.empty()) {
    FLCE_ASSIGN_OR_RETURN(s->metrics_http_,
                          MetricsHttpServer::Start(options.metrics_address, [raw] {
                            return PrometheusText(raw->Metrics());
                          }));
    SPDLOG_INFO("metrics on http://{}/metrics (port {})", options.metrics_address,
                s->metrics_http_->port());
  }

  std::string devices;
  for (const DeviceInfo& d : s->engine_->devices()) devices += d.name;
  SPDLOG_INFO("flce {} listening on port {} ({}), backend={} device=\"{}\"", kVersion,
              s->port_, options.listen_address, s->engine_->backend(), devices);
  SPDLOG_INFO("security: transport={} auth={}",
              options.security.tls_cert_file.empty()        ? "plaintext"
              : options.security.tls_client_ca_file.empty() ? "tls"
                                                            : "mutual-tls",
              s->auth_->uses_tokens()                            ? "bearer-tokens"
              : !options.security.tls_client_ca_file.empty() ? "client-certificates"
                                                               : "none");
  SPDLOG_INFO(
      "limits: max_sessions={} session_memory_bytes={} weight_memory_bytes={} "
      "weight_device_memory_bytes={} session_ttl={} workers={} max_queued_requests={} "
      "max_message_bytes={} max_streams={} request_memory_bytes={} stream_idle_timeout={}{}",
      options.sessions.max_sessions, options.sessions.memory_budget_bytes,
      options.weight_memory_bytes, options.weight_device_memory_bytes,
      absl::FormatDuration(options.sessions.ttl), options.workers,
      options.max_queued_requests, options.max_message_bytes, options.requests.max_streams,
      options.requests.memory_bytes, absl::FormatDuration(options.requests.idle_timeout),
      options.enable_shared_memory
          ? absl::StrCat(" max_shared_memory_regions=", options.shared_memory.max_regions,
                         " shared_memory_bytes=", options.shared_memory.max_bytes)
          : std::string());
  return s;
}

LossServer::~LossServer() { Shutdown(absl::ZeroDuration()); }

void LossServer::SetServing(bool serving) {
  serving_ = serving;
  for (HealthService* health : {health_.get(), health_port_service_.get()}) {
    if (health == nullptr) continue;
    health->SetServingStatus(kServiceName, serving);
    health->SetServingStatus("", serving);
  }
}

int LossServer::metrics_port() const {
  return metrics_http_ ? metrics_http_->port() : 0;
}

int LossServer::bulk_port() const { return bulk_http_ ? bulk_http_->port() : 0; }

MetricsSnapshot LossServer::Metrics() const { return metrics_.Snapshot(CurrentGauges()); }

Gauges LossServer::CurrentGauges() const {
  Gauges g;
  g.queued_requests = queue_->queued();
  g.running_requests = queue_->running();
  g.live_sessions = sessions_->live_sessions();
  g.session_memory_bytes = sessions_->bytes_in_use();
  g.registered_weights = weights_->size();
  g.weight_memory_bytes = weights_->bytes_in_use();
  g.weight_device_memory_bytes = weights_->device_bytes_in_use();
  g.shared_memory_regions = shared_memory_->size();
  g.shared_memory_bytes = shared_memory_->bytes();
  g.region_memory_bytes = shared_memory_->server_bytes();
  g.call_channels = channels_ ? channels_->size() : 0;
  g.bulk_connections = bulk_http_ ? bulk_http_->connections() : 0;
  g.open_streams = admission_->open_streams();
  g.request_memory_bytes = admission_->bytes_in_use();
  g.stream_idle_timeouts = admission_->idle_timeouts();
  g.device_memory_bytes = engine_->device_memory_bytes();
  g.serving = serving_.load();
  g.sessions_expired = sessions_->expired_total();
  g.engine_forward_reruns = engine_->forward_reruns();
  g.forwards_staged = core_->forwards_staged();
  return g;
}

void LossServer::MarkUnhealthy() {
  SPDLOG_ERROR("engine unhealthy ({}); health is NOT_SERVING",
               std::string(engine_->health().message()));
  SetServing(false);
}

void LossServer::ReaperLoop() {
  while (!stop_reaper_.WaitForNotificationWithTimeout(options_.reap_interval)) {
    const int reaped = sessions_->ReapExpired();
    if (reaped > 0) SPDLOG_INFO("expired {} idle session(s)", reaped);
    const int regions = shared_memory_->ReapIdle();
    if (regions > 0) {
      SPDLOG_INFO("unregistered {} region(s) of server memory no call named for {}", regions,
                  absl::FormatDuration(options_.shared_memory.server_region_ttl));
    }
  }
}

int64_t LossServer::Drain(absl::Duration max_wait) {
  SPDLOG_INFO("drain: refusing new work; waiting up to {} for {} session(s) to finish",
              absl::FormatDuration(max_wait), sessions_->live_sessions());
  SetServing(false);
  service_->StartDraining();
  const absl::Time deadline = absl::Now() + max_wait;
  while (absl::Now() < deadline &&
         (sessions_->live_sessions() > 0 || queue_->running() + queue_->queued() > 0)) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  const int64_t left = sessions_->live_sessions();
  SPDLOG_INFO("drain: done, {} session(s) left", left);
  return left;
}

void LossServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ == nullptr) return;  // Start failed before serving
  SPDLOG_INFO("shutdown: draining (grace {})", absl::FormatDuration(grace));
  SetServing(false);
  // Open health watches end now (NOT_SERVING, then UNAVAILABLE): they
  // would hold the shutdown below until its deadline.
  for (HealthService* health : {health_.get(), health_port_service_.get()}) {
    if (health != nullptr) health->Shutdown();
  }
  const absl::Time deadline = absl::Now() + grace;
  // Channels take no new call; theirs in flight, like the RPCs', have until
  // the deadline.
  if (channels_ != nullptr) channels_->StopAll(deadline);
  // Refuses new RPCs, waits for those in flight until the deadline, then
  // cancels them; their tasks see the cancellation between chunks.
  server_->Shutdown(absl::ToChronoTime(deadline));
  if (health_server_ != nullptr) health_server_->Shutdown(std::chrono::system_clock::now());
  bulk_http_.reset();  // transfers in flight fail; the calls that use them are over
  if (channels_ != nullptr) channels_->Shutdown(deadline);
  queue_->Shutdown();
  stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
  SPDLOG_INFO("shutdown: done ({} session(s) dropped)", sessions_->live_sessions());
}

}  // namespace flce
