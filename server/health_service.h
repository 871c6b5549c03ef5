#ifndef FLCE_SERVER_HEALTH_SERVICE_H_
#define FLCE_SERVER_HEALTH_SERVICE_H_

// grpc.health.v1.Health, the server's own: Check and Watch as the protocol
// says (a service's status, SERVICE_UNKNOWN to a watch of an unknown one
// and NOT_FOUND to its check), with two things gRPC's default service
// lacks. Shutdown() ends every open Watch — its last message NOT_SERVING,
// then UNAVAILABLE — and ends any later one the same way, so that an open
// watch (a load balancer's health checker, a client keeping its channel
// busy) never holds the server's shutdown for the whole grace; gRPC's
// default service keeps its watches open until the deadline cancels them.
// And open watches are bounded (RESOURCE_EXHAUSTED beyond the bound).

#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace flce {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // At most `max_watches` watches open at once.
  explicit HealthService(int max_watches);
  // The server that serves it must be shut down first (its watches done).
  ~HealthService() override;

  // The status of `service` ("" for the server as a whole), sent to its
  // watchers. Ignored after Shutdown().
  void SetServingStatus(const std::string& service, bool serving);

  // Every service NOT_SERVING; every open watch is sent that and ended
  // (UNAVAILABLE), and later ones are ended at once the same way.
  void Shutdown();

  int open_watches() const;

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request) override;

 private:
  class Watcher;

  // SERVICE_UNKNOWN for a service never given a status.
  ServingStatus StatusOf(const std::string& service) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Forget(Watcher* watcher);

  const int max_watches_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, ServingStatus> statuses_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace flce

#endif  // FLCE_SERVER_HEALTH_SERVICE_H_
