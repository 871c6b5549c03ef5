#ifndef FLCE_SERVER_LOSS_SERVER_H_
#define FLCE_SERVER_LOSS_SERVER_H_

// The flce server as a value: engine, sessions, work queue, the gRPC server
// with health checking and reflection, and the session reaper.

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "kernels/loss_engine.h"
#include "server/auth.h"
#include "server/bulk_http.h"
#include "server/call_channel.h"
#include "server/engine_factory.h"
#include "server/health_service.h"
#include "server/loss_core.h"
#include "server/loss_service.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/reflection_v1.h"
#include "server/request_admission.h"
#include "server/session_store.h"
#include "server/shared_memory.h"
#include "server/weight_registry.h"
#include "server/work_queue.h"

namespace flce {

// Transport security and authentication (server/auth.h).
struct SecurityOptions {
  // PEM files of the server's certificate chain and key: TLS. Both or
  // neither.
  std::string tls_cert_file, tls_key_file;
  // PEM file of the CAs that sign client certificates: mutual TLS (clients
  // without a certificate it verifies cannot connect). Needs TLS.
  std::string tls_client_ca_file;
  // "<principal> <token>" lines: every loss-service call must carry a
  // bearer token.
  std::string auth_tokens_file;
  // Serve plaintext. Without TLS the server refuses to start unless this is
  // set, so plaintext is always a decision.
  bool insecure = false;
};

struct ServerOptions {
  // host:port; port 0 picks a free port (read it back with port()).
  std::string listen_address = "0.0.0.0:50051";
  SecurityOptions security;
  std::string backend = "auto";  // auto, cuda or cpu
  SessionLimits sessions;
  // Budget of the registered weights' bytes (latest versions).
  int64_t weight_memory_bytes = int64_t{32} << 30;
  // Budget of the device copies and gradient sums registered weights keep
  // on the engine's device (all versions alive); past it the host serves.
  int64_t weight_device_memory_bytes = int64_t{32} << 30;
  // Accept tensors in same-host clients' POSIX shared memory.
  bool enable_shared_memory = false;
  SharedMemoryLimits shared_memory;
  // Call channels (OpenCallChannel), with shared memory only.
  CallChannelLimits call_channels;
  // Requests in flight: their memory, open client streams, idle timeout.
  RequestLimits requests;
  int workers = 1;               // concurrent engine calls
  int max_queued_requests = 64;  // waiting beyond the running ones
  // Device memory for X of Forward calls copied onto the device when they
  // arrive (from regions of server memory), while they wait for the engine
  // (LossCore::StageAhead); 0: X uploaded in its call.
  int64_t stage_ahead_bytes = int64_t{256} << 20;
  int64_t max_message_bytes = int64_t{256} << 20;
  absl::Duration reap_interval = absl::Seconds(5);
  // host:port of the Prometheus endpoint (GET /metrics); empty: none.
  std::string metrics_address;
  // host:port of a plaintext port serving only grpc.health.v1 (for probes
  // that cannot speak TLS, like kubelet's); empty: none.
  std::string health_address;
  // grpc.health.v1 Watch calls open at once, per port.
  int max_health_watches = 256;
  // host:port of the bulk HTTP port (server/bulk_http.h), which moves the
  // bytes of regions of server memory for remote clients; "auto": the
  // host of listen_address on a free port; empty: none (clients then use
  // WriteRegion / ReadRegion). TLS and its certificate follow `security`.
  std::string bulk_address = "auto";
  int max_bulk_connections = 512;
  int max_bulk_connections_per_address = 128;
  EngineOptions engine;
};

class LossServer {
 public:
  // Validates `options`, creates the engine and starts serving.
  // INVALID_ARGUMENT for bad options, UNIMPLEMENTED for a backend not built
  // in, UNAVAILABLE if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<LossServer>> Start(const ServerOptions& options);
  // The same with a given engine instead of one made from options.backend
  // (embedding flce, tests).
  static absl::StatusOr<std::unique_ptr<LossServer>> Start(const ServerOptions& options,
                                                           std::unique_ptr<LossEngine> engine);

  ~LossServer();  // Shutdown(absl::ZeroDuration()) if still running

  // The bound port, and the metrics endpoint's and the bulk port's (0
  // without one).
  int port() const { return port_; }
  int metrics_port() const;
  int bulk_port() const;
  int health_port() const { return health_port_; }

  // The counters and the current gauges (what /metrics and GetStats show).
  MetricsSnapshot Metrics() const;
  // The gauges alone, read from their owners now.
  Gauges CurrentGauges() const;
  const LossEngine& engine() const { return *engine_; }

  // Turns health NOT_SERVING for good (the engine reported a sticky failure).
  void MarkUnhealthy();

  // Rolling-upgrade drain: health turns NOT_SERVING and new work is refused
  // (UNAVAILABLE, "draining") while calls on existing sessions are served,
  // until no session is left or `max_wait` passed. Returns the sessions
  // still live. Call Shutdown after it.
  int64_t Drain(absl::Duration max_wait);

  // Graceful stop: health turns NOT_SERVING, new RPCs are refused, RPCs in
  // flight get up to `grace` to finish and are cancelled after it; then the
  // workers and the reaper stop. Idempotent.
  void Shutdown(absl::Duration grace);

 private:
  LossServer() = default;
  void ReaperLoop();
  // Health of both listening servers, and the serving gauge.
  void SetServing(bool serving);

  ServerOptions options_;
  std::unique_ptr<LossEngine> engine_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<SessionStore> sessions_;
  std::unique_ptr<WeightRegistry> weights_;
  std::unique_ptr<SharedMemoryRegistry> shared_memory_;
  std::unique_ptr<RequestAdmission> admission_;
  std::unique_ptr<LossCore> core_;
  std::unique_ptr<WorkQueue> queue_;
  std::unique_ptr<LossServiceImpl> service_;
  // After the service and the queue: gone before them.
  std::unique_ptr<CallChannels> channels_;
  std::unique_ptr<ReflectionV1Service> reflection_v1_;  // absent with tokens
  ServiceMetrics metrics_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::unique_ptr<BulkHttpServer> bulk_http_;
  std::atomic<bool> serving_{true};
  // grpc.health.v1 of the main port and of the health-only port (before
  // their servers: gone after them).
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<HealthService> health_port_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::CallbackGenericService> health_only_;
  std::unique_ptr<grpc::Server> health_server_;
  int port_ = 0;
  int health_port_ = 0;
  absl::Notification stop_reaper_;
  std::thread reaper_;
  bool shut_down_ = false;
};

}  // namespace flce

#endif  // FLCE_SERVER_LOSS_SERVER_H_
