#include "server/health_service.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace flce {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch: sends each new status once (a status queued while a write is
// in flight replaces any queued before it: the watcher gets the latest),
// and ends the call when told to, after the last status, or when the
// client goes. At most one write in flight; Finish exactly once.
class HealthService::Watcher : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  Watcher(HealthService* owner, std::string service)
      : owner_(owner), service_(std::move(service)) {}

  const std::string& service() const { return service_; }

  // Queues `status`; with `end`, the call ends (UNAVAILABLE) once the
  // statuses queued are sent.
  void Send(ServingStatus status, bool end) {
    absl::MutexLock lock(&mu_);
    next_ = status;
    end_ = end_ || end;
    PumpLocked();
  }

  // Ends the call at once with `status`.
  void Refuse(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    FinishLocked(std::move(status));
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the watcher is gone"));
      return;
    }
    PumpLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (!writing_) FinishLocked(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    owner_->Forget(this);
    delete this;
  }

 private:
  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_) return;
    if (cancelled_) {
      FinishLocked(grpc::Status::CANCELLED);
      return;
    }
    if (next_.has_value()) {
      const ServingStatus status = *next_;
      next_.reset();
      if (status != sent_) {
        sent_ = status;
        response_.set_status(status);
        writing_ = true;
        StartWrite(&response_);
        return;
      }
    }
    if (end_) {
      FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down"));
    }
  }

  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(std::move(status));
  }

  HealthService* const owner_;
  const std::string service_;
  absl::Mutex mu_;
  HealthCheckResponse response_ ABSL_GUARDED_BY(mu_);
  std::optional<ServingStatus> sent_ ABSL_GUARDED_BY(mu_);
  std::optional<ServingStatus> next_ ABSL_GUARDED_BY(mu_);
  bool end_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

HealthService::HealthService(int max_watches) : max_watches_(max_watches) {}

HealthService::~HealthService() = default;

HealthService::ServingStatus HealthService::StatusOf(const std::string& service) const {
  const auto it = statuses_.find(service);
  return it == statuses_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second;
}

void HealthService::SetServingStatus(const std::string& service, bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  const ServingStatus status =
      serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
  statuses_[service] = status;
  // (Few watchers, each a write at most: the lock keeps their order.)
  for (Watcher* watcher : watchers_) {
    if (watcher->service() == service) watcher->Send(status, /*end=*/false);
  }
}

void HealthService::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  shut_down_ = true;
  for (auto& [service, status] : statuses_) status = HealthCheckResponse::NOT_SERVING;
  for (Watcher* watcher : watchers_) {
    watcher->Send(HealthCheckResponse::NOT_SERVING, /*end=*/true);
  }
}

int HealthService::open_watches() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(watchers_.size());
}

void HealthService::Forget(Watcher* watcher) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(watcher);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  ServingStatus status;
  {
    absl::MutexLock lock(&mu_);
    status = StatusOf(request->service());
  }
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::NOT_FOUND,
                     absl::StrCat("service: unknown service \"", request->service(), "\"")));
    return reactor;
  }
  response->set_status(status);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext* context, const HealthCheckRequest* request) {
  (void)context;
  auto* watcher = new Watcher(this, request->service());
  absl::MutexLock lock(&mu_);
  if (shut_down_) {
    watcher->Send(HealthCheckResponse::NOT_SERVING, /*end=*/true);
  } else if (static_cast<int>(watchers_.size()) >= max_watches_) {
    watcher->Refuse(
        grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                     absl::StrCat("grpc.health.v1 Watch: ", watchers_.size(),
                                  " watches open, the server's bound (--max_health_watches)")));
  } else {
    watchers_.insert(watcher);
    watcher->Send(StatusOf(request->service()), /*end=*/false);
  }
  return watcher;
}

}  // namespace flce
